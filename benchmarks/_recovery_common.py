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
import re
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
    ``victim(rank)`` returns ``(pid, incarnation)`` or ``(pid, incarnation, slot)`` of the
    rank's current worker, or ``None`` (``incarnation``: the dlrover round or the torchrun
    restart count; ``slot``: where its step records are, when not ``rank``). A failure due
    while no worker of that rank lives (between restarts) hits the next one that does, as
    soon as it exists. ``kills`` lists what was done: ``{"offset_s", "rank", "slot",
    "t_kill", "pid", "incarnation", "late_s"}``.
    """

    def __init__(self, schedule: list[dict[str, Any]], *, anchor: Callable[[], float | None],
                 victim: Callable[[int], tuple | None], poll_s: float = 0.02) -> None:
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
                    slot = found[2] if len(found) > 2 else fault["rank"]
                    self.kills.append({**fault, "slot": slot, "t_kill": t_kill, "pid": found[0], "incarnation": found[1],
                                       "late_s": round(t_kill - due, 3)})
                    break
                self._halt.wait(self._poll_s)
            if self._halt.is_set():
                return


# ----- what the sides logged -----------------------------------------------------------------


_PROGRESS_NAME = re.compile(r"progress_rank(\d+)(?:_r(\d+))?\.jsonl$")


def ours_files(log_dir: Path, round_worlds: dict[int, int] | None = None, *, full_world: int = 2) -> list[dict[str, Any]]:
    """Every progress record of a dlrover-core run, each annotated with where it comes from:
    ``slot`` (the rank the worker held when its round formed: ``progress_rank<slot>``),
    ``inc`` (the round), ``k`` (0, or the ``_r<k>`` of a replacement started in the round),
    ``gen`` and ``world`` (the live world's generation and size the record belongs to: 0 and
    the round's size until the file's first ``live`` record), ``order`` (the line number).

    ``round_worlds`` maps a round to its world size (the master's ``rendezvous_completed``
    events); a round missing from it has ``full_world``. A step record also gets ``start``:
    ``t - dt``, when the worker began the step (``dt`` runs from the previous report, save,
    restore or re-form)."""
    out = []
    for path in Path(log_dir).glob("node_*/round_*/progress_rank*.jsonl"):
        m = _PROGRESS_NAME.search(path.name)
        if m is None:
            continue
        slot, k, rnd = int(m.group(1)), int(m.group(2) or 0), int(path.parent.name.split("_")[1])
        gen, world = 0, (round_worlds or {}).get(rnd, full_world)
        for i, r in enumerate(read_jsonl(path)):
            if r.get("type") == "live":
                gen, world = int(r["generation"]), int(r["world_size"])
            rec = {**r, "slot": slot, "inc": rnd, "k": k, "gen": gen, "world": world, "order": i}
            if r.get("type") == "step":
                rec["start"] = float(r["t"]) - float(r["dt"])
            out.append(rec)
    return out


def ours_records(log_dir: Path, round_worlds: dict[int, int] | None = None) -> list[dict[str, Any]]:
    """Rank 0's records of a dlrover-core run, in order, each with ``inc``: the round.

    Rank 0 is whichever process held it at the step (step records carry ``rank``; the live
    world moves rank 0 between processes when it shrinks and grows back). Other records
    (``restore``, ``checkpoint``) come from the files of slot 0, the worker ranked 0 when its
    round formed. Order: by round, then by time; a record without ``t`` takes the time of the
    step before it in its file (a restore, at a file's start, comes before the round's steps)."""
    recs = []
    for path_recs in _by_file(ours_files(log_dir, round_worlds)):
        last_t = float("-inf")
        for r in path_recs:
            if r.get("type") == "step":
                last_t = float(r["t"])
                if int(r.get("rank", r["slot"])) != 0:
                    continue
            elif r["slot"] != 0:
                continue
            recs.append({**r, "_t": last_t})
    recs.sort(key=lambda r: (r["inc"], r["_t"], r["k"], r["order"]))
    return recs


def _by_file(records: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    files: dict[tuple, list[dict[str, Any]]] = {}
    for r in records:
        files.setdefault((r["inc"], r["slot"], r["k"]), []).append(r)
    return [sorted(v, key=lambda r: r["order"]) for v in files.values()]


def ours_step_events(log_dir: Path, round_worlds: dict[int, int] | None = None) -> list[dict[str, Any]]:
    """Every step any worker of a dlrover-core run completed: ``{"t", "start", "step",
    "slot", "inc", "world"}`` with ``inc`` = ``(round, k)`` (a later one: a newer process in
    the slot), by time."""
    ev = [{"t": float(r["t"]), "start": r["start"], "step": int(r["step"]), "slot": r["slot"],
           "inc": (r["inc"], r["k"]), "world": r["world"], "gen": (r["inc"], r["gen"])}
          for r in ours_files(log_dir, round_worlds) if r.get("type") == "step"]
    return sorted(ev, key=lambda e: e["t"])


def torchrun_records(out_dir: Path, rank: int = 0) -> list[dict[str, Any]]:
    """Records of ``rank`` in a torchrun run, in order, each with ``inc``: its restart count."""
    out = []
    restart = 0
    for r in read_jsonl(Path(out_dir) / f"rank{rank}.jsonl"):
        restart = r.get("restart", restart)
        out.append({**r, "inc": restart})
    return out


def peer_step_events(out_dir: Path, ranks: int, *, torchft: bool = False) -> list[dict[str, Any]]:
    """Every step the workers of a torchrun (or TorchFT) run completed, as
    :func:`ours_step_events` gives them (``inc``: the worker's restart count; ``world``: the
    participants of a TorchFT step, the full world for torchrun). TorchFT steps that were not
    committed (a peer failed during them) are left out."""
    ev = []
    for rank in range(ranks):
        for r in torchrun_records(out_dir, rank):
            if r.get("type") != "step" or (torchft and not r.get("committed")):
                continue
            ev.append({"t": float(r["t"]), "start": float(r.get("t_start", float(r["t"]) - float(r["dt"]))),
                       "step": int(r["step"]), "slot": rank, "inc": int(r["inc"]),
                       "world": int(r["participants"]) if torchft else ranks, "gen": None})
    return sorted(ev, key=lambda e: e["t"])


def first_step_t(records: list[dict[str, Any]]) -> float | None:
    return next((r["t"] for r in records if r.get("type") == "step"), None)


def lineage(records: list[dict[str, Any]]) -> dict[str, float]:
    """Productive time of the steps the final model builds on, from one rank's records in
    order: a ``restore`` of step c drops the steps after c computed before it (their time is
    ``recomputed_s``, their number ``recomputed_steps``); each step counts once, with its last
    execution's ``dt``."""
    kept: dict[int, float] = {}
    recomputed, recomputed_steps = 0.0, 0
    for r in records:
        if r.get("type") == "restore":
            for s in [s for s in kept if s > r["step"]]:
                recomputed += kept.pop(s)
                recomputed_steps += 1
        elif r.get("type") == "fresh":
            recomputed += sum(kept.values())
            recomputed_steps += len(kept)
            kept.clear()
        elif r.get("type") == "step":
            s = int(r["step"])
            if s in kept:  # computed again without a restore record (TorchFT after a restart from disk)
                recomputed += kept.pop(s)
                recomputed_steps += 1
            kept[s] = float(r["dt"])
    return {"productive_s": sum(kept.values()), "recomputed_s": recomputed, "recomputed_steps": recomputed_steps,
            "steps": len(kept), "last_step": max(kept, default=-1)}


