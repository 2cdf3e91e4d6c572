"""Worker of the Flash Checkpoint benchmark: runs under dlrover (1 node x 1 worker) and
measures our Checkpointer on the same state as the peers (16 float32 tensors).

Attempt 0 measures saves, durability, step slowdown during a persist and dropped saves, then
SIGKILLs itself; attempt 1 (restarted by the agent) measures restores from memory into a
live model. Results are merged into --out (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from checkpoint_peers import make_state  # noqa: E402

from dlrover_core import train  # noqa: E402
from dlrover_core.storage.posix import PosixStorage  # noqa: E402


def as_module(state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """A live model holding the tensors as parameters (state_dict keys == state keys)."""
    model = torch.nn.Module()
    for key, tensor in state.items():
        layer_name, _ = key.split(".")
        layer = torch.nn.Module()
        layer.weight = torch.nn.Parameter(tensor, requires_grad=False)
        model.add_module(layer_name, layer)
    return model


def work_step(a: torch.Tensor) -> float:
    """A fixed CPU 'training step' (matmuls), timed."""
    t0 = time.perf_counter()
    for _ in range(40):
        torch.mm(a, a)
    return time.perf_counter() - t0


def write_fsync(state: dict[str, torch.Tensor], directory: Path, kept: list[Path], keep: int = 2) -> float:
    """Raw write + fsync (file and directory) of the state's bytes to a new file; seconds.

    Files beyond the last ``keep`` are deleted after the write, as retention deletes old
    steps after a commit (on a thin-provisioned disk, writing never-written blocks is
    several times slower than rewriting freed ones: both sides must meet the same disk)."""
    path = directory / f"raw{time.monotonic_ns()}.bin"
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    try:
        for t in state.values():
            view = memoryview(t.view(-1).view(torch.uint8).numpy())
            while view:
                view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)
    dfd = os.open(directory, os.O_RDONLY)
    os.fsync(dfd)
    os.close(dfd)
    elapsed = time.perf_counter() - t0
    kept.append(path)
    while len(kept) > keep:
        kept.pop(0).unlink()
    return elapsed


def prewarm(state: dict[str, torch.Tensor], directory: Path, copies: int) -> None:
    """Write ``copies`` times the state's bytes, fsync, delete, sync: later writes then reuse
    blocks the disk has held before. (On a thin-provisioned VM disk, first writes to a block
    are several times slower than rewrites, which would make either side of the comparison
    win at random.)"""
    kept: list[Path] = []
    for _ in range(copies):
        write_fsync(state, directory, kept, keep=copies)
    for path in kept:
        path.unlink()
    os.sync()
    time.sleep(1.0)


def wait_committed(storage: PosixStorage, step: int, timeout_s: float = 600) -> None:
    deadline = time.monotonic() + timeout_s
    while storage.latest_step() != step:
        if time.monotonic() > deadline:
            raise TimeoutError(f"step {step} was not committed within {timeout_s} s")
        time.sleep(0.001)


def attempt0(a: argparse.Namespace, out: dict) -> None:
    state = make_state(a.size_bytes)
    model = as_module(state)
    ckpt = train.Checkpointer()
    storage = PosixStorage(ckpt.storage.url)
    t0 = time.perf_counter()
    ckpt.save(1, {"model": model})
    out["first_save_s"] = time.perf_counter() - t0  # allocates and pre-touches the slot
    ckpt.save(2, {"model": model})  # second slot
    stalls = []
    for i in range(a.reps):
        t0 = time.perf_counter()
        ckpt.save(10 + i, {"model": model})
        stalls.append(time.perf_counter() - t0)
    out["stall_samples"], out["stall_s"] = stalls, statistics.median(stalls)

    # save -> committed and fsynced, interleaved with the floor (a raw write + fsync of the
    # same bytes to a new file on the same filesystem, its last two files kept, as the
    # checkpoint keeps its last two steps): both meet the disk in the same state
    durable, blocked, floor = [], [], []
    raw_dir = Path(ckpt.storage.url) / "raw-floor"
    raw_dir.mkdir(parents=True, exist_ok=True)
    prewarm(state, raw_dir, copies=2 * a.reps + 6)
    raw_files: list[Path] = []
    for i in range(a.reps + 1):
        step = 100 + i
        time.sleep(0.3)  # persists are steps apart in training; let the last commit's retention finish
        floor_s = write_fsync(state, raw_dir, raw_files)
        time.sleep(0.3)
        t0 = time.perf_counter()
        ckpt.save(step, {"model": model}, force=True)
        blocked.append(time.perf_counter() - t0)
        wait_committed(storage, step)
        if i:  # the first round warms up
            durable.append(time.perf_counter() - t0)
            floor.append(floor_s)
    for path in raw_files:
        path.unlink()
    out["durable_samples"], out["durable_s"] = durable, statistics.median(durable)
    out["write_fsync_samples"], out["write_fsync_s"] = floor, statistics.median(floor)
    out["persist_save_block_s"] = statistics.median(blocked)

    # saves issued while a persist runs: none may be lost
    dropped, issued = 0, 0
    ckpt.save(200, {"model": model}, force=True)
    step = 200
    while storage.latest_step() != 200:
        step += 1
        ckpt.save(step, {"model": model})
        issued += 1
        if step not in ckpt.memory_steps():
            dropped += 1
    out["saves_during_persist"], out["dropped_saves"] = issued, dropped
    wait_committed(storage, 200)

    # a training step alone, and while a persist runs in the agent; training on all cores,
    # and on all but one (as when an accelerator computes and the host mostly feeds it)
    cores = os.cpu_count() or 1
    for label, threads in (("", max(1, cores - 1)), ("_all_cores", cores)):
        torch.set_num_threads(threads)
        a_mat = torch.randn(384, 384)
        work_step(a_mat)
        alone = [work_step(a_mat) for _ in range(max(5, a.reps))]
        during = []
        step = 300 + threads
        ckpt.save(step, {"model": model}, force=True)
        while storage.latest_step() != step and len(during) < 30:
            during.append(work_step(a_mat))
        wait_committed(storage, step)
        out[f"step_threads{label}"] = threads
        out[f"step_alone{label}_s"] = statistics.median(alone)
        out[f"step_during_persist{label}_s"] = statistics.median(during or alone)
        out[f"steps_during_persist{label}"] = len(during)
        out[f"step_slowdown_during_persist{label}"] = out[f"step_during_persist{label}_s"] / out[f"step_alone{label}_s"] - 1

    ckpt.save(400, {"model": model})  # memory only: what the restarted worker restores
    Path(a.out).write_text(json.dumps(out))
    os.kill(os.getpid(), signal.SIGKILL)


def attempt1(a: argparse.Namespace, out: dict) -> None:
    want = make_state(a.size_bytes)
    model = as_module({k: torch.randn_like(v) for k, v in want.items()})  # a live model: memory in use
    ckpt = train.Checkpointer()
    restores, sources = [], []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        restored = ckpt.load({"model": model})
        restores.append(time.perf_counter() - t0)
        sources.append(restored.source)
        print(f"restore {restores[-1]:.4f} s from {restored.source}", flush=True)
    out["restore_samples"], out["restore_s"] = restores, statistics.median(restores)
    out["restore_first_s"] = restores[0]
    out["restore_sources"] = sorted(set(sources))
    out["restore_step"] = restored.step
    out["restore_bit_exact"] = all(torch.equal(p, want[k]) for k, p in model.state_dict().items())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size-bytes", type=int, required=True)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    info = train.init()
    out = json.loads(Path(a.out).read_text()) if Path(a.out).exists() else {}
    if info.restart_count == 0:
        attempt0(a, out)
    else:
        attempt1(a, out)
        Path(a.out).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
