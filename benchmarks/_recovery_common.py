"""Helpers of ``recovery.py``: fault schedules and injection, reading what each side logged,
the torchrun side, and cleaning up.

Clocks: every timestamp compared across processes is wall-clock ``time.time()`` on this one
machine (the killer's, the workers', the progress records'). The master's events carry
seconds since the master started (its monotonic clock); :class:`EventTail` maps them to wall
time by watching ``events.jsonl`` grow.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
CHARLM = ROOT / "examples" / "charlm"
TORCHRUN_SCRIPT = HERE / "_recovery_torchrun_train.py"

# Runs before torchrun: SIGTERM it when the benchmark dies (PR_SET_PDEATHSIG = 1), or exit at
# once if the benchmark is already gone. A tiny interpreter start instead of preexec_fn, which
# is unsafe in a process with threads. (torchrun stops its workers on SIGTERM.)
_PDEATHSIG_EXEC = (
    "import ctypes,os,signal,sys;"
    "ctypes.CDLL(None,use_errno=True).prctl(1,signal.SIGTERM,0,0,0);"
    "os.getppid()==int(sys.argv[1]) or os._exit(1);"
    "os.execvp(sys.argv[2],sys.argv[2:])"
)


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Complete JSON lines of ``path`` (a torn last line is skipped); ``[]`` if missing."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        return []
    out = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


# ----- fault schedules ---------------------------------------------------------------------


def fault_schedule(*, seed: int, mtbf_s: float, horizon_s: float, world_size: int) -> list[dict[str, Any]]:
    """Seeded failures with exponential inter-arrival times of mean ``mtbf_s`` (a Poisson
    process) up to ``horizon_s`` seconds: ``[{"offset_s", "rank"}]``, offsets from the start
    of training."""
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(1.0 / mtbf_s)
        if t > horizon_s:
            return out
        out.append({"offset_s": round(t, 3), "rank": rng.randrange(world_size)})


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False


class FaultInjector(threading.Thread):
    """SIGKILLs a rank's current worker at each scheduled offset from the first training step.

    ``anchor()`` returns the wall time of the first step (``None`` until there is one);
    ``victim(rank)`` returns ``(pid, incarnation)`` of the rank's current worker or ``None``
    (``incarnation``: the dlrover round or the torchrun restart count). A failure due while
    no worker of that rank lives (between restarts) hits the next one that does, as soon as
    it exists. ``kills`` lists what was done: ``{"offset_s", "rank", "t_kill", "pid",
    "incarnation", "late_s"}``.
    """

    def __init__(self, schedule: list[dict[str, Any]], *, anchor: Callable[[], float | None],
                 victim: Callable[[int], tuple[int, int] | None], poll_s: float = 0.02) -> None:
        super().__init__(name="recovery-faults", daemon=True)
        self.schedule = schedule
        self._anchor = anchor
        self._victim = victim
        self._poll_s = poll_s
        self._halt = threading.Event()
        self.kills: list[dict[str, Any]] = []
        self.t0: float | None = None

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)

    def run(self) -> None:
        while self.t0 is None and not self._halt.wait(self._poll_s):
            with contextlib.suppress(Exception):
                self.t0 = self._anchor()
        for fault in self.schedule:
            due = self.t0 + fault["offset_s"]
            while not self._halt.is_set() and time.time() < due:
                self._halt.wait(min(self._poll_s * 5, max(0.0, due - time.time())))
            while not self._halt.is_set():
                found = None
                with contextlib.suppress(Exception):
                    found = self._victim(fault["rank"])
                if found is not None and alive(found[0]):
                    t_kill = time.time()
                    try:
                        os.kill(found[0], signal.SIGKILL)
                    except ProcessLookupError:
                        continue
                    self.kills.append({**fault, "t_kill": t_kill, "pid": found[0], "incarnation": found[1],
                                       "late_s": round(t_kill - due, 3)})
                    break
                self._halt.wait(self._poll_s)
            if self._halt.is_set():
                return


# ----- what the sides logged -----------------------------------------------------------------


def ours_records(log_dir: Path, rank: int = 0) -> list[dict[str, Any]]:
    """Progress records of ``rank`` in a dlrover-core run, in order, each with ``inc``: the
    round it belongs to."""
    out = []
    for path in Path(log_dir).glob(f"node_*/round_*/progress_rank{rank}.jsonl"):
        rnd = int(path.parent.name.split("_")[1])
        out.extend({**r, "inc": rnd} for r in read_jsonl(path))
    # records of one round are in file order; rounds follow each other
    return sorted(out, key=lambda r: r["inc"])


def torchrun_records(out_dir: Path, rank: int = 0) -> list[dict[str, Any]]:
    """Records of ``rank`` in a torchrun run, in order, each with ``inc``: its restart count."""
    out = []
    restart = 0
    for r in read_jsonl(Path(out_dir) / f"rank{rank}.jsonl"):
        restart = r.get("restart", restart)
        out.append({**r, "inc": restart})
    return out


def first_step_t(records: list[dict[str, Any]]) -> float | None:
    return next((r["t"] for r in records if r.get("type") == "step"), None)


def lineage(records: list[dict[str, Any]]) -> dict[str, float]:
    """Productive time of the steps the final model builds on, from one rank's records in
    order: a ``restore`` of step c drops the steps after c computed before it (their time is
    ``recomputed_s``); each step counts once, with its last execution's ``dt``."""
    kept: dict[int, float] = {}
    recomputed = 0.0
    for r in records:
        if r.get("type") == "restore":
            for s in [s for s in kept if s > r["step"]]:
                recomputed += kept.pop(s)
        elif r.get("type") == "fresh":
            recomputed += sum(kept.values())
            kept.clear()
        elif r.get("type") == "step":
            s = int(r["step"])
            if s in kept:  # recomputed without a restore record (should not happen)
                recomputed += kept.pop(s)
            kept[s] = float(r["dt"])
    return {"productive_s": sum(kept.values()), "recomputed_s": recomputed, "steps": len(kept),
            "last_step": max(kept, default=-1)}