def kill_samples(kills: list[dict[str, Any]], events: list[dict[str, Any]], *, full_world: int) -> list[dict[str, Any]]:
    """What followed each kill, from every worker's step events (:func:`ours_step_events`,
    :func:`peer_step_events`), in seconds from the SIGKILL:

    * ``survivor_step_s``: the first step a worker that was alive before the kill (another
      slot, the same process) began after it and completed — the live world going on
      without the dead one (torchrun has none: every worker restarts);
    * ``next_step_s``: the first step completed by a worker that had not completed one
      before the kill — the killed worker's replacement (torchrun's restarted workers,
      dlrover-core's replacement, in the slot or on a relaunched node, TorchFT's restarted
      replica group);
    * ``full_world_s``: the first such step at the full world size (with the replacement in).

    ``uninterrupted`` (per measure): it came before the next kill (a recovery another kill
    cut short measures nothing); ``during_recovery``: the previous kill's replacement had not
    completed a step yet."""
    out = []
    prev_next: float | None = None
    for i, k in enumerate(kills):
        t, slot = k["t_kill"], k.get("slot", k["rank"])
        before = [e for e in events if e["t"] < t]
        stepped = {(e["slot"], e["inc"]) for e in before}
        latest = {}
        for e in before:
            if e["slot"] != slot:
                latest[e["slot"]] = max(latest.get(e["slot"], e["inc"]), e["inc"])
        after = [e for e in events if e["t"] > t]
        surv = next((e for e in after if e["slot"] != slot and latest.get(e["slot"]) == e["inc"] and e["start"] > t), None)
        newer = [e for e in after if (e["slot"], e["inc"]) not in stepped]
        nxt = newer[0] if newer else None
        full = next((e for e in newer if e["world"] >= full_world), None)
        later = kills[i + 1]["t_kill"] if i + 1 < len(kills) else None
        row: dict[str, Any] = {"t_kill": t, "rank": k["rank"], "slot": slot, "incarnation": k["incarnation"],
                               "during_recovery": i > 0 and (prev_next is None or prev_next > t)}
        for name, e in (("survivor_step", surv), ("next_step", nxt), ("full_world", full)):
            row[f"{name}_s"] = None if e is None else e["t"] - t
            row[f"{name}_uninterrupted"] = e is not None and (later is None or e["t"] < later)
        row["uninterrupted"] = row["next_step_uninterrupted"]
        out.append(row)
        prev_next = None if nxt is None else nxt["t"]
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


