"""Part ``flash``: Flash Checkpoint of GPU tensors — our save stall and restore against the
device-to-host and host-to-device copy ceilings, measured in the same process.

    python benchmarks/gpu/flash_ckpt.py --out flash.json [--sizes-mib 1024,4096] [--reps 5]
                                        [--device cuda|cpu] [--tiny] [--budget-s S]

The state: 16 bf16 tensors on ``cuda:0`` (``--sizes-mib`` in all), the buffers of one
``nn.Module`` saved as ``{"model": module}``.

How the engine stages device tensors today (``dlrover_core/checkpoint/layout.py``,
``Layout.copy_into``): one synchronous ``copy_`` per tensor from the GPU straight into the
rank's shared-memory slot — pageable host memory (an ``mmap`` of a /dev/shm file), so the
CUDA driver bounces it through its own pinned staging buffer. There is one mode, no pinned
staging. So this part measures what exists and what a pinned path would give:

* ``ours``: ``train.Checkpointer().save(step, state)`` as under an agent (the process is
  given a job id, node id and master address, which ``save`` never calls): the training
  stall (wall time, device synchronised) and the stall the product itself reports in its
  progress records (``reported_stall_s``). Two untimed saves first (one per slot: they
  allocate and touch it).
* ``restore_memory``: ``Checkpointer.load(state)`` from that snapshot into the same
  module's GPU tensors (zeroed first, then checked bit-exact against a copy), the master's
  restore decision answered in-process (no HTTP round trip).
* floors, the same bytes copied with torch: ``d2h_pinned`` (``copy_(non_blocking=True)``
  into one pinned buffer, one synchronise: the **ceiling**), ``d2h_pageable`` (into a
  pre-touched ``torch.empty``), ``d2h_shm`` (into a pre-touched /dev/shm mapping: our
  destination without our bookkeeping), ``d2h_shm_registered`` (the same mapping
  page-locked with ``cudaHostRegister``: what the engine could do instead, with
  ``register_s`` its one-time cost), ``pinned_then_memcpy`` (a pinned staging mode done
  synchronously: D2H into pinned, then a threaded memcpy into shm; ``memcpy`` alone too);
  and for restores ``h2d_pinned`` (the ceiling) and ``h2d_shm`` (pageable shm to GPU).

``--device cpu`` runs ours and the pageable floors with CPU tensors (the pinned and
registered rows are skipped: they need CUDA).

JSON ``sizes``: per size, every measurement's median (``*_s``), samples and bandwidth
(``*_gbps``, 10^9 B/s). ``figures``: per size (``"1024MiB"``) ``ours_stall_s``,
``ours_gbps``, ``d2h_pinned_s`` and ``d2h_pinned_gbps`` (the ceiling), ``d2h_pageable_gbps``, ``d2h_shm_gbps``,
``d2h_shm_registered_gbps``, ``stall_vs_pinned_ceiling`` (our stall / the pinned copy's
time; 1.0 is the ceiling), ``ours_vs_shm_copy`` (our stall / the plain copy into shm: the
engine's overhead), ``restore_memory_s``, ``restore_gbps``, ``h2d_pinned_s``, ``h2d_pinned_gbps``, ``h2d_shm_gbps``,
``restore_vs_h2d_pinned``, ``bit_exact``, ``meets_goal`` (ours at >= 80% of the pinned
bandwidth, the goal of ``tests/gpu/check_cuda.py``).

Needs /dev/shm (or ``DLROVER_SHM_DIR``) for three copies of the largest size (two slots and
the floors' buffer); a size that does not fit is skipped with the reason. When even the
smallest does not fit (a container's 64 MB /dev/shm) and ``DLROVER_SHM_DIR`` is not set, the
snapshots go to a directory in the scratch space instead (page cache on disk), said in
``shm_fallback``; ``figures.shm_dir`` names the directory used.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import _common as c
from _shared import shm_tensor

GOAL = 0.80


def _shm_tensor(nbytes: int) -> Any:
    """A pre-touched uint8 tensor over a mapping of a /dev/shm file that is unlinked at once
    (nothing can be left behind; the memory goes with the tensor)."""
    return shm_tensor(nbytes, c.shm_dir(), f"{c.SHM_PREFIX}-floor")


class _InProcessMaster:
    """Answers ``Checkpointer.load``'s one question to the master: restore ``step`` from memory."""

    def __init__(self) -> None:
        self.step = -1

    def restore_plan(self, request: Any) -> Any:
        from dlrover_core.protocol.messages import RestoreDecision

        return RestoreDecision(state="ready", source="memory", step=self.step, snapshot_round=0)


