"""Part ``nccl``: a one-rank NCCL process group — init, all_reduce, destroy — timed, twice.

    python benchmarks/gpu/nccl_pg.py --out nccl.json [--device cuda|cpu] [--tiny]

What a worker pays to (re)join a process group on its GPU: ``init_process_group("nccl",
device_id=cuda:0)`` (eager communicator creation) on an in-process ``HashStore``, the first
``all_reduce`` (checked: a one-rank sum is the input), steady ``all_reduce`` latency of a
4 KiB and a 64 MiB float32 tensor (medians; with one rank NCCL moves no data between GPUs,
so this is the cost of a collective call, not a bandwidth), a ``barrier`` and
``destroy_process_group``. Two cycles: the first pays for loading NCCL, the second is a
re-formed group (what ``train.steps()`` does after a failure). ``--device cpu``: gloo.

JSON ``cycles``: per cycle ``init_s``, ``first_allreduce_s``, ``allreduce_ms`` (per size),
``barrier_s``, ``destroy_s``, ``correct``. ``figures``: ``backend``, ``nccl_version``,
``init_s`` / ``reinit_s`` (cycles 1 and 2), ``first_allreduce_s``, ``allreduce_4KiB_ms``,
``allreduce_64MiB_ms``, ``destroy_s``.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import _common as c


def _cycle(device: str, sizes: dict[str, int], reps: int) -> dict[str, Any]:
    import torch  # heavy: torch
    import torch.distributed as dist  # heavy: torch

    backend = "nccl" if device == "cuda" else "gloo"
    kwargs: dict[str, Any] = {"device_id": torch.device("cuda", 0)} if device == "cuda" else {}
    out: dict[str, Any] = {}
    t0 = time.perf_counter()
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    c.sync(device)
    out["init_s"] = c.r(time.perf_counter() - t0)
    try:
        x = torch.full((1024,), 3.0, device=device)
        t0 = time.perf_counter()
        dist.all_reduce(x)
        c.sync(device)
        out["first_allreduce_s"] = c.r(time.perf_counter() - t0)
        out["correct"] = bool((x == 3.0).all().item())
        out["allreduce_ms"] = {}
        for name, n in sizes.items():
            t = torch.ones(n // 4, dtype=torch.float32, device=device)
            samples = c.timed(lambda t=t: dist.all_reduce(t), reps=reps, warmup=3, device=device)
            out["allreduce_ms"][name] = c.r(c.med(samples) * 1e3, 4)
        t0 = time.perf_counter()
        dist.barrier()
        c.sync(device)
        out["barrier_s"] = c.r(time.perf_counter() - t0)
    finally:
        t0 = time.perf_counter()
        dist.destroy_process_group()
        out["destroy_s"] = c.r(time.perf_counter() - t0)
    return out


def body(args: Any, result: dict[str, Any], deadline: c.Deadline) -> None:
    import torch  # heavy: torch

    if args.device == "cuda":
        torch.cuda.set_device(0)
    sizes = {"4KiB": 4096, "1MiB": 2**20} if args.tiny else {"4KiB": 4096, "64MiB": 64 * 2**20}
    reps = 5 if args.tiny else 50
    result["backend"] = "nccl" if args.device == "cuda" else "gloo"
    result["store"] = "HashStore (in-process)"
    result["cycles"] = []
    for _ in range(2):
        result["cycles"].append(_cycle(args.device, sizes, reps))
    first, second = result["cycles"]
    nccl_version = None
    if args.device == "cuda":
        try:
            nccl_version = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            pass
    f = result["figures"]
    f.update(backend=result["backend"], nccl_version=nccl_version, init_s=first["init_s"], reinit_s=second["init_s"],
             first_allreduce_s=first["first_allreduce_s"], destroy_s=first["destroy_s"])
    for name, ms in second["allreduce_ms"].items():
        f[f"allreduce_{name}_ms"] = ms
    if not (first["correct"] and second["correct"]):
        raise RuntimeError("a one-rank all_reduce changed its input")


def main(argv: list[str] | None = None) -> int:
    args = c.parser(__doc__).parse_args(argv)
    return c.run("nccl", args, body)


if __name__ == "__main__":
    sys.exit(main())