class _PeerSide:
    """What the torchrun and TorchFT sides share: their scripts write step records and each
    rank's ``pid_rank<r>.json`` (its pid and restart count) into ``out_dir``."""

    out_dir: Path

    def records(self, rank: int = 0) -> list[dict[str, Any]]:
        return torchrun_records(self.out_dir, rank)

    def victim(self, rank: int) -> tuple[int, int] | None:
        """``(pid, restart)`` of ``rank``'s current process (worker, replica group), or ``None``."""
        try:
            info = json.loads((self.out_dir / f"pid_rank{rank}.json").read_text())
        except (FileNotFoundError, ValueError):
            return None
        return (int(info["pid"]), int(info["restart"])) if alive(int(info["pid"])) else None


class TorchrunSide(_PeerSide):
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


# ----- the TorchFT side ----------------------------------------------------------------------

TORCHFT_SCRIPT = HERE / "_recovery_torchft_train.py"

#: the lighthouse as torchft's README and examples start it
TORCHFT_LIGHTHOUSE_ARGS = ("--min_replicas", "1", "--quorum_tick_ms", "100", "--join_timeout_ms", "10000")


def torchft_unavailable() -> str | None:
    """Why TorchFT cannot run here (the error text), or ``None``."""
    lighthouse = Path(sys.executable).with_name("torchft_lighthouse")
    try:
        probe = subprocess.run([sys.executable, "-c", "import torch, torchft; print(torchft.__file__)"],
                               capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"python -c 'import torchft': {exc}"
    if probe.returncode != 0:
        return f"import torchft failed: {probe.stderr.strip()[-1500:]}"
    if not lighthouse.exists():
        return f"torchft is importable but {lighthouse} is missing"
    return None


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TorchftSide(_PeerSide):
    """TorchFT, DDP across ``groups`` replica groups of one process each, in ``work``.

    Starts ``torchft_lighthouse`` (``TORCHFT_LIGHTHOUSE_ARGS``), hosts each group's
    ``TCPStore`` in this process (what torchrun's agent does for a group under torchft's own
    launcher) and runs a supervisor thread per group that starts
    ``_recovery_torchft_train.py`` and starts it again, at once, whenever it exits with an
    error or a signal (TorchFT leaves restarting a dead replica to the scheduler). ``wait``
    and ``kill`` as :class:`TorchrunSide`'s.
    """

    def __init__(self, work: Path, *, steps: int, ckpt_every: int, groups: int = 2, max_restarts: int = 100,
                 seed: int = 0, lighthouse_args: tuple[str, ...] = TORCHFT_LIGHTHOUSE_ARGS) -> None:
        self.work = Path(work)
        self.out_dir = self.work / "out"
        self.ckpt_dir = self.work / "ckpt"
        self.groups, self.max_restarts = groups, max_restarts
        self.lighthouse_args = lighthouse_args
        self.script_args = ["--num-replica-groups", str(groups), "--steps", str(steps), "--ckpt-every", str(ckpt_every),
                            "--ckpt-dir", str(self.ckpt_dir), "--out-dir", str(self.out_dir), "--seed", str(seed)]
        self.lighthouse: subprocess.Popen | None = None
        self.lighthouse_addr: str | None = None
        self._stores: list[Any] = []
        self._procs: dict[int, subprocess.Popen] = {}
        self._threads: list[threading.Thread] = []
        self._halt = threading.Event()
        self._lock = threading.Lock()
        self.exits: list[dict[str, Any]] = []  # {"group", "restart", "code", "t"}
        self.done: set[int] = set()
        self.t_launch: float | None = None
        self.t_exit: float | None = None
        self.hung = False
        self.timed_out = False
        self.error: str | None = None

    def _spawn(self, argv: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
        shim = [sys.executable, "-S", "-c", _PDEATHSIG_EXEC, str(os.getpid())] if sys.platform == "linux" else []
        with open(log, "ab") as f:
            return subprocess.Popen([*shim, *argv], env=env, cwd=str(ROOT), stdin=subprocess.DEVNULL, stdout=f,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    def launch(self) -> None:
        import torch.distributed as dist  # heavy: torch (the stores)

        self.work.mkdir(parents=True, exist_ok=True)
        self.t_launch = time.time()
        port = _free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "RUST_BACKTRACE": "1"}
        self.lighthouse = self._spawn([str(Path(sys.executable).with_name("torchft_lighthouse")), *self.lighthouse_args,
                                       "--bind", f"127.0.0.1:{port}"], self.work / "lighthouse.log", env)
        self.lighthouse_addr = f"http://127.0.0.1:{port}"
        self._stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
                        for _ in range(self.groups)]
        env["TORCHFT_LIGHTHOUSE"] = self.lighthouse_addr
        for g in range(self.groups):
            t = threading.Thread(target=self._supervise, args=(g, env), name=f"torchft-group-{g}", daemon=True)
            t.start()
            self._threads.append(t)

    def _supervise(self, g: int, env: dict[str, str]) -> None:
        argv = [sys.executable, str(TORCHFT_SCRIPT), "--replica-group", str(g), "--store-port", str(self._stores[g].port),
                *self.script_args]
        restart = 0
        while not self._halt.is_set():
            with self._lock:
                if self._halt.is_set():
                    return
                proc = self._procs[g] = self._spawn(argv, self.work / f"group{g}.log", {**env, "RECOVERY_RESTART": str(restart)})
            code = proc.wait()
            self.exits.append({"group": g, "restart": restart, "code": code, "t": time.time()})
            if code == 0:
                self.done.add(g)
                return
            if self._halt.is_set() or self.done or restart >= self.max_restarts:
                return  # training is over (another group finished) or out of restarts
            restart += 1

    @property
    def pid(self) -> int:
        assert self.lighthouse is not None
        return self.lighthouse.pid


    def anchor(self) -> float | None:
        return next((r["t"] for r in self.records(0) if r.get("type") == "step" and r.get("committed")), None)

    def wait(self, *, timeout_s: float, stall_s: float | None = None, poll_s: float = 0.1) -> int | None:
        """0 when training finished (a group completed the last step; a group that died after
        that is not restarted), 1 when the supervisors gave up before, ``None`` on a timeout
        or a stall (then everything is killed)."""
        assert self.t_launch is not None
        deadline = self.t_launch + timeout_s
        last_n, last_change = -1, time.time()
        while True:
            if not any(t.is_alive() for t in self._threads):
                self.t_exit = max((e["t"] for e in self.exits), default=time.time())
                return 0 if self.done else 1
            if self.lighthouse is not None and self.lighthouse.poll() is not None and not self.error:
                self.error = f"torchft_lighthouse exited with {self.lighthouse.returncode}"
            now = time.time()
            if stall_s is not None:
                n = sum(1 for g in range(self.groups) for r in self.records(g) if r.get("type") == "step")
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
        with self._lock:
            self._halt.set()
            procs = list(self._procs.values())
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid, grace_s=1.0)
        for rank in range(self.groups):
            found = self.victim(rank)
            if found is not None:
                kill_tree(found[0], grace_s=1.0)
        for t in self._threads:
            t.join(timeout=10)
        if self.lighthouse is not None and self.lighthouse.poll() is None:
            kill_tree(self.lighthouse.pid, grace_s=1.0)
        self._stores = []

    def log_tail(self, chars: int = 1500) -> str:
        """The end of each group's log and the lighthouse's (why a run failed)."""
        out = []
        for name in [*(f"group{g}.log" for g in range(self.groups)), "lighthouse.log"]:
            with contextlib.suppress(OSError):
                text = (self.work / name).read_text(errors="replace")
                out.append(f"--- {name}\n{text[-chars:]}")
        return "\n".join(out)
