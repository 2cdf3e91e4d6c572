"""Check dlrover-plugin-cuda on a machine with NVIDIA GPUs (a few minutes; not run by CI).

    python tests/gpu/check_cuda.py [--json PATH] [--state-mib 1024] [--reps 5] [--no-nvml]

1. Probe: what CudaAccelerator.probe() finds (count, model, memory, driver, CUDA, health).
2. Node check: CudaAccelerator.node_check() on every visible GPU (bf16 4096x4096 matmul,
   TFLOP/s) and, with two or more GPUs, an NCCL all-reduce among one process per GPU (bus
   bandwidth in GB/s, the nccl-tests convention busbw = 2(n-1)/n * bytes / time).
3. Flash Checkpoint: a snapshot of a GPU-resident state (bf16 tensors, --state-mib MiB) into
   the rank's shared-memory slot, exactly as Checkpointer.save does under an agent (the core's
   build_layout + MemorySnapshots.save), timed as the training loop would wait for it; then the
   same bytes copied with tensor.copy_(non_blocking=True) into one pinned host buffer, the
   device-to-host ceiling. Prints both bandwidths and their ratio (goal: >= 80%), and checks
   the snapshot reads back bit-exact.

Exit status: 0 everything ran and met its goal; 1 a check failed or missed its goal (an
unhealthy GPU, a slow snapshot); 2 no usable NVIDIA GPU here (the reason is printed).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SNAPSHOT_GOAL = 0.80
CHUNK_MIB = 64


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results as JSON here")
    p.add_argument("--state-mib", type=int, default=1024, help="size of the GPU state to snapshot, MiB (default 1024)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions of each copy (default 5; medians)")
    p.add_argument("--no-nvml", action="store_true", help="probe with nvidia-smi even where pynvml imports")
    p.add_argument("--skip-allreduce", action="store_true", help="no multi-process NCCL all-reduce")
    return p.parse_args(argv)


# ----- node check ---------------------------------------------------------------------------


def _allreduce_rank(rank: int, world: int, rendezvous: str, out_dir: str) -> None:
    """One process per GPU: join an NCCL group and run the accelerator's node check in it."""
    import torch
    import torch.distributed as dist

    from dlrover_plugin_cuda import CudaAccelerator

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{rendezvous}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    try:
        result = CudaAccelerator().node_check(group=dist.group.WORLD)
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
            {"matmul_tflops": result.matmul_tflops, "allreduce_gbps": result.allreduce_gbps,
             "elapsed_s": result.elapsed_s}))
    finally:
        dist.destroy_process_group()


def _node_check(count: int, skip_allreduce: bool) -> dict[str, Any]:
    import torch
    import torch.multiprocessing as mp

    from dlrover_plugin_cuda import CudaAccelerator

    acc = CudaAccelerator()
    per_gpu = []
    for i in range(count):
        with torch.cuda.device(i):
            r = acc.node_check()
        per_gpu.append({"device": i, "name": torch.cuda.get_device_name(i), "matmul_tflops": round(r.matmul_tflops, 1),
                        "elapsed_s": round(r.elapsed_s, 3)})
        print(f"  cuda:{i} {per_gpu[-1]['name']}: matmul {r.matmul_tflops:.1f} TFLOP/s")
    out: dict[str, Any] = {"per_gpu": per_gpu, "allreduce_gbps": None, "allreduce_ranks": None}
    if count >= 2 and not skip_allreduce:
        world = min(count, 8)
        with tempfile.TemporaryDirectory(prefix="dlrover-cuda-check-") as tmp:
            mp.spawn(_allreduce_rank, args=(world, os.path.join(tmp, "rdzv"), tmp), nprocs=world, join=True)
            ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]
        out["allreduce_gbps"] = round(ranks[0]["allreduce_gbps"], 1)
        out["allreduce_ranks"] = world
        print(f"  all-reduce over {world} GPUs (NCCL, {CudaAccelerator.allreduce_mib} MiB float32): "
              f"bus bandwidth {ranks[0]['allreduce_gbps']:.1f} GB/s")
    elif count < 2:
        print("  all-reduce: skipped (one GPU)")
    return out


# ----- Flash Checkpoint snapshot ------------------------------------------------------------


