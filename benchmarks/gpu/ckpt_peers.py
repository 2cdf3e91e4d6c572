"""Part ``peers``: the same GPU state saved and restored by torch's own means and by our
Checkpointer's storage path, for comparison with the ``flash`` part's figures.

    python benchmarks/gpu/ckpt_peers.py --out peers.json [--sizes-mib 1024,4096] [--reps 3]
                                        [--device cuda|cpu] [--tiny] [--budget-s S]

The state is ``flash``'s (16 bf16 tensors on ``cuda:0``, same seed, same bytes). Files go to
a scratch directory (``$GPU_BENCH_SCRATCH`` or the system's temporary directory), removed
afterwards. Per size, medians of ``--reps`` after one untimed warm-up:

* ``torch_save``: ``torch.save(tensors, path)`` from the GPU: ``stall_s`` until it returns
  (data in the page cache), ``durable_s`` with the file's fsync after it;
* ``torch_load``: restore into the live module: ``torch.load(path, map_location="cuda",
  weights_only=True)`` then ``module.load_state_dict`` (the file is in the page cache);
* ``ours_storage``: ``train.Checkpointer`` without an agent (memory off): ``save(...,
  force=True)`` writes the safetensors shard, fsyncs and commits (``save_s``, the training
  waits for all of it), and ``load(state)`` reads it back, checks its CRC32 and copies into
  the GPU tensors (``load_s``);
* ``dcp_async``: ``torch.distributed.checkpoint.async_save(tensors, no_dist=True)`` with its
  default stager (a pageable CPU copy, made before it returns): ``block_s`` (the training
  stall), ``total_s`` (until the future completes; DCP fsyncs its files);
* ``dcp_async_pinned`` (CUDA only): the same with ``DefaultStager(StagingOptions(
  use_pinned_memory=True, use_non_blocking_copy=True))``, reused across saves so its
  pinned buffers are cached, as a training loop would;
* ``dcp_async_staged`` (CUDA only): also ``use_async_staging=True``: ``async_save`` returns
  at once and stages on a side stream; ``block_s``, ``staging_s`` (until the copy is
  done: the tensors must not change before), ``total_s``.

``figures`` per size (``"1024MiB"``): ``torch_save_s``, ``torch_save_durable_s``,
``torch_load_s``, ``ours_storage_save_s``, ``ours_storage_load_s``,
``dcp_async_block_s``, ``dcp_async_total_s``, ``dcp_async_pinned_block_s``,
``dcp_async_pinned_total_s``, ``dcp_async_staged_block_s``, ``dcp_async_staged_staging_s``,
``dcp_async_staged_total_s``. ``summary.json`` divides ``flash``'s stall and restore by
these.

A larger size is skipped when the time measured for the previous one, scaled by size, does
not fit in ``--budget-s``.
"""

from __future__ import annotations

