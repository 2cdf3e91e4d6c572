"""What every part of ``benchmarks/gpu/run.sh`` shares: its command line, its JSON, timing.

Each part is a script (``python benchmarks/gpu/<part>.py --out PATH [--device cuda|cpu]
[--tiny] [--budget-s S]``) that writes one JSON object to ``--out``::

    {"part": "flash_ckpt", "status": "ok" | "skipped" | "failed", "reason": str | null,
     "device": "cuda", "tiny": false, "seconds": 41.2, "figures": {...}, ...details}

``figures`` holds the part's key numbers (what ``summary.json`` collects); the rest is the
detail behind them. A part that is stopped by ``timeout`` (SIGTERM) still writes its JSON,
with ``status: failed`` and what it had measured so far, after its cleanups ran.

Only the standard library is imported here; torch is imported by the functions that need it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.append(str(REPO / "benchmarks"))  # benchmarks/_shared.py, shared with the CPU benchmarks

#: the name prefix of everything this benchmark puts in /dev/shm (run.sh removes leftovers)
SHM_PREFIX = "dlrover-gpubench"


class Skip(Exception):
    """Raised by a part that cannot run here (no CUDA, too little /dev/shm, no time left)."""


class Terminated(BaseException):
    """SIGTERM (``timeout`` ran out): unwinds through ``finally`` blocks so cleanups run."""


def parser(description: str | None) -> argparse.ArgumentParser:
    """The command line every part takes; a part adds its own options to it."""
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, metavar="PATH", help="write the part's JSON here (default: stdout only)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="where to measure (default cuda; cpu runs the same code paths, without the CUDA-only ones)")
    p.add_argument("--tiny", action="store_true", help="tiny sizes and few repetitions: a smoke test, not a measurement")
    p.add_argument("--budget-s", type=float, default=None,
                   help="seconds this part may take; it skips what would not fit (run.sh sets it)")
    return p


class Deadline:
    """Seconds left of a part's budget (``None``: no limit)."""

    def __init__(self, budget_s: float | None) -> None:
        self.t0 = time.monotonic()
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return float("inf") if self.budget_s is None else self.budget_s - self.elapsed()


def run(name: str, args: argparse.Namespace, body: Callable[[argparse.Namespace, dict[str, Any], Deadline], None],
        *, needs_cuda: bool = True) -> int:
    """Run a part's ``body(args, result, deadline)``, which fills ``result`` (and its
    ``figures``); write the JSON whatever happens. With ``--device cuda`` and
    ``needs_cuda``, a machine where torch has no CUDA device skips the part. Exit status:
    0 ok or skipped, 1 failed."""
    result: dict[str, Any] = {"part": name, "status": "ok", "reason": None, "device": args.device,
                              "tiny": bool(args.tiny), "seconds": None, "figures": {}}
    deadline = Deadline(args.budget_s)

    def on_term(signum: int, frame: Any) -> None:
        raise Terminated()

    signal.signal(signal.SIGTERM, on_term)
    try:
        if args.device == "cuda" and needs_cuda:
            require_cuda()
        if args.tiny and args.device == "cpu":
            import torch  # heavy: torch

            torch.set_num_threads(1)  # a smoke test on shared CI cores: no OpenMP threads spinning against others
        body(args, result, deadline)
    except Skip as exc:
        result["status"], result["reason"] = "skipped", str(exc)
    except Terminated:
        result["status"] = "failed"
        result["reason"] = f"terminated after {deadline.elapsed():.0f} s (the part's timeout); partial results kept"
    except KeyboardInterrupt:
        result["status"], result["reason"] = "failed", "interrupted"
    except Exception as exc:
        result["status"], result["reason"] = "failed", f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-4000:]
        traceback.print_exc()
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    result["seconds"] = round(deadline.elapsed(), 3)
    write_json(args.out, result)
    print(f"{name}: {result['status']}" + (f" ({result['reason']})" if result["reason"] else ""), flush=True)
    return 1 if result["status"] == "failed" else 0


