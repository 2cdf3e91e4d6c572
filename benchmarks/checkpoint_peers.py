"""Peers and floors for the checkpoint benchmark.

Each ``measure_*`` function times one way of saving/loading the same state and
returns medians in **seconds** (``*_s``), the raw samples (``*_samples``, lists of
seconds) and their ``{"median", "min", "max", "n"}`` (``*_stats``). Every
measurement does one untimed warm-up, then ``reps`` timed repetitions with
``time.perf_counter``. Files go into a private subfolder of ``workdir`` that is
removed before returning. The synchronous durable saves (``torch.save`` + fsync,
DCP ``save``) take a sample of the raw write + fsync floor
(``_ckpt_common.DiskFloor``) before each timed repetition, so the floor meets the
disk as they do.

Only stdlib, torch and numpy; importing this module has no side effects.

Try it alone::

    python benchmarks/checkpoint_peers.py --size-mib 256 --reps 3 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ckpt_common import DiskFloor, add_stats, byte_views, digest, fsync_dir, prewarm_copies  # noqa: E402
from _shared import shm_tensor, wait_async_save  # noqa: E402

# ---------------------------------------------------------------- helpers


def state_spec(total_bytes: int, n_tensors: int = 16) -> list[tuple[str, int]]:
    """``(key, numel)`` of each tensor of :func:`make_state` (float32, 1-D)."""
    numel = max(1, total_bytes // (4 * n_tensors))
    return [(f"layer{i:02d}.weight", numel) for i in range(n_tensors)]


def make_state(total_bytes: int, n_tensors: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """``n_tensors`` equal-sized float32 CPU tensors of random content, about
    ``total_bytes`` bytes in all (rounded down to whole float32 elements)."""
    gen = torch.Generator().manual_seed(seed)
    return {key: torch.randn(numel, generator=gen) for key, numel in state_spec(total_bytes, n_tensors)}


def live_model(total_bytes: int, n_tensors: int = 16) -> dict[str, torch.Tensor]:
    """Tensors shaped as :func:`make_state`'s, every page already written (zeros): the
    parameters of a live model that a restore copies into."""
    return {key: torch.zeros(numel) for key, numel in state_spec(total_bytes, n_tensors)}


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    """Total payload of ``state`` in bytes."""
    return sum(t.numel() * t.element_size() for t in state.values())


def _time_reps(fn: Callable[[], object], reps: int,
               before: Callable[[], object] | None = None,
               floor: Callable[[], object] | None = None) -> list[float]:
    """One untimed warm-up call of ``fn``, then ``reps`` timed calls (seconds).
    ``before`` runs untimed ahead of every call (e.g. to remove the last file);
    ``floor`` (a disk floor sample) runs ahead of every timed call."""
    samples = []
    for i in range(reps + 1):
        if before is not None:
            before()
        if floor is not None and i:
            floor()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if i:
            samples.append(dt)
    return samples


def _result(name: str, samples: list[float]) -> dict:
    return add_stats({f"{name}_s": statistics.median(samples), f"{name}_samples": samples})


@contextlib.contextmanager
def _scratch(workdir: Path, tag: str):
    """A fresh subfolder of ``workdir``, removed afterwards whatever happens."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f"peers-{tag}-", dir=workdir))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _torch_threads(n: int):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _flat_u8(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(-1).view(torch.uint8)


