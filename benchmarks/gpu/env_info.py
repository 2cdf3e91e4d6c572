"""Part ``env``: what this machine is — ``dlrover doctor --json``, the CUDA probe, torch's view.

    python benchmarks/gpu/env_info.py --out env.json [--device cuda|cpu]

JSON (besides the common keys, see ``_common.py``):

* ``doctor``: ``dlrover doctor --json`` as it printed it (run as ``python -m dlrover_core.cli``),
  ``doctor_s`` its wall time;
* ``probe``: ``CudaAccelerator().probe()`` (NVML when ``pynvml`` imports, else nvidia-smi)
  and ``probe_smi``: the same with ``use_nvml=False`` (the nvidia-smi path), each with
  ``probe_s``; ``null`` with ``probe_error`` when dlrover-plugin-cuda is not installed;
* ``torch``: version, CUDA and cuDNN versions, NCCL version, each device's properties;
* ``nvidia_smi``: the raw CSV of a query of clocks, power, memory, PCIe link;
* ``host``: cores, load average, /dev/shm free bytes (Flash Checkpoint needs two slots).

``figures``: ``gpu`` (model), ``gpu_count``, ``gpu_memory_mib``, ``driver``, ``cuda``,
``torch``, ``doctor_auto`` (what ``accelerator="auto"`` picks), ``probe_present``,
``probe_healthy``, ``shm_free_gib``.

Fails when the CUDA probe, on a machine where torch sees a GPU, reports it absent or
unhealthy (the probe is what the product relies on to pick ``cuda``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from typing import Any

import _common as c

SMI_QUERY = ("index,name,pci.bus_id,driver_version,memory.total,memory.used,power.draw,power.limit,"
             "clocks.sm,clocks.max.sm,temperature.gpu,pcie.link.gen.current,pcie.link.width.current")


def _doctor() -> tuple[Any, float, str | None]:
    t0 = time.perf_counter()
    try:
        out = subprocess.run([sys.executable, "-m", "dlrover_core.cli", "doctor", "--json"], capture_output=True,
                             text=True, timeout=60, cwd=c.REPO)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}"
    dt = time.perf_counter() - t0
    try:
        return json.loads(out.stdout), dt, None if out.returncode == 0 else f"exit {out.returncode}"
    except ValueError:
        return None, dt, f"exit {out.returncode}, not JSON: {(out.stdout + out.stderr)[-500:]}"


def _probe(use_nvml: bool | None) -> dict[str, Any]:
    import attrs

    from dlrover_plugin_cuda import CudaAccelerator

    t0 = time.perf_counter()
    report = CudaAccelerator(use_nvml=use_nvml).probe()
    d = {k: list(v) if isinstance(v, tuple) else v for k, v in attrs.asdict(report).items()}
    d["probe_s"] = c.r(time.perf_counter() - t0, 4)
    return d


def _torch_facts() -> dict[str, Any]:
    import torch  # heavy: torch

    facts: dict[str, Any] = {"version": torch.__version__, "cuda": torch.version.cuda,
                             "cuda_available": torch.cuda.is_available(), "devices": []}
    if facts["cuda_available"]:
        facts["cudnn"] = torch.backends.cudnn.version()
        try:
            facts["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:
            facts["nccl"] = f"unknown ({type(exc).__name__})"
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            facts["devices"].append({"index": i, "name": p.name, "capability": f"{p.major}.{p.minor}",
                                     "total_memory_mib": p.total_memory // 2**20,
                                     "multi_processor_count": p.multi_processor_count})
    return facts


def _nvidia_smi() -> str | None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, f"--query-gpu={SMI_QUERY}", "--format=csv"], capture_output=True, text=True,
                             timeout=15)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{type(exc).__name__}: {exc}"
    return (out.stdout + out.stderr).strip()


def body(args: Any, result: dict[str, Any], deadline: c.Deadline) -> None:
    doctor, doctor_s, doctor_error = _doctor()
    result.update(doctor=doctor, doctor_s=c.r(doctor_s, 4), doctor_error=doctor_error)
    try:
        result["probe"] = _probe(None)
        result["probe_smi"] = _probe(False)
    except ImportError as exc:
        result["probe"] = result["probe_smi"] = None
        result["probe_error"] = f"dlrover-plugin-cuda is not installed ({exc}); pip install -e plugins/cuda"
    torch_facts = _torch_facts()
    result.update(torch=torch_facts, nvidia_smi=_nvidia_smi(), host=c.host_facts())
    probe = result["probe"] or {}
    f = result["figures"]
    f.update(gpu=probe.get("model"), gpu_count=probe.get("count"), gpu_memory_mib=probe.get("memory_mb"),
             driver=probe.get("driver_version"), cuda=torch_facts["cuda"], torch=torch_facts["version"],
             doctor_auto=(doctor or {}).get("auto"), probe_present=probe.get("present"),
             probe_healthy=probe.get("healthy"), shm_free_gib=c.r(result["host"]["shm_free_bytes"] / 2**30, 3))
    problems = []
    if doctor is None:
        problems.append(f"dlrover doctor --json failed: {doctor_error}")
    if args.device == "cuda" and torch_facts["cuda_available"]:
        if result["probe"] is None:
            problems.append(result["probe_error"])
        elif not probe.get("present"):
            problems.append(f"torch sees a GPU but the cuda probe says absent: {probe.get('reason')}")
        elif not all(probe.get("healthy") or [False]):
            problems.append(f"the cuda probe reports an unhealthy GPU: healthy={probe.get('healthy')}")
        if doctor is not None and doctor.get("auto") != "cuda":
            problems.append(f"accelerator='auto' picks {doctor.get('auto')!r}, not 'cuda'")
    if problems:
        raise RuntimeError("; ".join(problems))


def main(argv: list[str] | None = None) -> int:
    args = c.parser(__doc__).parse_args(argv)
    return c.run("env", args, body, needs_cuda=False)


if __name__ == "__main__":
    sys.exit(main())