def write_json(path: str | os.PathLike | None, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` atomically (nothing when ``path`` is None)."""
    if not path:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str, allow_nan=False) + "\n")
    os.replace(tmp, path)


def require_cuda() -> None:
    """Raise :class:`Skip` unless torch can use a CUDA device."""
    import torch  # heavy: torch

    if torch.version.cuda is None:
        raise Skip(f"needs CUDA: torch {torch.__version__} has no CUDA")
    if not torch.cuda.is_available() or torch.cuda.device_count() < 1:
        raise Skip("needs CUDA: torch.cuda.is_available() is False")


def sync(device: str) -> None:
    if device == "cuda":
        import torch  # heavy: torch

        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], *, reps: int, warmup: int, device: str,
          before: Callable[[], Any] | None = None) -> list[float]:
    """``warmup`` untimed calls, then ``reps`` timed ones (seconds, the device synchronised
    before and after each); ``before`` runs untimed ahead of every call."""
    samples = []
    for i in range(warmup + reps):
        if before is not None:
            before()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if i >= warmup:
            samples.append(time.perf_counter() - t0)
    return samples


def med(samples: list[float]) -> float | None:
    return statistics.median(samples) if samples else None


def r(x: float | None, digits: int = 6) -> float | None:
    """``x`` rounded to ``digits`` significant digits (None stays None)."""
    if x is None:
        return None
    return float(f"{x:.{digits}g}")


def gbps(nbytes: int, seconds: float | None) -> float | None:
    """Bandwidth in GB/s (10^9 bytes per second)."""
    return None if not seconds else r(nbytes / seconds / 1e9, 4)


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else r(a / b, 4)


def make_state(total_bytes: int, device: str, *, n_tensors: int = 16, seed: int = 0) -> dict[str, Any]:
    """``n_tensors`` equal bf16 tensors on ``device`` (rows of 4096), about ``total_bytes``
    in all, random and reproducible (the same seed gives the same bytes)."""
    import torch  # heavy: torch

    cols = 4096 if total_bytes >= n_tensors * 4096 * 2 else 64
    rows = max(1, total_bytes // (n_tensors * cols * 2))
    gen = torch.Generator(device=device).manual_seed(seed)
    return {f"layer{i:02d}.weight": torch.randn(rows, cols, dtype=torch.bfloat16, device=device, generator=gen)
            for i in range(n_tensors)}


def nbytes(tensors: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def state_module(tensors: dict[str, Any]) -> Any:
    """An ``nn.Module`` whose buffers are ``tensors`` (keys ``t00``...): a model's state as
    ``Checkpointer`` saves and restores it (``load_state_dict`` copies into them in place)."""
    import torch  # heavy: torch

    module = torch.nn.Module()
    for i, t in enumerate(tensors.values()):
        module.register_buffer(f"t{i:02d}", t)
    return module


def scratch_dir(tag: str) -> Path:
    """A fresh directory for files a part writes (``$GPU_BENCH_SCRATCH`` or the system's
    temporary directory, never OUTDIR: checkpoints are gigabytes); the caller removes it."""
    base = os.environ.get("GPU_BENCH_SCRATCH") or None
    if base:
        Path(base).mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"gpubench-{tag}-", dir=base))


def shm_dir() -> Path:
    return Path(os.environ.get("DLROVER_SHM_DIR", "/dev/shm"))


def shm_free_bytes() -> int:
    try:
        st = os.statvfs(shm_dir())
    except OSError:
        return 0
    return st.f_bavail * st.f_frsize


def empty_host_cache() -> None:
    """Give cached pinned host memory back (torch keeps freed pinned blocks for reuse)."""
    import torch  # heavy: torch

    for fn in (getattr(torch._C, "_host_emptyCache", None), getattr(torch.cuda, "empty_cache", None)):
        if fn is not None:
            try:
                fn()
            except Exception:
                pass


def host_facts() -> dict[str, Any]:
    return {"cpu_count": os.cpu_count(), "loadavg_1min": os.getloadavg()[0], "shm_dir": str(shm_dir()),
            "shm_free_bytes": shm_free_bytes(), "python": sys.version.split()[0]}