def _touched_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Preallocated same-shaped tensors with every page already faulted in
    (a live model's parameters)."""
    return {k: torch.zeros_like(v) for k, v in state.items()}


# ---------------------------------------------------------------- floors


def _shm_tensor(nbytes: int) -> torch.Tensor | None:
    """A pre-touched uint8 tensor over a /dev/shm mapping, or None without
    /dev/shm. The file is unlinked at once (nothing can leak); the memory goes
    when the tensor does."""
    if not os.path.isdir("/dev/shm"):
        return None
    return shm_tensor(nbytes, "/dev/shm", "ckpt-peers")


def _copy_methods(srcs: list[torch.Tensor], dst: torch.Tensor, reps: int) -> dict[str, list[float]]:
    """Samples (seconds) of copying ``srcs`` back to back into ``dst``, per method."""
    ncpu = os.cpu_count() or 1
    offsets = np.cumsum([0] + [s.numel() for s in srcs]).tolist()
    spans = list(zip(offsets[:-1], offsets[1:], strict=True))
    dst_slices = [dst[a:b] for a, b in spans]

    def torch_copy():
        for d, s in zip(dst_slices, srcs, strict=True):
            d.copy_(s)

    # numpy: one contiguous chunk of the whole byte range per core, each chunk
    # possibly spanning several tensors; np.copyto releases the GIL.
    np_dst = dst.numpy()
    bounds = np.linspace(0, offsets[-1], ncpu + 1, dtype=np.int64).tolist()
    jobs = [[(np_dst[max(a, lo):min(b, hi)], s.numpy()[max(a, lo) - a:min(b, hi) - a])
             for (a, b), s in zip(spans, srcs, strict=True) if max(a, lo) < min(b, hi)]
            for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)]

    def np_job(job):
        for d, s in job:
            np.copyto(d, s)

    methods = {}
    with _torch_threads(ncpu):
        methods[f"torch.copy_ x{ncpu} threads"] = _time_reps(torch_copy, reps)
    with ThreadPoolExecutor(ncpu) as pool:
        methods[f"numpy chunked x{ncpu} threads"] = _time_reps(lambda: list(pool.map(np_job, jobs)), reps)
    with _torch_threads(1):
        methods["torch.copy_ x1 thread"] = _time_reps(torch_copy, reps)
    return methods


def _best(prefix: str, methods: dict[str, list[float]]) -> dict:
    best = min(methods, key=lambda m: statistics.median(methods[m]))
    return {**_result(prefix, methods[best]), f"{prefix}_method": best,
            f"{prefix}_methods_s": {m: statistics.median(s) for m, s in methods.items()}}


def measure_floors(state: dict[str, torch.Tensor], reps: int) -> dict:
    """Hardware floors for copying the bytes of ``state`` (seconds).

    - ``memcpy_s``: fastest copy into one preallocated, pre-touched private
      buffer, over torch ``copy_`` on all cores, a chunked numpy copy on one
      thread per core, and torch on one thread; ``memcpy_method`` names the
      winner, ``memcpy_methods_s`` gives every method's median.
    - ``memcpy_1thread_s``: torch ``copy_`` on one thread, same buffer.
    - ``memcpy_shm_s`` (+ ``_method``, ``_methods_s``): the same methods into
      a pre-touched /dev/shm mapping (where flash checkpoints copy to).

    The disk floor (raw write + fsync) is a :class:`_ckpt_common.DiskFloor`,
    sampled next to each durable save (``floor`` of the ``measure_*`` below).

    On the 2-vCPU dev VM, torch's two-thread ``copy_`` was often about 4x
    slower than one thread (bimodal: ~0.02 s or ~0.13 s at 256 MiB), and two
    threads never beat one by much; hence all methods and their samples.
    """
    nbytes = state_bytes(state)
    srcs = [_flat_u8(t) for t in state.values()]
    private = _copy_methods(srcs, torch.zeros(nbytes, dtype=torch.uint8), reps)  # zeros(): touched
    out = {"bytes": nbytes, **_best("memcpy", private),
           **_result("memcpy_1thread", private["torch.copy_ x1 thread"])}
    shm = _shm_tensor(nbytes)
    if shm is not None:
        out.update(_best("memcpy_shm", _copy_methods(srcs, shm, reps)))
        del shm
    return out


# ---------------------------------------------------------------- torch.save / torch.load

#: Run in a fresh interpreter: the first ``torch.load`` of a process, into a live model.
_COLD_LOAD = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from checkpoint_peers import live_model
from _ckpt_common import digest
path, size = sys.argv[2], int(sys.argv[3])
model = live_model(size)
t0 = time.perf_counter()
loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
with torch.no_grad():
    for k, t in model.items():
        t.copy_(loaded[k])
