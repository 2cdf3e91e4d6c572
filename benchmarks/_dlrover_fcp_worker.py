"""Worker for ``dlrover_peer.py``: times DLRover's ``DdpCheckpointer``.

Runs under ``dlrover-run --max-restarts CYCLES`` in DLRover's own venv.

- First attempt: memory saves, disk saves (blocking time and time to commit,
  each after a raw write + fsync floor sample, as our worker does), memory
  saves issued while a disk save persists (dropped ones), then one last
  accepted memory save; it writes its results to ``<out>.partial`` and
  SIGKILLs itself.
- Restarted attempts (``<out>.partial`` exists): the process's first restore
  from DLRover's memory into preallocated tensors (cold), checked bit for bit;
  each SIGKILLs itself again until CYCLES cold restores are taken; the last
  then times REPS more restores (warm) and writes everything to ``<out>``.

All times are seconds (``time.perf_counter``; ``time.time`` only across the
kill). Usage: ``_dlrover_fcp_worker.py OUT_JSON CKPT_DIR SIZE_BYTES REPS [CYCLES]``.
"""

import time

_PROCESS_START = time.time()  # before the slow imports: part of a restart

import inspect  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ckpt_common import DiskFloor, byte_views, digest, prewarm_copies  # noqa: E402
from checkpoint_peers import live_model, make_state  # noqa: E402
from dlrover.python.common import storage as dl_storage  # noqa: E402
from dlrover.python.common.log import default_logger as dl_log  # noqa: E402
from dlrover.python.elastic_agent.torch.ckpt_saver import CheckpointConfig  # noqa: E402
from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType  # noqa: E402

TRACKER = "dlrover_latest.txt"  # CheckpointConstant.TRACER_FILE_NAME
MEMORY, DISK = StorageType.MEMORY, StorageType.DISK
GAPS = (0.01, 0.05, 0.2)  # seconds between memory saves during a persist


class _Log(logging.Handler):
    """Keeps DLRover's log lines so we can read what it says it did."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _median(name, samples):
    return {f"{name}_s": statistics.median(samples), f"{name}_samples": samples}


def _tracker_step(ckpt_dir):
    try:
        return int((ckpt_dir / TRACKER).read_text().strip())
    except (OSError, ValueError):  # absent, or caught between truncate and write
        return None


def _wait_commit(ckpt_dir, step, t0, timeout=60.0):
    """Seconds from ``t0`` until the tracker file names ``step``."""
    while _tracker_step(ckpt_dir) != step:
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"step {step} not committed after {timeout} s")
        time.sleep(0.002)
    return time.perf_counter() - t0


def _memory_step(ckpt):
    """Step of the checkpoint that DLRover's shared memory holds now."""
    return ckpt._engine._shm_handler.get_checkpoint_config(CheckpointConfig()).step


