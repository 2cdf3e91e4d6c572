"""Peers and floors for the checkpoint benchmark.

Each ``measure_*`` function times one way of saving/loading the same state and
returns medians in **seconds** (``*_s``) plus the raw samples (``*_samples``,
lists of seconds). Every measurement does one untimed warm-up, then ``reps``
timed repetitions with ``time.perf_counter``. Files go into a private
subfolder of ``workdir`` that is removed before returning.

Only stdlib, torch and numpy; importing this module has no side effects.

Try it alone::

    python benchmarks/checkpoint_peers.py --size-mib 256 --reps 3 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import numpy as np
import torch

# ---------------------------------------------------------------- helpers


def make_state(total_bytes: int, n_tensors: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """``n_tensors`` equal-sized float32 CPU tensors of random content, about
    ``total_bytes`` bytes in all (rounded down to whole float32 elements)."""
    numel = max(1, total_bytes // (4 * n_tensors))
    gen = torch.Generator().manual_seed(seed)
    return {f"layer{i:02d}.weight": torch.randn(numel, generator=gen) for i in range(n_tensors)}


def state_bytes(state: dict[str, torch.Tensor]) -> int:
    """Total payload of ``state`` in bytes."""
    return sum(t.numel() * t.element_size() for t in state.values())


def _time_reps(fn: Callable[[], object], reps: int,
               before: Callable[[], object] | None = None) -> list[float]:
    """One untimed warm-up call of ``fn``, then ``reps`` timed calls (seconds).
    ``before`` runs untimed ahead of every call (e.g. to remove the last file)."""
    samples = []
    for i in range(reps + 1):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        if i:
            samples.append(dt)
    return samples


def _result(name: str, samples: list[float]) -> dict:
    return {f"{name}_s": statistics.median(samples), f"{name}_samples": samples}


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


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
    path = f"/dev/shm/ckpt-peers-{os.getpid()}-{time.monotonic_ns()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.unlink(path)
        os.ftruncate(fd, nbytes)
        buf = torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)
    finally:
        os.close(fd)
    return buf.zero_()


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


def measure_floors(state: dict[str, torch.Tensor], workdir: Path, reps: int, keep_files: int = 2) -> dict:
    """Hardware floors for moving the bytes of ``state`` (seconds).

    - ``memcpy_s``: fastest copy into one preallocated, pre-touched private
      buffer, over torch ``copy_`` on all cores, a chunked numpy copy on one
      thread per core, and torch on one thread; ``memcpy_method`` names the
      winner, ``memcpy_methods_s`` gives every method's median.
    - ``memcpy_1thread_s``: torch ``copy_`` on one thread, same buffer.
    - ``memcpy_shm_s`` (+ ``_method``, ``_methods_s``): the same methods into
      a pre-touched /dev/shm mapping (where flash checkpoints copy to).
    - ``write_fsync_s``: raw ``os.write`` of the bytes into a new file in
      ``workdir``, ``fsync`` of the file and of its directory; the last
      ``keep_files`` files stay on disk, as checkpoints do under retention.

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

    np_src = [s.numpy() for s in srcs]
    with _scratch(workdir, "raw") as d:
        written: list[Path] = []

        def next_file() -> None:
            # Like checkpoints under retention: each write goes to a new file and the last
            # `keep_files` stay on disk. (On a thin-provisioned VM disk, writing blocks that
            # were never written is several times slower than rewriting freed ones, so
            # deleting the file before each write would flatter the floor.)
            while len(written) > keep_files - 1:
                written.pop(0).unlink(missing_ok=True)
            written.append(d / f"raw{len(written)}_{time.monotonic_ns()}.bin")

        def write_fsync():
            path = written[-1]
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for s in np_src:
                    view = memoryview(s)
                    while view:
                        view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            _fsync_dir(d)

        samples = _time_reps(write_fsync, reps, before=next_file)
        out.update(_result("write_fsync", samples))
    return out


# ---------------------------------------------------------------- torch.save / torch.load


def measure_torch_save(state: dict[str, torch.Tensor], workdir: Path, reps: int) -> dict:
    """``torch.save`` / ``torch.load`` of ``state`` (seconds).

    - ``save_s``: blocking time of ``torch.save`` into a new file + ``fsync``
      of the file and its directory.
    - ``load_s``: ``torch.load(map_location="cpu", weights_only=True)`` of that
      file, page cache warm (it was just written).
    - ``load_into_model_s``: the same load, then ``copy_`` into preallocated,
      pre-touched same-shaped tensors (what ``load_state_dict`` does).
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
            _fsync_dir(d)

        def load():
            return torch.load(path, map_location="cpu", weights_only=True)

        def load_into_model():
            loaded = load()
            with torch.no_grad():
                for k, t in model.items():
                    t.copy_(loaded[k])

        out.update(_result("save", _time_reps(save, reps, before=lambda: path.unlink(missing_ok=True))))
        out.update(_result("load", _time_reps(load, reps)))
        out.update(_result("load_into_model", _time_reps(load_into_model, reps)))
        if not all(torch.equal(model[k], state[k]) for k in state):
            raise RuntimeError("torch.load gave back different data")
    return out


# ---------------------------------------------------------------- torch.distributed.checkpoint


def measure_dcp(state: dict[str, torch.Tensor], workdir: Path, reps: int) -> dict:
    """``torch.distributed.checkpoint`` save of ``state`` (seconds), a fresh
    checkpoint directory per repetition.

    - ``dcp_save_s``: blocking time of ``dcp.save``.
    - ``dcp_async_save_block_s``: time until ``dcp.async_save`` returns (it
      stages a CPU copy of the state synchronously, into freshly allocated
      memory with the default stager).
    - ``dcp_async_save_total_s``: time until its future completes.

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
                lambda: dcp.save(state, checkpoint_id=fresh_dir(), no_dist=no_dist), reps, before=clear)))

            block, total = [], []
            for i in range(reps + 1):
                clear()
                t0 = time.perf_counter()
                fut = dcp.async_save(state, checkpoint_id=fresh_dir(), no_dist=no_dist)
                t1 = time.perf_counter()
                fut.result(timeout=600)
                t2 = time.perf_counter()
                if i:
                    block.append(t1 - t0)
                    total.append(t2 - t0)
            out.update(_result("dcp_async_save_block", block))
            out.update(_result("dcp_async_save_total", total))
    finally:
        if own_pg:
            dist.destroy_process_group()
    return out


# ---------------------------------------------------------------- CLI


def measure_all(size_bytes: int, reps: int, workdir: Path) -> dict:
    """All peers and floors for one state of ``size_bytes`` (seconds)."""
    state = make_state(size_bytes)
    out = {"size_bytes": state_bytes(state), "reps": reps, "cpu_count": os.cpu_count(),
           "torch": torch.__version__, "workdir": str(workdir),
           "loadavg_1min_before": os.getloadavg()[0]}  # other work on the machine skews timings
    for name, fn in (("floors", measure_floors), ("torch_save", measure_torch_save), ("dcp", measure_dcp)):
        t0 = time.perf_counter()
        out[name] = fn(state, workdir, reps)
        print(f"{name}: {_summary(out[name])}  ({time.perf_counter() - t0:.1f} s)", flush=True)
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
    out["wall_s"] = time.perf_counter() - t0
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")
    print(f"done in {out['wall_s']:.1f} s" + (f", wrote {a.json}" if a.json else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