elapsed = time.perf_counter() - t0
print(json.dumps({"load_s": elapsed, "digest": digest(model)}))
"""


def measure_torch_save(state: dict[str, torch.Tensor], workdir: Path, reps: int,
                       floor: Callable[[], object] | None = None) -> dict:
    """``torch.save`` / ``torch.load`` of ``state`` (seconds).

    - ``save_s``: blocking time of ``torch.save`` into a new file + ``fsync``
      of the file and its directory (``floor`` runs before each timed save).
    - ``load_s``: ``torch.load(map_location="cpu", weights_only=True)`` of that
      file, page cache warm (it was just written), in this (warm) process.
    - ``load_mmap_into_model_s``: ``torch.load(..., mmap=True)``, torch's
      documented fast path (the file's pages are mapped, not read into new
      memory), then ``copy_`` into preallocated, pre-touched same-shaped tensors
      (what ``load_state_dict`` does), in this process: the warm restore.
    - ``load_cold_s``: the first load of a fresh interpreter (one per sample),
      ``mmap=True`` + ``copy_`` into a pre-touched model, page cache warm: the
      restore of a restarted worker, as our and DLRover's cold restores are
      measured. ``mmap=True`` is torch's fastest documented way here: without
      it, the cold load at 1 GiB took 2-4.6 s against 0.3-0.7 s.
    """
    out = {"bytes": state_bytes(state)}
    model = _touched_like(state)
    with _scratch(workdir, "torchsave") as d:
        path = d / "state.pt"

        def save():
            with open(path, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            fsync_dir(d)

        def load(mmap: bool = False):
            return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)

        def load_into_model(mmap: bool):
            loaded = load(mmap)
            with torch.no_grad():
                for k, t in model.items():
                    t.copy_(loaded[k])

        out.update(_result("save", _time_reps(save, reps, before=lambda: path.unlink(missing_ok=True),
                                              floor=floor)))
        out.update(_result("load", _time_reps(load, reps)))
        out.update(_result("load_mmap_into_model", _time_reps(lambda: load_into_model(True), reps)))
        if not all(torch.equal(model[k], state[k]) for k in state):
            raise RuntimeError("torch.load gave back different data")
        model.clear()  # free its memory before the fresh interpreters take theirs
        want = digest(state)
        cold = []
        for _ in range(reps):
            p = subprocess.run([sys.executable, "-c", _COLD_LOAD, str(Path(__file__).resolve().parent), str(path),
                                str(state_bytes(state))], capture_output=True, text=True, timeout=600)
            if p.returncode:
                raise RuntimeError(f"cold torch.load failed ({p.returncode}): {p.stderr[-1500:]}")
            r = json.loads(p.stdout.strip().splitlines()[-1])
            if r["digest"] != want:
                raise RuntimeError("cold torch.load gave back different data")
            cold.append(r["load_s"])
        out.update(_result("load_cold", cold))
        out["restore_cold_s"] = out["load_cold_s"]  # the peers' cold restore: torch.load's
    return out


# ---------------------------------------------------------------- torch.distributed.checkpoint


def _fast_dcp_staging(async_staging: bool):
    """``StagingOptions`` of DCP's fastest staging that this torch offers (see
    :func:`measure_dcp`), with or without ``use_async_staging``."""
    from torch.distributed.checkpoint.staging import StagingOptions

    return StagingOptions(use_pinned_memory=torch.cuda.is_available(), use_shared_memory=True,
                          use_async_staging=async_staging, use_non_blocking_copy=torch.accelerator.is_available())


def _stop_dcp_process() -> None:
    """End DCP's checkpoint daemon process (``AsyncCheckpointerType.PROCESS``): it lives as
    long as this process otherwise, holding the last staged state's shared memory."""
    from torch.distributed.checkpoint import _async_process_executor as ape

    proc, ape._CHECKPOINT_PROCESS = ape._CHECKPOINT_PROCESS, None
    if proc is None:
        return
    try:
        proc._send(ape._CheckpointSaveProcessControlOpts.TERMINATE)
        proc._save_process.join(timeout=10)
    finally:
        if proc._save_process.is_alive():
            proc._save_process.terminate()
            proc._save_process.join(timeout=10)