def _timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def first_attempt(ckpt, ckpt_dir, state, reps, log, floor_dir):
    out = {}
    # Wrap the engine call that save_checkpoint() makes, only to see the
    # bool it returns (save_checkpoint itself returns None to the caller).
    accepted = []
    engine_save = ckpt._engine.save_to_memory

    def save_to_memory(*a, **kw):
        ok = engine_save(*a, **kw)
        accepted.append(bool(ok))
        return ok

    ckpt._engine.save_to_memory = save_to_memory
    step = 0

    def save(kind):
        nonlocal step
        step += 1
        ckpt.save_checkpoint(step, state, storage_type=kind)
        return step

    # 1. Memory saves: the first one creates and faults in the segment.
    out["save_memory_first_s"] = _timed(lambda: save(MEMORY))
    out.update(_median("save_memory_block", [_timed(lambda: save(MEMORY)) for _ in range(reps)]))

    # 2. Disk saves: blocking time, then time until the tracker names the step;
    #    interleaved with the disk floor as our worker does (same pre-warming, the
    #    same pauses, the floor's last two files kept).
    arrays = byte_views(state)
    disk = DiskFloor(floor_dir)
    disk.prewarm(arrays, prewarm_copies(sum(a.nbytes for a in arrays), reps))
    block, commit, floor = [], [], []
    for i in range(reps + 1):
        time.sleep(0.3)
        floor_s = disk.sample(arrays)
        time.sleep(0.3)
        t0 = time.perf_counter()
        s = save(DISK)
        b = time.perf_counter() - t0
        c = _wait_commit(ckpt_dir, s, t0)
        shutil.rmtree(ckpt_dir / str(s), ignore_errors=True)  # keep the disk small
        if i:
            block.append(b)
            commit.append(c)
            floor.append(floor_s)
    disk.clear()
    out.update(_median("save_disk_block", block))
    out.update(_median("commit", commit))
    out.update(_median("disk_floor", floor))

    # 3. Memory saves issued while a disk save persists, one "training step"
    #    (gap) apart, until the tracker names the disk step or a deadline.
    #    A memory save counts as dropped when DLRover's engine returned False
    #    for it (it could not take the shm lock the agent holds while it
    #    writes); save_checkpoint() hides that from the caller, DLRover only
    #    logs "skips the save" (counted too, as a cross-check). The disk save
    #    counts as lost when its step never reaches the tracker file (the
    #    agent refuses to persist once a newer memory save replaced it).
    window = 2 * out["commit_s"] + 1.0

    def during_persist(gap):
        n0, lines0 = len(accepted), len(log.lines)
        t0 = time.perf_counter()
        disk_step = save(DISK)
        issued = []  # [step, issued at (s after the DISK save call), accepted]
        while True:
            time.sleep(gap)
            if _tracker_step(ckpt_dir) == disk_step or time.perf_counter() - t0 > window:
                break
            at = round(time.perf_counter() - t0, 3)
            issued.append([save(MEMORY), at, accepted[-1]])
        try:
            committed = _wait_commit(ckpt_dir, disk_step, t0, timeout=window + 5)
        except TimeoutError:
            committed = None
        shutil.rmtree(ckpt_dir / str(disk_step), ignore_errors=True)
        return {
            "gap_s": gap,
            "disk_step": disk_step,
            "disk_save_accepted": accepted[n0],  # the DISK save's own memory copy
            "disk_save_persisted": committed is not None,
            "commit_s": committed,
            "memory_saves_issued": len(issued),
            "dropped_saves": sum(not a for _, _, a in issued),
            "skip_log_lines": sum("skips the save" in m for m in log.lines[lines0:]),
            "memory_step_after": _memory_step(ckpt),
            "last_accepted_step": max([s for s, _, a in issued if a], default=disk_step),
            "issued": issued,
        }

    def agent_idle():
        """Wait for a disk save that commits: proof that the agent's queue is empty.
        DLRover skips the memory copy of a save while its agent still writes an older
        one (then persists what memory held, and the new step never commits): try
        again until one does."""
        deadline = time.perf_counter() + 10 * window + 120
        while True:
            step = save(DISK)
            try:
                _wait_commit(ckpt_dir, step, time.perf_counter(), timeout=window + 20)
                return
            except TimeoutError:
                if time.perf_counter() > deadline:
                    raise
            finally:
                shutil.rmtree(ckpt_dir / str(step), ignore_errors=True)  # keep the disk small

    runs = []
    for gap in GAPS:
        agent_idle()
        runs.append(during_persist(gap))
    agent_idle()
    out["during_persist"] = runs
    out["dropped_saves"] = sum(r["dropped_saves"] for r in runs)
    out["memory_saves_during_persist"] = sum(r["memory_saves_issued"] for r in runs)
    out["disk_saves_lost"] = sum(not r["disk_save_persisted"] for r in runs)

    # 4. One last memory save that must land, then die without warning.
    for _ in range(50):
        s = save(MEMORY)
        if accepted[-1]:
            break
        time.sleep(0.1)
    out["killed_at_step"] = s
    return out


def _restore(ckpt, model, log):
    """``load_checkpoint()`` + copy into ``model``: (seconds, seconds of the load alone,
    where DLRover says it read from, its log lines)."""
    lines0 = len(log.lines)
    t0 = time.perf_counter()
    loaded = ckpt.load_checkpoint()
    t1 = time.perf_counter()
    with torch.no_grad():
        for k, t in model.items():
            t.copy_(loaded[k])
    t2 = time.perf_counter()
    said = [m for m in log.lines[lines0:] if "Load" in m or "load" in m]
    source = ("memory" if any("from memory" in m or "CPU memory buffer" in m for m in said)
              else "disk" if any(m.startswith("Load the state dict from /") for m in said)
              else "unknown")
    return t2 - t0, t1 - t0, source, said