def _records(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _row(samples: list[float], total: int) -> dict[str, Any]:
    m = c.med(samples)
    return {"s": c.r(m), "gbps": c.gbps(total, m), "samples": [c.r(s) for s in samples]}


def measure_size(ckpt: Any, master: _InProcessMaster, progress: Path, size_mib: int, reps: int, device: str,
                 step0: int, out: dict[str, Any]) -> int:
    """Everything for one state size, into ``out`` as it is measured (a part stopped half way
    keeps what it has); returns the next step number."""
    import torch  # heavy: torch

    from dlrover_core.checkpoint.copy import copy_all

    tensors = c.make_state(size_mib * 2**20, device)
    total = c.nbytes(tensors)
    module = c.state_module(tensors)
    reference = {k: t.clone() for k, t in module.state_dict().items()}
    state = {"model": module}
    out.update(bytes=total, tensors=len(tensors), dtype="bfloat16", reps=reps)
    step = step0

    # ----- ours: the save stall
    saved_steps = []

    def save() -> None:
        nonlocal step
        step += 1
        if not ckpt.save(step, state):
            raise RuntimeError(f"Checkpointer.save(step={step}) took no snapshot")
        saved_steps.append(step)

    samples = c.timed(save, reps=reps, warmup=2, device=device)
    recs = {rec["step"]: rec for rec in _records(progress) if rec.get("type") == "checkpoint"}
    where = {recs[s]["where"] for s in saved_steps if s in recs}
    if where != {"memory"}:
        raise RuntimeError(f"Checkpointer.save wrote to {sorted(where)} instead of shared memory "
                           f"(/dev/shm too small? see the log); the stall measured is not Flash Checkpoint's")
    ours = _row(samples, total)
    ours["reported_stall_s"] = c.r(c.med([recs[s]["stall_s"] for s in saved_steps[-reps:]]))
    out["ours"] = ours

    # ----- ours: restore from memory into the GPU tensors
    master.step = step

    def zero() -> None:
        with torch.no_grad():
            for t in tensors.values():
                t.zero_()
        ckpt.restored_step = None

    loads: list[Any] = []
    samples = c.timed(lambda: loads.append(ckpt.load(state)), reps=reps, warmup=1, device=device, before=zero)
    ckpt.restored_step = None
    if {(x.source, x.step) for x in loads} != {("memory", step)}:
        raise RuntimeError(f"Checkpointer.load restored {[(x.source, x.step) for x in loads]}, not memory step {step}")
    out["restore_memory"] = _row(samples, total)
    out["restore_memory"]["reported_load_s"] = c.r(c.med(
        [rec["load_s"] for rec in _records(progress) if rec.get("type") == "restore"][-reps:]))
    out["bit_exact"] = all(torch.equal(module.state_dict()[k], v) for k, v in reference.items())
    reference = loads = None  # freed now, not at the end

    # ----- floors: the same bytes copied by torch
    srcs = [t.reshape(-1).view(torch.uint8) for t in tensors.values()]
    spans = []
    offset = 0
    for s in srcs:
        spans.append((offset, offset + s.numel()))
        offset += s.numel()

    def d2h(dst: Any, non_blocking: bool) -> None:
        for (a, b), s in zip(spans, srcs, strict=True):
            dst[a:b].copy_(s, non_blocking=non_blocking)

    def h2d(src: Any, non_blocking: bool) -> None:
        for (a, b), s in zip(spans, srcs, strict=True):
            s.copy_(src[a:b], non_blocking=non_blocking)

    pageable = torch.empty(total, dtype=torch.uint8).fill_(0)
    out["d2h_pageable"] = _row(c.timed(lambda: d2h(pageable, False), reps=reps, warmup=1, device=device), total)
    pageable = None
    shm = _shm_tensor(total)
    try:
        out["d2h_shm"] = _row(c.timed(lambda: d2h(shm, False), reps=reps, warmup=1, device=device), total)
        out["h2d_shm"] = _row(c.timed(lambda: h2d(shm, False), reps=reps, warmup=1, device=device), total)
        if device != "cuda":
            for key in ("d2h_pinned", "pinned_then_memcpy", "memcpy_pinned_to_shm", "d2h_shm_registered", "h2d_pinned"):
                out[key] = {"skipped": "needs CUDA (pinned host memory)"}
        else:
            pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
            try:
                out["d2h_pinned"] = _row(c.timed(lambda: d2h(pinned, True), reps=reps, warmup=1, device=device), total)
                out["h2d_pinned"] = _row(c.timed(lambda: h2d(pinned, True), reps=reps, warmup=1, device=device), total)
                pairs = [(shm.numpy(), pinned.numpy())]

                def staged() -> None:
                    d2h(pinned, True)
                    torch.cuda.synchronize()
                    copy_all(pairs)

                out["pinned_then_memcpy"] = _row(c.timed(staged, reps=reps, warmup=1, device=device), total)
                out["memcpy_pinned_to_shm"] = _row(
                    c.timed(lambda: copy_all(pairs), reps=reps, warmup=1, device=device), total)
            finally:
                pinned = pairs = None
                c.empty_host_cache()
            out["d2h_shm_registered"] = _registered(shm, d2h, total, reps)
    finally:
        shm = None  # the mapping goes with the tensor
    return step


def _registered(shm: Any, d2h: Any, total: int, reps: int) -> dict[str, Any]:
    """The shm mapping page-locked with cudaHostRegister, then the same D2H copy into it."""
    from torch.cuda import _pin_memory_utils as pin

    t0 = time.perf_counter()
    try:
        pin.pin_memory(shm.data_ptr(), total)
    except Exception as exc:
        return {"error": f"cudaHostRegister failed: {type(exc).__name__}: {exc}"}
    register_s = time.perf_counter() - t0
    try:
        row = _row(c.timed(lambda: d2h(shm, True), reps=reps, warmup=1, device="cuda"), total)
    finally:
        t0 = time.perf_counter()
        pin.unpin_memory(shm.data_ptr())
        unregister_s = time.perf_counter() - t0
    row.update(register_s=c.r(register_s), unregister_s=c.r(unregister_s))
    return row


def _figures(size: dict[str, Any]) -> dict[str, Any]:
    def g(key: str, field: str = "gbps") -> Any:
        return (size.get(key) or {}).get(field)

    ours_s, pinned_s = g("ours", "s"), g("d2h_pinned", "s")
    ours_gbps, pinned_gbps = g("ours"), g("d2h_pinned")
    return {
        "ours_stall_s": ours_s, "ours_gbps": ours_gbps, "ours_reported_stall_s": g("ours", "reported_stall_s"),
        "d2h_pinned_s": pinned_s, "d2h_pinned_gbps": pinned_gbps, "d2h_pageable_gbps": g("d2h_pageable"), "d2h_shm_gbps": g("d2h_shm"),
        "d2h_shm_registered_gbps": g("d2h_shm_registered"), "pinned_then_memcpy_s": g("pinned_then_memcpy", "s"),
        "stall_vs_pinned_ceiling": c.ratio(ours_s, pinned_s),
        "ours_vs_shm_copy": c.ratio(ours_s, g("d2h_shm", "s")),
        "restore_memory_s": g("restore_memory", "s"), "restore_gbps": g("restore_memory"),
        "h2d_pinned_s": g("h2d_pinned", "s"), "h2d_pinned_gbps": g("h2d_pinned"), "h2d_shm_gbps": g("h2d_shm"),
        "restore_vs_h2d_pinned": c.ratio(g("restore_memory", "s"), g("h2d_pinned", "s")),
        "bit_exact": size.get("bit_exact"),
        "meets_goal": None if not pinned_gbps or ours_gbps is None else ours_gbps >= GOAL * pinned_gbps,
    }


def body(args: Any, result: dict[str, Any], deadline: c.Deadline) -> None:
    sizes = [int(s) for s in (args.sizes_mib or ("8" if args.tiny else "1024,4096")).split(",")]
    reps = args.reps or (2 if args.tiny else 5)
    job_id = f"{c.SHM_PREFIX.removeprefix('dlrover-')}-{os.getpid()}"
    scratch = c.scratch_dir("flash")
    progress = scratch / "progress.jsonl"
    need = 3 * min(sizes) * 2**20
    if c.shm_free_bytes() < need and not os.environ.get("DLROVER_SHM_DIR"):
        # a container's 64 MB /dev/shm: measure in a disk-backed directory (page cache) rather than not at all
        result["shm_fallback"] = (f"{c.shm_dir()} has {c.shm_free_bytes() / 2**30:.2f} GiB free, the smallest size "
                                  f"needs {need / 2**30:.2f} GiB: snapshots go to {scratch / 'shm'} (disk-backed "
                                  "page cache, not tmpfs; set DLROVER_SHM_DIR to choose)")
        (scratch / "shm").mkdir()
        os.environ["DLROVER_SHM_DIR"] = str(scratch / "shm")
        print(f"flash: {result['shm_fallback']}", flush=True)
    # what an agent gives its worker: Checkpointer.save then snapshots into shared memory
    os.environ.update({"DLROVER_JOB_ID": job_id, "DLROVER_NODE_ID": "0", "DLROVER_MASTER_ADDR": "127.0.0.1:9",
                       "DLROVER_PROGRESS_FILE": str(progress), "DLROVER_AGENT_TOKEN": "0", "DLROVER_ROUND": "0"})
    import torch  # heavy: torch

    from dlrover_core import train
    from dlrover_core.checkpoint.shm import remove_segments

    if args.device == "cuda":
        torch.cuda.set_device(0)
    result["figures"]["shm_dir"] = str(c.shm_dir())
    result.update(host=c.host_facts(), sizes={}, staging_modes={
        "pageable": "what Checkpointer.save does today: copy_ from the GPU into the /dev/shm slot, synchronous",
        "pinned": "not in the engine: d2h_pinned is its ceiling; pinned_then_memcpy and d2h_shm_registered "
                  "are two ways to get there"})
    ckpt = train.Checkpointer(dir=str(scratch / "ckpt"), persist_every_steps=0)
    master = _InProcessMaster()
    ckpt._client = master  # load() asks "the master" where to restore from: answered in-process
    step = 0
    last: tuple[int, float] | None = None
    try:
        for mib in sizes:
            key = f"{mib}MiB"
            need = 3 * mib * 2**20
            have = c.shm_free_bytes() + sum(s.size for s in (ckpt._memory.slots if ckpt._memory else []))
            if have < need:
                result["sizes"][key] = {"skipped": f"{c.shm_dir()} has {have / 2**30:.1f} GiB free, "
                                                   f"needs {need / 2**30:.1f} GiB (set DLROVER_SHM_DIR or a larger shm)"}
                continue
            if last is not None:
                estimate = last[1] * mib / last[0]
                if estimate > deadline.left():
                    result["sizes"][key] = {"skipped": f"not enough time left ({deadline.left():.0f} s, "
                                                       f"estimated {estimate:.0f} s)"}
                    continue
            t0 = time.perf_counter()
            rows = result["sizes"][key] = {}
            step = measure_size(ckpt, master, progress, mib, reps, args.device, step, rows)
            rows["seconds"] = c.r(time.perf_counter() - t0, 4)
            result["figures"][key] = _figures(rows)
            last = (mib, time.perf_counter() - t0)
            gc.collect()
            if args.device == "cuda":
                torch.cuda.empty_cache()
            f = result["figures"][key]
            print(f"flash {key}: ours {f['ours_stall_s']} s = {f['ours_gbps']} GB/s; pinned ceiling "
                  f"{f['d2h_pinned_gbps']} GB/s; restore {f['restore_memory_s']} s; bit-exact {f['bit_exact']}",
                  flush=True)
    finally:
        if ckpt._memory is not None:
            ckpt._memory.close()
        remove_segments(f"dlrover-{job_id}-")
        shutil.rmtree(scratch, ignore_errors=True)
        for key, rows in result["sizes"].items():  # a size cut short: the figures of what it measured
            if "skipped" not in rows and key not in result["figures"]:
                rows["partial"] = True
                result["figures"][key] = _figures(rows)
    measured = [k for k, v in result["sizes"].items() if "skipped" not in v]
    if not measured:
        raise c.Skip("no size could be measured: " + "; ".join(v["skipped"] for v in result["sizes"].values()))
    bad = [k for k in measured if not result["sizes"][k].get("bit_exact")]
    if bad:
        raise RuntimeError(f"restore from memory is not bit-exact at {', '.join(bad)}")


def main(argv: list[str] | None = None) -> int:
    p = c.parser(__doc__)
    p.add_argument("--sizes-mib", default=None, help="state sizes, MiB, comma-separated (default 1024,4096; tiny 8)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions per measurement (default 5; tiny 2)")
    return c.run("flash", p.parse_args(argv), body)


if __name__ == "__main__":
    sys.exit(main())