def measure_dcp(state: dict[str, torch.Tensor], workdir: Path, reps: int,
                floor: Callable[[], object] | None = None) -> dict:
    """``torch.distributed.checkpoint`` save of ``state`` (seconds), a fresh
    checkpoint directory per repetition (``floor`` runs before each timed
    ``dcp.save``).

    - ``dcp_save_s``: blocking time of ``dcp.save``.
    - ``dcp_async_save_block_s``: time until ``dcp.async_save`` returns, with its
      defaults (a thread; the default stager copies the state synchronously into
      freshly allocated memory, every call).
    - ``dcp_async_save_total_s``: time until its future completes.
    - ``dcp_async_save_fastest_*``: ``async_save`` in the fastest configuration
      torch 2.13 offers here, read from ``state_dict_saver.py`` and ``staging.py``:
      ``async_checkpointer_type=AsyncCheckpointerType.PROCESS`` (serialisation and
      writes in DCP's checkpoint daemon process, off the trainer's GIL) and one
      ``DefaultStager`` kept across saves, as its docs ask (its ``StateDictStager``
      caches the staging buffers, so after the first save staging is one copy into
      pre-touched memory, as ours is) with ``StagingOptions(use_shared_memory=True)``
      (the staged tensors reach the daemon as file descriptors, their bytes are not
      pickled). ``use_pinned_memory`` and ``use_non_blocking_copy`` are on only with
      an accelerator: on this CPU-only torch pinning is ignored with a warning,
      non-blocking copy raises ``AssertionError``, and the recipe's
      ``FileSystemWriter(cache_staged_state_dict=True)`` (pinned) raises
      ``RuntimeError: Cannot access accelerator device``. Both settings of
      ``use_async_staging`` are measured (``dcp_async_save_process_sync_*``,
      ``..._process_async_*``) and the one whose staging ends first is reported as
      ``..._fastest_*`` (``dcp_async_save_fastest_config`` says which): async staging
      returns from the call at once but the copy then runs on a staging thread, so
      the state is free no sooner (at 1 GiB on this VM, busy: until staged 0.09 s
      sync vs 0.12 s async, call 0.017 s; THREAD + the same stager 0.19 s, THREAD
      with the defaults 0.98 s). Figures: ``..._call_s``, until ``async_save``
      returns; ``..._block_s``, until staging is done (``staging_completion``) —
      the earliest the training may change the state again, as ours may when
      ``save`` returns: the stall the ratios use (a loop could overlap async
      staging with forward/backward before its optimizer step; on 2 busy cores the
      copy then slows the step instead); ``..._total_s``, until the upload is done.
      The first (untimed) save of each starts the daemon, which ends with it.

    Durability: with the installed torch, ``FileSystemWriter(sync_files=True)``
    is the default, so DCP fsyncs every data file and the ``.metadata`` file;
    it does not fsync the directory after renaming ``.metadata`` into place.

    Without a process group, a 1-process gloo group (on a ``HashStore``) is
    created here and destroyed afterwards, so DCP runs its usual collective
    planning path. If the caller already has a group with several ranks, DCP
    runs with ``no_dist=True`` so it does not wait for the other ranks.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    own_pg = not dist.is_initialized()
    if own_pg:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    no_dist = dist.get_world_size() > 1
    out = {"bytes": state_bytes(state), "dcp_sync_files": True,
           "dcp_mode": "no_dist" if no_dist else f"gloo world_size={dist.get_world_size()}"}
    try:
        with _scratch(workdir, "dcp") as d:
            counter = iter(range(10**9))

            def fresh_dir() -> str:
                return str(d / f"ckpt{next(counter)}")

            def clear():
                for p in d.iterdir():
                    shutil.rmtree(p, ignore_errors=True)

            out.update(_result("dcp_save", _time_reps(
                lambda: dcp.save(state, checkpoint_id=fresh_dir(), no_dist=no_dist), reps, before=clear,
                floor=floor)))

            def async_reps(name: str, **kwargs) -> None:
                call, block, total = [], [], []
                for i in range(reps + 1):
                    clear()
                    t0 = time.perf_counter()
                    response = dcp.async_save(state, checkpoint_id=fresh_dir(), no_dist=no_dist, **kwargs)
                    t1 = time.perf_counter()
                    t2, t3 = wait_async_save(response, t1)
                    if i:
                        call.append(t1 - t0)
                        block.append(t2 - t0)
                        total.append(t3 - t0)
                out.update(_result(f"{name}_call", call))
                out.update(_result(f"{name}_block", block))
                out.update(_result(f"{name}_total", total))

            async_reps("dcp_async_save")
            variants = {}
            for name, async_staging in (("process_sync", False), ("process_async", True)):
                options = _fast_dcp_staging(async_staging)
                stager = DefaultStager(options)
                try:
                    async_reps(f"dcp_async_save_{name}", async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                               async_stager=stager)
                finally:
                    stager.close()
                    _stop_dcp_process()  # and the staged copy it holds: one variant's memory at a time
                variants[name] = {"async_checkpointer_type": "PROCESS",
                                  "async_stager": "DefaultStager, kept across saves",
                                  **{k: getattr(options, k) for k in ("use_pinned_memory", "use_shared_memory",
                                                                      "use_async_staging", "use_non_blocking_copy")}}
            best = min(variants, key=lambda n: out[f"dcp_async_save_{n}_block_s"])
            out["dcp_async_save_fastest_config"] = {"variant": best, **variants[best]}
            for part in ("call", "block", "total"):
                for suffix in ("s", "samples", "stats"):
                    out[f"dcp_async_save_fastest_{part}_{suffix}"] = out[f"dcp_async_save_{best}_{part}_{suffix}"]
    finally:
        if own_pg:
            dist.destroy_process_group()
    return out


# ---------------------------------------------------------------- CLI


def measure_all(size_bytes: int, reps: int, workdir: Path) -> dict:
    """All peers and floors for one state of ``size_bytes`` (seconds); the disk
    floor's samples, taken next to each durable save, are under ``disk_floor``."""
    state = make_state(size_bytes)
    out = {"size_bytes": state_bytes(state), "reps": reps, "cpu_count": os.cpu_count(),
           "torch": torch.__version__, "workdir": str(workdir),
           "loadavg_1min_before": os.getloadavg()[0]}  # other work on the machine skews timings
    with _scratch(workdir, "floor") as d:
        floor = DiskFloor(d)
        arrays = byte_views(state)
        floor.prewarm(arrays, prewarm_copies(state_bytes(state), reps))
        for name, fn in (("floors", measure_floors), ("torch_save", measure_torch_save), ("dcp", measure_dcp)):
            t0 = time.perf_counter()
            if name == "floors":
                out[name] = fn(state, reps)
            else:
                out[name] = fn(state, workdir, reps, floor=lambda: floor.sample(arrays))
            print(f"{name}: {_summary(out[name])}  ({time.perf_counter() - t0:.1f} s)", flush=True)
        out["disk_floor"] = _result("write_fsync", floor.samples)
    return out


def _summary(d: dict) -> str:
    return ", ".join(f"{k}={v:.3f}" for k, v in d.items() if k.endswith("_s") and isinstance(v, float))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--workdir", type=Path, default=Path(__file__).resolve().parent / ".cache" / "work",
                   help="where files are written (must be a real disk, not tmpfs)")
    p.add_argument("--json", type=Path, help="write the results here")
    a = p.parse_args(argv)
    t0 = time.perf_counter()
    out = measure_all(a.size_mib << 20, a.reps, a.workdir)
    out["command"] = shlex.join(["python", f"benchmarks/{Path(__file__).name}",
                                 *(sys.argv[1:] if argv is None else argv)])
    out["wall_s"] = time.perf_counter() - t0
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")
    print(f"done in {out['wall_s']:.1f} s" + (f", wrote {a.json}" if a.json else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
