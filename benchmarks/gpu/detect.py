"""Is there a CUDA GPU that torch can use here? (the first thing ``run.sh`` asks)

    python benchmarks/gpu/detect.py [--out detect.json]

Prints one line (the answer, with the reason) and writes the facts as JSON. Exit status:
0 a CUDA GPU torch can use; 2 no NVIDIA GPU on this machine (nothing to measure);
3 an NVIDIA GPU is there but this Python cannot use it (torch missing, a CPU-only torch
build, or ``torch.cuda.is_available()`` False: a driver older than torch's CUDA?).
Never raises; torch is imported only to ask it.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any


def _nvidia_smi_gpus() -> tuple[str | None, list[str], str | None]:
    """``(path, lines of nvidia-smi -L, error)``."""
    path = shutil.which("nvidia-smi")
    if path is None:
        return None, [], None
    try:
        out = subprocess.run([path, "-L"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return path, [], f"nvidia-smi -L: {type(exc).__name__}: {exc}"
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip().startswith("GPU ")]
    err = None if out.returncode == 0 else f"nvidia-smi -L exited {out.returncode}: {out.stderr.strip()[:200]}"
    return path, lines, err


def detect() -> tuple[int, str, dict[str, Any]]:
    smi, smi_gpus, smi_error = _nvidia_smi_gpus()
    facts: dict[str, Any] = {
        "python": sys.executable, "nvidia_smi": smi, "nvidia_smi_gpus": smi_gpus, "nvidia_smi_error": smi_error,
        "dev_nvidia": sorted(glob.glob("/dev/nvidia[0-9]*")),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "torch": None, "torch_cuda": None, "cuda_available": False, "device_count": 0, "devices": [],
    }
    try:
        import torch  # heavy: torch
    except Exception as exc:  # no torch at all in this Python
        facts["torch_error"] = f"{type(exc).__name__}: {exc}"
        torch = None
    if torch is not None:
        facts["torch"] = torch.__version__
        facts["torch_cuda"] = torch.version.cuda
        try:
            facts["cuda_available"] = bool(torch.cuda.is_available())
            if facts["cuda_available"]:
                facts["device_count"] = torch.cuda.device_count()
                facts["devices"] = [torch.cuda.get_device_name(i) for i in range(facts["device_count"])]
        except Exception as exc:
            facts["torch_cuda_error"] = f"{type(exc).__name__}: {exc}"
    hardware = bool(smi_gpus or facts["dev_nvidia"])
    if facts["cuda_available"] and facts["device_count"] > 0:
        return 0, f"CUDA GPU: {facts['device_count']} x {', '.join(sorted(set(facts['devices'])))} " \
                  f"(torch {facts['torch']}, CUDA {facts['torch_cuda']})", facts
    if torch is None:
        why = f"torch does not import in {sys.executable} ({facts['torch_error']})"
    elif facts["torch_cuda"] is None:
        why = f"torch {facts['torch']} has no CUDA"
    else:
        why = f"torch {facts['torch']} (CUDA {facts['torch_cuda']}) sees no usable device"
    if not hardware:
        where = "nvidia-smi not on PATH" if smi is None else "nvidia-smi lists no GPU"
        return 2, f"no CUDA GPU on this machine ({where}; {why})", facts
    seen = smi_gpus[0] if smi_gpus else f"{facts['dev_nvidia'][0]} exists"
    return 3, f"an NVIDIA GPU is here ({seen}) but this Python cannot use it: {why}", facts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, metavar="PATH", help="write the facts as JSON here")
    a = p.parse_args(argv)
    code, line, facts = detect()
    facts["exit_code"], facts["message"] = code, line
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(facts, indent=2) + "\n")
    print(line, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