def kill_to_next_step(kills: list[dict[str, Any]], records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each kill: seconds until the first step completed by a later incarnation (the
    restarted workers); ``uninterrupted`` when that step came before the next kill (a kill
    whose recovery another kill cut short measures nothing); ``during_recovery`` when the
    previous kill's workers had not completed a step yet."""
    steps = [r for r in records if r.get("type") == "step"]
    out = []
    prev_next: float | None = None
    for i, k in enumerate(kills):
        nxt = next((r["t"] for r in steps if r["inc"] > k["incarnation"] and r["t"] > k["t_kill"]), None)
        later = kills[i + 1]["t_kill"] if i + 1 < len(kills) else None
        out.append({"t_kill": k["t_kill"], "rank": k["rank"], "incarnation": k["incarnation"],
                    "next_step_s": None if nxt is None else nxt - k["t_kill"],
                    "uninterrupted": nxt is not None and (later is None or nxt < later),
                    "during_recovery": i > 0 and (prev_next is None or prev_next > k["t_kill"])})
        prev_next = nxt
    return out


def torchrun_breakdown(kill: dict[str, Any], records: list[dict[str, Any]]) -> dict[str, float | None]:
    """Where a torchrun restart's time went, from rank 0's records (seconds from the kill)."""
    after = [r for r in records if r["inc"] > kill["incarnation"]]
    start = next((r for r in after if r.get("type") == "start"), None)
    restore = next((r for r in after if r.get("type") in ("restore", "fresh")), None)
    step = next((r for r in after if r.get("type") == "step"), None)
    t = kill["t_kill"]
    return {
        "new_script_start": None if start is None else start["t_proc"] - t,
        "torch_imported": None if start is None else start["t_import"] - t,
        "process_group": None if start is None else start["t_init"] - t,
        "restored": None if restore is None else restore["t"] - t,
        "first_step": None if step is None else step["t"] - t,
    }


class EventTail(threading.Thread):
    """Follows ``<log_dir>/events.jsonl``; stamps each event with the wall time it was seen.

    The master writes an event the moment it happens (line-buffered), so
    ``min(seen - time_s)`` over events estimates the wall time the master started, and
    :meth:`wall` turns any event's ``time_s`` into wall time with an error of about the
    polling period (20 ms) at worst.
    """

    def __init__(self, log_dir: str | Path, poll_s: float = 0.02) -> None:
        super().__init__(name="recovery-events", daemon=True)
        self.path = Path(log_dir) / "events.jsonl"
        self._poll_s = poll_s
        self._halt = threading.Event()
        self._offset = 0
        self._partial = b""
        self.events: list[dict[str, Any]] = []
        self._origin: float | None = None
        self.start()

    def run(self) -> None:
        while not self._halt.is_set():
            self._read()
            self._halt.wait(self._poll_s)
        self._read()

    def _read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        seen = time.time()
        self._offset += len(chunk)
        lines = (self._partial + chunk).split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            with contextlib.suppress(ValueError):
                ev = json.loads(line)
                ev["_seen"] = seen
                origin = seen - float(ev["time_s"])
                self._origin = origin if self._origin is None else min(self._origin, origin)
                self.events.append(ev)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)

    def wall(self, ev: dict[str, Any]) -> float:
        assert self._origin is not None
        return self._origin + float(ev["time_s"])

    def find(self, kind: str, pred: Callable[[dict[str, Any]], bool] = lambda e: True) -> list[dict[str, Any]]:
        return [e for e in list(self.events) if e.get("kind") == kind and pred(e)]


# ----- processes ---------------------------------------------------------------------------