def _gpu_state(state_mib: int) -> dict[str, Any]:
    import torch

    chunk = CHUNK_MIB * 2**20 // 2  # bf16 elements per 64 MiB tensor
    n = max(1, state_mib // CHUNK_MIB)
    gen = torch.Generator(device="cuda").manual_seed(0)
    return {f"layer{i}": torch.randn(chunk // 4096, 4096, dtype=torch.bfloat16, device="cuda", generator=gen)
            for i in range(n)}


def _snapshot(state_mib: int, reps: int) -> dict[str, Any]:
    import torch

    from dlrover_core.checkpoint.layout import build_layout
    from dlrover_core.checkpoint.memory import MemorySnapshots, ShmTooSmall
    from dlrover_core.checkpoint.rng import get_rng_state
    from dlrover_core.checkpoint.shm import remove_segments

    state = _gpu_state(state_mib)
    torch.cuda.synchronize()
    job_id = f"gpucheck{os.getpid()}"
    snaps = MemorySnapshots(job_id=job_id, node_id=0, rank=0)
    try:
        times = []
        layout = None
        warmup = 2  # one save per slot allocates and touches it: not timed (steady state alternates slots)
        for step in range(reps + warmup):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            # what Checkpointer.save does under an agent: plan, then copy into a free slot
            layout = build_layout({"state": {"model": state, "step": step}, "rng": get_rng_state()},
                                  step=step, rank=0, world_size=1)
            snaps.save(layout, step=step, world_size=1, persist=False)
            torch.cuda.synchronize()
            if step >= warmup:
                times.append(time.perf_counter() - t0)
        assert layout is not None
        nbytes = layout.data_len
        exact = True
        with snaps.read(reps + warmup - 1, world_size=1) as (views, _):
            for key, src in layout.sources:
                if src.device.type == "cuda" and not torch.equal(views[key], src.cpu()):
                    exact = False
                    break
    except ShmTooSmall as exc:
        return {"error": str(exc), "ok": False}
    finally:
        snaps.close()
        remove_segments(f"dlrover-{job_id}-")

    # the ceiling: the same tensors copied asynchronously into one pinned buffer
    total = sum(t.numel() * t.element_size() for t in state.values())
    pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    pinned_times = []
    for rep in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        offset = 0
        for t in state.values():
            n = t.numel() * t.element_size()
            pinned[offset:offset + n].copy_(t.reshape(-1).view(torch.uint8), non_blocking=True)
            offset += n
        torch.cuda.synchronize()
        if rep:
            pinned_times.append(time.perf_counter() - t0)
    snap_gbps = nbytes / statistics.median(times) / 1e9
    pinned_gbps = total / statistics.median(pinned_times) / 1e9
    ratio = snap_gbps / pinned_gbps
    print(f"  state: {len(state)} bf16 tensors on cuda:0, {nbytes / 2**20:.0f} MiB")
    print(f"  snapshot to shared memory (build_layout + MemorySnapshots.save): median "
          f"{statistics.median(times) * 1e3:.1f} ms = {snap_gbps:.1f} GB/s")
    print(f"  pinned copy_(non_blocking=True) into one buffer: median {statistics.median(pinned_times) * 1e3:.1f} ms "
          f"= {pinned_gbps:.1f} GB/s")
    verdict = "meets" if ratio >= SNAPSHOT_GOAL else "BELOW"
    print(f"  ratio {ratio:.0%} ({verdict} the goal of {SNAPSHOT_GOAL:.0%}); read back bit-exact: {exact}")
    return {"bytes": nbytes, "reps": reps, "snapshot_s": times, "pinned_s": pinned_times,
            "snapshot_gbps": round(snap_gbps, 2), "pinned_gbps": round(pinned_gbps, 2), "ratio": round(ratio, 4),
            "goal": SNAPSHOT_GOAL, "bit_exact": exact, "ok": ratio >= SNAPSHOT_GOAL and exact}


# ----- main ---------------------------------------------------------------------------------


def _write(path: str | None, results: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(results, indent=2))
        print(f"results written to {path}")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    import attrs
    import torch

    from dlrover_plugin_cuda import CudaAccelerator

    results: dict[str, Any] = {"torch": torch.__version__, "torch_cuda": torch.version.cuda, "ok": False}
    print("1. probe")
    report = CudaAccelerator(use_nvml=False if args.no_nvml else None).probe()
    results["probe"] = {k: list(v) if isinstance(v, tuple) else v for k, v in attrs.asdict(report).items()}
    if not report.present:
        print(f"no usable NVIDIA GPU: {report.reason}", file=sys.stderr)
        _write(args.json, results)
        return 2
    print(f"  {report.count} x {report.model}, {report.memory_mb} MiB, driver {report.driver_version}, "
          f"CUDA {report.runtime_version}, healthy {list(report.healthy)}")
    failures = [] if all(report.healthy) else ["unhealthy GPU(s)"]

    print("2. node check")
    try:
        results["node_check"] = _node_check(min(report.count, torch.cuda.device_count()), args.skip_allreduce)
    except Exception as exc:
        results["node_check"] = {"error": f"{type(exc).__name__}: {exc}"}
        failures.append("node check")
        print(f"  node check failed: {type(exc).__name__}: {exc}")

    print("3. Flash Checkpoint snapshot of GPU tensors")
    try:
        results["snapshot"] = _snapshot(args.state_mib, max(1, args.reps))
    except Exception as exc:
        results["snapshot"] = {"error": f"{type(exc).__name__}: {exc}", "ok": False}
        print(f"  snapshot failed: {type(exc).__name__}: {exc}")
    if not results["snapshot"].get("ok"):
        failures.append("snapshot")
        if "error" in results["snapshot"] and "bytes" not in results["snapshot"]:
            print(f"  {results['snapshot']['error']}")

    results["ok"] = not failures
    results["failures"] = failures
    print("OK" if not failures else f"FAILED: {', '.join(failures)}")
    _write(args.json, results)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
