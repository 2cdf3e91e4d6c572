"""Worker of the Flash Checkpoint benchmark: runs under dlrover (1 node x 1 worker) and
measures our Checkpointer on the same state as the peers (16 float32 tensors).

Attempt 0 measures saves, durability (interleaved with the raw write + fsync floor),
step slowdown during a persist and dropped saves, then SIGKILLs itself. Each of the next
``--cycles`` attempts (restarted by the agent) times its process's first ``load()``
from memory into a live model (a cold restore), checks it bit for bit, and SIGKILLs
itself again; the last one then also times ``--reps`` more loads in the same process
(warm) and exits. Results are merged into --out (JSON).
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

_PROCESS_START = time.time()  # before the slow imports: part of a restart

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ckpt_common import DiskFloor, byte_views, digest, prewarm_copies  # noqa: E402
from checkpoint_peers import live_model, make_state  # noqa: E402

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
    arrays = byte_views(state)
    disk = DiskFloor(Path(ckpt.storage.url) / "raw-floor")
    disk.prewarm(arrays, prewarm_copies(a.size_bytes, a.reps))
    for i in range(a.reps + 1):
        step = 100 + i
        time.sleep(0.3)  # persists are steps apart in training; let the last commit's retention finish
        floor_s = disk.sample(arrays)
        time.sleep(0.3)
        t0 = time.perf_counter()
        ckpt.save(step, {"model": model}, force=True)
        blocked.append(time.perf_counter() - t0)
        wait_committed(storage, step)
        if i:  # the first round warms up
            durable.append(time.perf_counter() - t0)
            floor.append(floor_s)
    disk.clear()
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

    ckpt.save(400, {"model": model})  # memory only: what the restarted workers restore
    out["digest"] = digest(state)
    die(a, out)


def die(a: argparse.Namespace, out: dict) -> None:
    """Record what was measured, then SIGKILL this worker (the agent restarts it)."""
    out["kill_wall_time"] = time.time()
    Path(a.out).write_text(json.dumps(out))
    os.kill(os.getpid(), signal.SIGKILL)


def restarted(a: argparse.Namespace, out: dict, cycle: int) -> None:
    """A restarted worker: its first ``load()`` (cold) into a live model, checked bit for
    bit; SIGKILL again until ``--cycles`` cold restores are taken, then warm loads."""
    model = as_module(live_model(a.size_bytes))  # a live model: its memory in use
    ckpt = train.Checkpointer()
    load_called = time.time()
    t0 = time.perf_counter()
    restored = ckpt.load({"model": model})
    cold = time.perf_counter() - t0
    restored_at = time.time()
    print(f"cold restore {cold:.4f} s from {restored.source}", flush=True)
    kill = out.pop("kill_wall_time")
    out.setdefault("restore_cold_samples", []).append(cold)
    out.setdefault("kill_to_restored_samples", []).append(restored_at - kill)
    out.setdefault("kill_breakdown_s", []).append({  # wall clock, across the two processes
        "until_new_process_starts": _PROCESS_START - kill,
        "new_process_setup": load_called - _PROCESS_START,  # imports, init, live model, Checkpointer()
        "load": restored_at - load_called})
    out.setdefault("restore_cold_sources", []).append(restored.source)
    out.setdefault("restore_cold_steps", []).append(restored.step)
    exact = digest(model.state_dict()) == out["digest"]
    out["restore_bit_exact"] = out.get("restore_bit_exact", True) and exact
    if cycle < a.cycles:
        die(a, out)

    warm, sources = [], []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        restored = ckpt.load({"model": model})
        warm.append(time.perf_counter() - t0)
        sources.append(restored.source)
    colds = out["restore_cold_samples"]
    out["restore_cold_s"] = statistics.median(colds)
    out["restore_s"] = out["restore_cold_s"]  # the headline restore: cold, after a restart
    out["restore_warm_samples"], out["restore_warm_s"] = warm, statistics.median(warm)
    out["restore_first_s"] = colds[0]
    out["kill_to_restored_s"] = statistics.median(out["kill_to_restored_samples"])
    out["restore_sources"] = sorted(set(out["restore_cold_sources"]) | set(sources))
    out["restore_step"] = restored.step
    out["restore_bit_exact"] = out["restore_bit_exact"] and digest(model.state_dict()) == out.pop("digest")
    out["restart_cycles"] = a.cycles


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size-bytes", type=int, required=True)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cycles", type=int, default=5, help="restarts, each timing its first (cold) restore")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    info = train.init()
    out = json.loads(Path(a.out).read_text()) if Path(a.out).exists() else {}
    if info.restart_count == 0:
        attempt0(a, out)
    else:
        restarted(a, out, info.restart_count)
        Path(a.out).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