def kill_tree(pid: int, grace_s: float = 3.0) -> int:
    """SIGCONT + SIGTERM a process and its descendants, SIGKILL what is left after
    ``grace_s``; return how many processes there were."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0
    for sig in (signal.SIGCONT, signal.SIGTERM):
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(sig)
    _, left = psutil.wait_procs(procs, timeout=grace_s)
    for p in left:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    psutil.wait_procs(left, timeout=5)
    return len(procs)


def tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) used so far by a process and its live descendants."""
    total = 0.0
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return 0.0
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def processes_with_env(key: str, values: set[str]) -> list[psutil.Process]:
    """Live processes whose environment has ``key`` set to one of ``values``."""
    found = []
    for p in psutil.process_iter():
        if p.pid == os.getpid():
            continue
        try:
            if p.status() == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get(key) in values:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


# ----- the torchrun side ---------------------------------------------------------------------


class TorchrunSide:
    """One ``torchrun --standalone --nnodes 1 --nproc-per-node N`` run of
    ``_recovery_torchrun_train.py`` in ``work``, with hard limits.

    ``wait`` returns when torchrun exits, when ``timeout_s`` passes, or when no step was
    completed for ``stall_s`` (a hung restart: then the run is killed and ``hung`` set).
    """

    def __init__(self, work: Path, *, steps: int, ckpt_every: int, nproc: int = 2, max_restarts: int = 100,
                 pg_timeout_s: float = 300.0, store: str = "prefix", seed: int = 0) -> None:
        self.work = Path(work)
        self.out_dir = self.work / "out"
        self.ckpt_dir = self.work / "ckpt"
        self.log_file = self.work / "torchrun.log"
        self.argv = [
            str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nnodes", "1",
            "--nproc-per-node", str(nproc), "--max-restarts", str(max_restarts), str(TORCHRUN_SCRIPT),
            "--steps", str(steps), "--ckpt-every", str(ckpt_every), "--ckpt-dir", str(self.ckpt_dir),
            "--out-dir", str(self.out_dir), "--store", store, "--pg-timeout-s", str(pg_timeout_s), "--seed", str(seed),
        ]
        self.nproc = nproc
        self.popen: subprocess.Popen | None = None
        self.t_launch: float | None = None
        self.t_exit: float | None = None
        self.hung = False
        self.timed_out = False

    def launch(self) -> None:
        self.work.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        with open(self.log_file, "ab") as log:
            self.t_launch = time.time()
            shim = [sys.executable, "-S", "-c", _PDEATHSIG_EXEC, str(os.getpid())] if sys.platform == "linux" else []
            self.popen = subprocess.Popen([*shim, *self.argv], env=env, cwd=str(ROOT), stdin=subprocess.DEVNULL,
                                          stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def pid(self) -> int:
        assert self.popen is not None
        return self.popen.pid

    def records(self, rank: int = 0) -> list[dict[str, Any]]:
        return torchrun_records(self.out_dir, rank)

    def victim(self, rank: int) -> tuple[int, int] | None:
        """``(pid, restart)`` of ``rank``'s current worker, or ``None``."""
        try:
            info = json.loads((self.out_dir / f"pid_rank{rank}.json").read_text())
        except (FileNotFoundError, ValueError):
            return None
        return (int(info["pid"]), int(info["restart"])) if alive(int(info["pid"])) else None

    def training_victim(self, rank: int) -> tuple[int, int] | None:
        """Like :meth:`victim`, but only once that worker's incarnation has completed a step
        (so a restart that hangs is seen as such, not hidden by the next kill)."""
        found = self.victim(rank)
        if found is None or not any(r.get("type") == "step" and r["inc"] == found[1] for r in self.records(0)):
            return None
        return found

    def anchor(self) -> float | None:
        return first_step_t(self.records(0))

    def wait(self, *, timeout_s: float, stall_s: float | None = None, poll_s: float = 0.05) -> int | None:
        assert self.popen is not None and self.t_launch is not None
        deadline = self.t_launch + timeout_s
        last_n, last_change = -1, time.time()
        while True:
            code = self.popen.poll()
            if code is not None:
                self.t_exit = time.time()
                return code
            now = time.time()
            if stall_s is not None:
                n = sum(1 for r in self.records(0) if r.get("type") == "step")
                if n != last_n:
                    last_n, last_change = n, now
                elif now - last_change > stall_s:
                    self.hung = True
                    break
            if now > deadline:
                self.timed_out = True
                break
            time.sleep(poll_s)
        self.kill()
        return None

    def kill(self) -> None:
        if self.popen is not None and self.popen.poll() is None:
            kill_tree(self.popen.pid)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=10)
        # workers left behind by a killed torchrun (they are its children; kill_tree got them)
        for rank in range(8):
            found = self.victim(rank)
            if found is not None:
                kill_tree(found[0], grace_s=1.0)

    def restarts(self) -> dict[str, Any]:
        """Restarts torchrun made (the worker scripts' ``launch`` records), and those whose
        workers never completed a step (the caller leaves out those it killed itself)."""
        launches = [r for rank in range(self.nproc) for r in self.records(rank) if r.get("type") == "launch"]
        incs = sorted({r["restart"] for r in launches})
        stepped = {r["inc"] for r in self.records(0) if r.get("type") == "step"}
        return {"restarts": max(incs, default=0), "incarnations": incs,
                "incarnations_without_a_step": [i for i in incs if i not in stepped]}