def restarted_attempt(ckpt, size, out, log):
    """The process's first restore (cold), after DdpCheckpointer() as a training
    script builds it; appended to ``out``'s lists."""
    model = live_model(size)  # a live model, pages touched
    load_called_at = time.time()
    cold, views, source, said = _restore(ckpt, model, log)
    restored_at = time.time()
    kill = out.pop("kill_wall_time")
    for key, value in (("restore_cold", cold), ("restore_views", views), ("kill_to_restored", restored_at - kill)):
        out.setdefault(f"{key}_samples", []).append(value)
    out.setdefault("kill_breakdown_s", []).append({  # wall clock, across the two processes
        "until_new_process_starts": _PROCESS_START - kill,
        "new_process_setup": load_called_at - _PROCESS_START,  # imports, group, live model, DdpCheckpointer()
        "load_and_copy": restored_at - load_called_at,
    })
    out.setdefault("restore_cold_sources", []).append(source)
    out.setdefault("restore_cold_steps", []).append(_memory_step(ckpt))
    out.setdefault("restore_log", said[:4])
    exact = digest(model) == out["digest"]
    out["restore_correct"] = out.get("restore_correct", True) and exact
    return model


def warm_restores(ckpt, model, reps, out, log):
    """More restores in the same (last) process, then the summary keys."""
    warm, sources = [], []
    for _ in range(reps):
        s, _, source, _ = _restore(ckpt, model, log)
        warm.append(s)
        sources.append(source)
    out.update(_median("restore_warm", warm))
    out.update(_median("restore_cold", out["restore_cold_samples"]))
    out.update(_median("restore_views", out["restore_views_samples"]))
    out.update(_median("kill_to_restored", out["kill_to_restored_samples"]))
    out["restore_memory_s"] = out["restore_cold_s"]  # the headline restore: cold, after a restart
    out["restore_memory_samples"] = out["restore_cold_samples"]
    out["restore_sources"] = sorted(set(out["restore_cold_sources"]) | set(sources))
    out["restore_source"] = out["restore_sources"][0] if len(out["restore_sources"]) == 1 else "mixed"
    out["restore_step"] = _memory_step(ckpt)
    out["restore_correct"] = out["restore_correct"] and digest(model) == out.pop("digest")


def fsync_facts():
    """Read the installed DLRover: does its POSIX storage fsync the data file?"""
    data_src = inspect.getsource(dl_storage.PosixDiskStorage.write_state_dict)
    tracker_src = inspect.getsource(dl_storage.PosixDiskStorage.write)
    return {
        "fsyncs_data": "fsync" in data_src,
        "fsyncs_tracker": "fsync" in tracker_src,
        "fsyncs_checked": (
            f"{dl_storage.__file__}: PosixDiskStorage.write_state_dict (the agent's "
            "CommonDirCheckpointSaver.persist_to_storage passes write_func=torch.save) "
            "and PosixDiskStorage.write (tracker/done files)"
        ),
    }


def main():
    out_path, ckpt_dir = Path(sys.argv[1]), Path(sys.argv[2])
    size, reps = int(sys.argv[3]), int(sys.argv[4])
    cycles = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    partial = out_path.with_name(out_path.name + ".partial")
    with open(out_path.with_name("worker_pids.txt"), "a") as f:
        f.write(f"{os.getpid()}\n")

    log = _Log()
    dl_log.addHandler(log)
    # A one-process gloo group, as in DDP training (DLRover then runs its
    # readiness all_reduce / step all_gather); a HashStore avoids TCPStore
    # state from the killed attempt.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    first = not partial.exists()
    state = make_state(size) if first else None  # a restarted process needs only the shapes

    t0 = time.perf_counter()
    ckpt = DdpCheckpointer(str(ckpt_dir))
    init_s = time.perf_counter() - t0

    def die(out):
        out["kill_wall_time"] = time.time()
        partial.write_text(json.dumps(out))
        os.kill(os.getpid(), signal.SIGKILL)

    try:
        if first:
            out = {"init_s": init_s, "bytes": sum(t.numel() * t.element_size() for t in state.values()),
                   "reps": reps, "restart_cycles": cycles, "dlrover_torch": torch.__version__, **fsync_facts()}
            out.update(first_attempt(ckpt, ckpt_dir, state, reps, log, out_path.parent / "raw-floor"))
            out["digest"] = digest(state)
            die(out)

        out = json.loads(partial.read_text())
        out.setdefault("restart_init_samples", []).append(init_s)
        model = restarted_attempt(ckpt, size, out, log)
        if len(out["restore_cold_samples"]) < cycles:
            die(out)
        warm_restores(ckpt, model, reps, out, log)
    except Exception:  # report it and end the run: a restart would only repeat a part of it
        out_path.write_text(json.dumps({"failed": traceback.format_exc()[-3000:]}))
        partial.unlink(missing_ok=True)
        dist.destroy_process_group()
        return
    out["restart_count_env"] = os.getenv("TORCHELASTIC_RESTART_COUNT")
    out_path.write_text(json.dumps(out, indent=2))
    partial.unlink()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