import gc
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import _common as c
from _shared import wait_async_save


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rm(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists():
        path.unlink()


def _torch_save(tensors: dict[str, Any], module: Any, d: Path, reps: int, device: str) -> dict[str, Any]:
    import torch  # heavy: torch

    path = d / "state.pt"
    stall, durable = [], []
    for i in range(reps + 1):
        _rm(path)
        c.sync(device)
        t0 = time.perf_counter()
        torch.save(tensors, path)
        t1 = time.perf_counter()
        _fsync(path)
        t2 = time.perf_counter()
        if i:
            stall.append(t1 - t0)
            durable.append(t2 - t0)

    def load() -> None:
        sd = torch.load(path, map_location=device, weights_only=True)
        module.load_state_dict({f"t{i:02d}": t for i, t in enumerate(sd.values())})

    loads = c.timed(load, reps=reps, warmup=1, device=device)
    _rm(path)
    return {"torch_save": {"stall_s": c.r(c.med(stall)), "durable_s": c.r(c.med(durable)),
                           "stall_samples": [c.r(s) for s in stall]},
            "torch_load": {"s": c.r(c.med(loads)), "samples": [c.r(s) for s in loads]}}


def _ours_storage(module: Any, d: Path, reps: int, device: str) -> dict[str, Any]:
    from dlrover_core import train

    ckpt = train.Checkpointer(dir=str(d / "ours"), memory_every_steps=0, persist_every_steps=1, keep_last=1)
    state = {"model": module}
    step = 0

    def save() -> None:
        nonlocal step
        step += 1
        ckpt.save(step, state, force=True)

    saves = c.timed(save, reps=reps, warmup=1, device=device)
    loads: list[Any] = []

    def load() -> None:
        ckpt.restored_step = None
        loads.append(ckpt.load(state))

    load_samples = c.timed(load, reps=reps, warmup=1, device=device)
    if {(x.source, x.step) for x in loads} != {("storage", step)}:
        raise RuntimeError(f"Checkpointer.load restored {[(x.source, x.step) for x in loads]}, not storage step {step}")
    _rm(d / "ours")
    return {"save_s": c.r(c.med(saves)), "load_s": c.r(c.med(load_samples)),
            "save_samples": [c.r(s) for s in saves], "load_samples": [c.r(s) for s in load_samples]}


def _dcp(tensors: dict[str, Any], d: Path, reps: int, device: str, options: Any | None) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp  # heavy: torch
    from torch.distributed.checkpoint.staging import DefaultStager

    stager = DefaultStager(options) if options is not None else None
    block, staging, total = [], [], []
    try:
        for i in range(reps + 1):
            target = d / f"dcp{i}"
            _rm(d / f"dcp{i - 1}")
            c.sync(device)
            t0 = time.perf_counter()
            kwargs = {"async_stager": stager} if stager is not None else {}
            response = dcp.async_save(tensors, checkpoint_id=str(target), no_dist=True, **kwargs)
            t1 = time.perf_counter()
            t_staged, t2 = wait_async_save(response, t1)
            if i:
                block.append(t1 - t0)
                staging.append(t_staged - t0)
                total.append(t2 - t0)
        _rm(d / f"dcp{reps}")
    finally:
        if stager is not None:
            stager.close()
    return {"block_s": c.r(c.med(block)), "staging_s": c.r(c.med(staging)), "total_s": c.r(c.med(total)),
            "block_samples": [c.r(s) for s in block]}


def measure_size(size_mib: int, reps: int, device: str, d: Path, out: dict[str, Any]) -> None:
    """Everything for one size, into ``out`` as it is measured (a part stopped half way keeps it)."""
    from torch.distributed.checkpoint.staging import StagingOptions

    tensors = c.make_state(size_mib * 2**20, device)
    module = c.state_module({k: t.clone() for k, t in tensors.items()})
    out.update(bytes=c.nbytes(tensors), tensors=len(tensors), dtype="bfloat16", reps=reps)
    out.update(_torch_save(tensors, module, d, reps, device))
    out["ours_storage"] = _ours_storage(module, d, reps, device)
    out["dcp_async"] = _dcp(tensors, d, reps, device, None)
    if device == "cuda":
        out["dcp_async_pinned"] = _dcp(tensors, d, reps, device, StagingOptions(
            use_pinned_memory=True, use_shared_memory=False, use_async_staging=False, use_non_blocking_copy=True))
        out["dcp_async_staged"] = _dcp(tensors, d, reps, device, StagingOptions(
            use_pinned_memory=True, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=True))
    else:
        out["dcp_async_pinned"] = out["dcp_async_staged"] = {"skipped": "needs CUDA (pinned host memory)"}


def _figures(s: dict[str, Any]) -> dict[str, Any]:
    def g(key: str, field: str) -> Any:
        return (s.get(key) or {}).get(field)

    return {
        "torch_save_s": g("torch_save", "stall_s"), "torch_save_durable_s": g("torch_save", "durable_s"),
        "torch_load_s": g("torch_load", "s"),
        "ours_storage_save_s": g("ours_storage", "save_s"), "ours_storage_load_s": g("ours_storage", "load_s"),
        "dcp_async_block_s": g("dcp_async", "block_s"), "dcp_async_total_s": g("dcp_async", "total_s"),
        "dcp_async_pinned_block_s": g("dcp_async_pinned", "block_s"),
        "dcp_async_pinned_total_s": g("dcp_async_pinned", "total_s"),
        "dcp_async_staged_block_s": g("dcp_async_staged", "block_s"),
        "dcp_async_staged_staging_s": g("dcp_async_staged", "staging_s"),
        "dcp_async_staged_total_s": g("dcp_async_staged", "total_s"),
    }


def body(args: Any, result: dict[str, Any], deadline: c.Deadline) -> None:
    import torch  # heavy: torch

    if args.device == "cuda":
        torch.cuda.set_device(0)
    sizes = [int(s) for s in (args.sizes_mib or ("8" if args.tiny else "1024,4096")).split(",")]
    scratch = c.scratch_dir("peers")
    result.update(host=c.host_facts(), scratch=str(scratch), torch=torch.__version__, sizes={})
    last: tuple[int, int, float] | None = None
    try:
        for mib in sizes:
            key = f"{mib}MiB"
            reps = args.reps or (1 if args.tiny else 3 if mib <= 1024 else 2)
            if last is not None:
                estimate = last[2] * (mib / last[0]) * (reps + 1) / (last[1] + 1)
                if estimate > deadline.left():
                    result["sizes"][key] = {"skipped": f"not enough time left ({deadline.left():.0f} s, "
                                                       f"estimated {estimate:.0f} s)"}
                    continue
            free = shutil.disk_usage(scratch).free
            if free < 3 * mib * 2**20:
                result["sizes"][key] = {"skipped": f"{scratch} has {free / 2**30:.1f} GiB free, "
                                                   f"needs {3 * mib / 1024:.1f} GiB"}
                continue
            t0 = time.perf_counter()
            rows = result["sizes"][key] = {}
            measure_size(mib, reps, args.device, scratch, rows)
            rows["seconds"] = c.r(time.perf_counter() - t0, 4)
            result["figures"][key] = _figures(rows)
            last = (mib, reps, time.perf_counter() - t0)
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
            c.empty_host_cache()
            f = result["figures"][key]
            print(f"peers {key}: torch.save {f['torch_save_s']} s, DCP async_save blocks {f['dcp_async_block_s']} s "
                  f"(pinned {f['dcp_async_pinned_block_s']} s), torch.load {f['torch_load_s']} s, "
                  f"ours from storage {f['ours_storage_save_s']} / {f['ours_storage_load_s']} s", flush=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        for key, rows in result["sizes"].items():  # a size cut short: the figures of what it measured
            if "skipped" not in rows and key not in result["figures"]:
                rows["partial"] = True
                result["figures"][key] = _figures(rows)
    if not result["figures"]:
        raise c.Skip("no size could be measured: " + "; ".join(v["skipped"] for v in result["sizes"].values()))


def main(argv: list[str] | None = None) -> int:
    p = c.parser(__doc__)
    p.add_argument("--sizes-mib", default=None, help="state sizes, MiB, comma-separated (default 1024,4096; tiny 8)")
    p.add_argument("--reps", type=int, default=None,
                   help="timed repetitions (default 3 up to 1 GiB, 2 above; tiny 1)")
    return c.run("peers", p.parse_args(argv), body)


if __name__ == "__main__":
    sys.exit(main())
