"""Recovery benchmark: dlrover-core side by side with ``torchrun --max-restarts``, in one run.

    python benchmarks/recovery.py [--quick] [--json PATH] [--seed N] [--only a,b,c,d]

Both sides train the char LM of ``examples/charlm`` (same model, data, optimizer, LR schedule,
seeds) with 2 workers on this machine:

* dlrover-core: ``Job(nodes=Nodes(min=2, max=2, nproc_per_node=1), scheduler="local")``
  running ``examples/charlm/train.py`` (Flash Checkpoint: a memory snapshot every step,
  persisted every K steps);
* torchrun: ``torchrun --standalone --nnodes 1 --nproc-per-node 2 --max-restarts N`` running
  ``_recovery_torchrun_train.py`` (plain DDP, ``torch.save`` + fsync every K steps from rank
  0, ``torch.load`` on start, a per-restart ``PrefixStore`` against the gloo restart trap).
  One torchrun agent for both workers is torchrun's fastest way to restart (no rendezvous
  between agents): the baseline gets its best case.

Experiments (a, b, c, d; ``--only`` picks some):

a. **Failures at random, MTBF 180 s.** One seeded exponential schedule of SIGKILLs (offsets
   from each side's first training step, a random rank each) hits both sides; a failure due
   while that rank has no live worker (mid-restart) hits the next one as soon as it exists.
   Goodput is measured the same way on both: productive time — the ``dt`` of the steps the
   final model builds on, from rank 0's own records (dlrover-core's progress files; the
   torchrun script's log; ``dt`` excludes checkpoint saves and restores on both) — over wall
   time from launch to the job's end. dlrover-core's ``JobResult.goodput`` is shown too.
   dlrover-core runs with ``Failure(max_restarts=100)`` and otherwise default settings (warm
   standbys on; ``max_node_failures=3``: a node whose workers were SIGKILLed 3 times is
   excluded and replaced, and its replacement restores from storage, not memory).
   Kill to next step: seconds from a SIGKILL to the first step completed by the restarted
   workers, median over the uninterrupted kills (the next step came before the next kill) of
   these runs and of a'.
a'. (full run only) 4 SIGKILLs 25 s apart on each side, for more kill-to-next-step samples.
e. (full run only) The gloo restart trap: torchrun with the script's ``--store plain``
   (``init_method="env://"``, as most scripts are written), 4 SIGKILLs at least 15 s apart,
   each once the current workers have trained a step, a 60 s collective timeout and 12
   restarts allowed: how many restarts fail or hang.
b. **Kill to state restored, 1 GiB.** A 2-node dlrover-core job of
   ``_recovery_worker.py`` whose state is the char LM plus extra buffers, 1 GiB per
   rank, saved with the Checkpointer every step to memory; a worker is SIGKILLed
   (repeatedly) and the replacement logs the wall time ``Checkpointer.load`` returned.
c. **Hang detection.** SIGSTOP rank 1. dlrover-core with ``Failure(hang_timeout_s=H)`` set
   explicitly (derived, it would be max(60 s, 20 x the median step time) = 60 s here): SIGSTOP
   to the master's ``worker_failed`` event of kind ``hang``. torchrun with its defaults (gloo's
   30-minute collective timeout; the agent itself only watches for exits): SIGSTOP to a worker
   exit or a restart, capped at ``--torchrun-hang-cap-s``; if it never notices, the cap is a
   lower bound and the ratio an upper bound. The capped torchrun run is started first and sits
   idle (one worker stopped, the other blocked in gloo) while the other experiments run, both
   sides of a included; the CPU time it uses meanwhile is reported (about 1 s in 2 minutes).
d. **Re-rendezvous 2 → 1 → 2.** ``Nodes(min=1, max=2)``, the char LM in
   ``_recovery_worker.py`` (``examples/charlm/train.py`` checkpoints the DDP-wrapped model,
   whose keys do not load at world size 1): SIGKILL node 1's agent. Seconds from
   the kill to the first step of the 1-node round, and from the replacement agent's join (the
   master's ``membership_changed`` event minus ``Nodes.last_call_s``, the master's scale-up
   rule) to the first step of the 2-node round. The master declares the killed node lost after
   ``Failure(heartbeat_timeout_s=...)`` (10 s here; default 30 s) and relaunches it.

**Young/Daly.** Young (1974), "A first order approximation to the optimum checkpoint
interval", CACM 17(9):530-531, and Daly (2006), "A higher order estimate of the optimum
checkpoint interval for restart dumps", FGCS 22(3):303-312: with checkpoint cost C, mean time
between failures M and restart cost R, the waste per unit time at interval tau is about
C/tau + tau/(2M) + R/M, minimal at Young's tau = sqrt(2 C M), where the expected goodput is

    G_YD = 1 - sqrt(2 C / M) - R / M.

We use exactly that (first order; Daly's higher-order terms move tau by a few percent at most at
these C and M). C: the
mean training stall of one checkpoint save in run a (dlrover-core: a memory snapshot, taken
every step; persists run in the agent, in the background). M: wall time of run a over the
failures injected in it (the realized MTBF; the nominal one is shown too). R: median kill to
next step minus the median step time. ``goodput_gap_to_young_daly_pts`` = 100 (G_YD -
``JobResult.goodput`` of run a); the JSON also has the gap for the same-definition goodput and
without the job's first start, which the formula does not model.

Run a lasts 3000 steps (about 10 minutes of training here, some 3 to 4 MTBFs); ``--quick``
scales its length and MTBF down by 12 (250 steps, MTBF 15 s), skips a' and e, does 2 kills in
b instead of 5 and caps torchrun's hang at 120 s instead of 300 s; it takes about 4.5 minutes
here. The full run takes an estimated 35 minutes (not timed end to end: about 11 minutes per
side for a, 5 for a', 3 for e, 6 for b-d).

The machine is shared: other processes' load changes step times by tens of percent between
runs, so each side's load average is recorded. Nothing here is a pass/fail test; goals not met
are reported as missed, with the reason.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import attrs
import psutil
from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _recovery_common import (  # noqa: E402
    CHARLM,
    EventTail,
    FaultInjector,
    TorchrunSide,
    alive,
    fault_schedule,
    first_step_t,
    kill_to_next_step,
    kill_tree,
    lineage,
    median,
    ours_records,
    processes_with_env,
    read_jsonl,
    torchrun_breakdown,
    tree_cpu_s,
)

from dlrover_core import Checkpoint, Failure, Job, Nodes  # noqa: E402
from dlrover_core.errors import DLRoverError  # noqa: E402

#: ratio key -> (goal, "<=" or ">=")
GOALS: dict[str, tuple[float, str]] = {
    "kill_to_next_step_vs_torchrun": (0.33, "<="),
    "kill_to_state_restored_s": (0.8, "<="),
    "goodput_vs_torchrun_mtbf180": (1.15, ">="),
    "goodput_gap_to_young_daly_pts": (2.0, "<="),
    "hang_detect_vs_torchrun": (0.1, "<="),
    "rerendezvous_2_1_2_s": (2.0, "<= 2 + restore"),
}

MODES = {
    "quick": {"steps": 250, "mtbf_s": 15.0, "scale": 1 / 12, "ckpt_every": 25, "kill_series": 0, "plain_store_kills": 0, "restore_kills": 2,
              "hang_timeout_s": 10.0, "torchrun_hang_cap_s": 120.0, "heartbeat_timeout_s": 10.0,
              "side_timeout_s": 360.0},
    "full": {"steps": 3000, "mtbf_s": 180.0, "scale": 1.0, "ckpt_every": 25, "kill_series": 4, "plain_store_kills": 4, "restore_kills": 5,
             "hang_timeout_s": 10.0, "torchrun_hang_cap_s": 300.0, "heartbeat_timeout_s": 10.0,
             "side_timeout_s": 1800.0},
}

#: a': SIGKILLs this far apart (seconds from the first step), this many steps per kill
SERIES_GAP_S = 25.0
SERIES_STEPS_PER_KILL = 100
STATE_MIB = 1024
INJECT_AT_STEP = 10

console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
_JOB_IDS: set[str] = set()
_TORCHRUNS: list[TorchrunSide] = []


def say(msg: str) -> None:
    console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {msg}")


def _r(v: float | None, nd: int = 3) -> float | None:
    return None if v is None else round(v, nd)


def _submit(job: Job) -> Any:
    run = job.submit()
    _JOB_IDS.add(run.job_id)
    return run


class _Waiter(threading.Thread):
    """``JobRun.wait()`` in a thread: it supervises the job (restarts a master that died) and
    returns once the job has a result, e.g. after our ``run.cancel()``."""

    def __init__(self, run: Any, timeout_s: float) -> None:
        super().__init__(name="recovery-wait", daemon=True)
        self.job_run, self.timeout_s = run, timeout_s
        self.result: Any = None
        self.error: str | None = None
        self.start()

    def run(self) -> None:
        try:
            self.result = self.job_run.wait(progress=False, timeout_s=self.timeout_s)
        except Exception as exc:  # TimeoutError (the job was cancelled), SchedulerError
            self.error = f"{type(exc).__name__}: {exc}"

    def finish(self, *, cancel: bool, timeout_s: float = 120.0) -> Any:
        if cancel:
            with contextlib.suppress(Exception):
                self.job_run.cancel()
        self.join(timeout=timeout_s)
        if self.error:
            say(f"[yellow]job {self.job_run.job_id}: {self.error}[/yellow]")
        return self.result


def _ours_victim(run: Any):
    def victim(rank: int) -> tuple[int, int] | None:
        s = run.status()
        pid = s.worker_pids.get(rank)
        return (pid, s.round) if pid and not s.state.is_terminal else None

    return victim


def _wait_until(pred, timeout_s: float, poll_s: float = 0.05) -> bool:
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        with contextlib.suppress(Exception):
            if pred():
                return True
        time.sleep(poll_s)
    return False


def _failure_dict(f: Failure) -> dict[str, Any]:
    return attrs.asdict(f)


# ----- a: failures at random ---------------------------------------------------------------------


def _side_summary(name: str, records: list[dict], kills: list[dict], t_launch: float, t_end: float | None,
                  state: str, breakdown) -> dict[str, Any]:
    lin = lineage(records)
    wall = (t_end or time.time()) - t_launch
    stalls = [r["stall_s"] for r in records if r.get("type") in ("checkpoint", "save")]
    dts = [r["dt"] for r in records if r.get("type") == "step"]
    restores = [r for r in records if r.get("type") == "restore"]
    samples = kill_to_next_step(kills, records)
    for sample, kill in zip(samples, kills, strict=True):
        sample["breakdown_s"] = {k: _r(v, 2) for k, v in breakdown(kill).items()}
    good = [s["next_step_s"] for s in samples if s["uninterrupted"]]
    first = first_step_t(records)
    return {
        "side": name, "state": state, "wall_s": _r(wall), "productive_s": _r(lin["productive_s"]),
        "goodput": _r(lin["productive_s"] / wall, 4) if wall > 0 else None,
        "launch_to_first_step_s": _r(first - t_launch) if first else None,
        "recomputed_s": _r(lin["recomputed_s"]), "steps_kept": lin["steps"], "last_step": lin["last_step"],
        "step_dt_median_s": _r(median(dts), 4), "steps_executed": len(dts),
        "checkpoint_saves": len(stalls), "checkpoint_cost_mean_s": _r(sum(stalls) / len(stalls), 5) if stalls else None,
        "checkpoint_stall_total_s": _r(sum(stalls)),
        "restores": [{"step": r["step"], "load_s": r.get("load_s"), "source": r.get("source", "torch.load")}
                     for r in restores],
        "kills": kills, "kill_to_next_step": samples,
        "kill_to_next_step_median_s": _r(median(good)), "uninterrupted_kills": len(good),
    }


def _ours_breakdown(tail: EventTail, records: list[dict]):
    """Where a dlrover-core restart's time went (seconds from the kill): the failure reported
    to the master, the next round formed, the checkpoint restored (the first step's start:
    ``train.report`` times a step from the end of the restore), the first step."""

    def breakdown(kill: dict) -> dict[str, float | None]:
        t, inc = kill["t_kill"], kill["incarnation"]
        fail = next((e for e in tail.find("worker_failed") if e.get("round") == inc and tail.wall(e) > t - 0.05), None)
        rdv = next((e for e in tail.find("rendezvous_completed") if e["round"] > inc), None)
        step = next((r for r in records if r.get("type") == "step" and r["inc"] > inc and r["t"] > t), None)
        return {"failure_reported": tail.wall(fail) - t if fail else None,
                "next_round": tail.wall(rdv) - t if rdv else None,
                "restored": step["t"] - step["dt"] - t if step else None,
                "first_step": step["t"] - t if step else None}

    return breakdown


def run_ours(cfg: dict, schedule: list[dict], work: Path, *, steps: int, tag: str) -> dict[str, Any]:
    """dlrover-core on ``examples/charlm/train.py`` with ``schedule`` of SIGKILLs."""
    failure = Failure(max_restarts=100)
    job = Job(
        name=f"recovery-{tag}", entrypoint=str(CHARLM / "train.py"), args=["--steps", str(steps), "--seed", "0"],
        nodes=Nodes(min=2, max=2, nproc_per_node=1), accelerator="cpu", scheduler="local",
        checkpoint=Checkpoint(dir=str(work / f"ours-{tag}-ckpt"), persist_every_steps=cfg["ckpt_every"], keep_last=2),
        failure=failure, log_dir=str(work / "runs"),
    )
    load0 = os.getloadavg()[0]
    t_launch = time.time()
    run = _submit(job)
    log_dir = Path(run.handle.log_dir)
    tail = EventTail(log_dir)
    inj = FaultInjector(schedule, anchor=lambda: first_step_t(ours_records(log_dir)), victim=_ours_victim(run))
    inj.start()
    result, error = None, None
    try:
        result = run.wait(progress=False, timeout_s=cfg["side_timeout_s"])
    except (TimeoutError, DLRoverError) as exc:
        error = str(exc)
    finally:
        inj.stop()
        tail.stop()
    fin = tail.find("job_finished")
    t_end = tail.wall(fin[-1]) if fin else None
    records = ours_records(log_dir)
    out = _side_summary("dlrover-core", records, inj.kills, t_launch, t_end,
                        result.state.value if result else f"FAILED: {error}", _ours_breakdown(tail, records))
    out.update(failure_config=_failure_dict(failure), log_dir=str(log_dir),
               load_average=[round(load0, 2), round(os.getloadavg()[0], 2)],
               nodes_excluded=[{"node_id": e.get("node_id"), "reason": e.get("reason")}
                               for e in tail.find("node_excluded")])
    if result is not None:
        out["job_result"] = {k: v for k, v in result.to_dict().items() if k not in ("failures", "metrics")}
        out["job_result"]["failures"] = len(result.failures)
        out["final_val_loss"] = result.metrics.get("final_val_loss")
    return out


def run_torchrun(cfg: dict, schedule: list[dict], work: Path, *, steps: int, tag: str, store: str = "prefix",
                 max_restarts: int = 100, pg_timeout_s: float = 300.0, only_training: bool = False) -> dict[str, Any]:
    """torchrun on ``_recovery_torchrun_train.py`` with ``schedule`` of SIGKILLs (with
    ``only_training``, a kill waits until the current workers have completed a step)."""
    side = TorchrunSide(work / f"torchrun-{tag}", steps=steps, ckpt_every=cfg["ckpt_every"], max_restarts=max_restarts,
                        pg_timeout_s=pg_timeout_s, store=store)
    _TORCHRUNS.append(side)
    load0 = os.getloadavg()[0]
    side.launch()
    inj = FaultInjector(schedule, anchor=side.anchor, victim=side.training_victim if only_training else side.victim)
    inj.start()
    try:
        code = side.wait(timeout_s=cfg["side_timeout_s"], stall_s=150.0)
    finally:
        inj.stop()
        side.kill()
    state = ("SUCCEEDED" if code == 0 else f"FAILED (exit code {code})" if code is not None
             else "HUNG (no step for 150 s)" if side.hung else "TIMED OUT")
    records = side.records(0)
    out = _side_summary("torchrun", records, inj.kills, side.t_launch, side.t_exit, state,
                        lambda kill: torchrun_breakdown(kill, records))
    restarts = side.restarts()
    killed = {k["incarnation"] for k in inj.kills}
    restarts["failed_or_hung"] = [i for i in restarts["incarnations_without_a_step"] if i not in killed and i > 0]
    restarts["hung"] = side.hung
    restarts["store"] = store
    out["torchrun_restarts"] = restarts
    out["exit_code"] = code
    out["load_average"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    last = [r for r in records if r.get("type") == "step"]
    out["final_loss"] = last[-1].get("loss") if last else None
    return out


# ----- b: kill to state restored (1 GiB) -------------------------------------------------------


def run_restore(cfg: dict, work: Path) -> dict[str, Any]:
    kills_n = cfg["restore_kills"]
    plan = [(5 + 5 * i, 1 - i % 2) for i in range(kills_n)]  # (at step, rank): rank 1, 0, 1, ...
    steps = plan[-1][0] + 4
    out_dir = work / "restore-out"
    failure = Failure(max_restarts=kills_n + 2)
    job = Job(
        name="recovery-restore", entrypoint=str(HERE / "_recovery_worker.py"),
        args=["--steps", str(steps), "--state-mib", str(STATE_MIB), "--out-dir", str(out_dir), "--synthetic-data"],
        nodes=Nodes(min=2, max=2, nproc_per_node=1), accelerator="cpu", scheduler="local",
        checkpoint=Checkpoint(dir=str(work / "restore-ckpt"), memory_every_steps=1, persist_every_steps=0, keep_last=1),
        failure=failure, log_dir=str(work / "runs"),
    )
    run = _submit(job)
    log_dir = Path(run.handle.log_dir)
    tail = EventTail(log_dir)
    kills = []
    deadline = time.time() + 240 + 40 * kills_n
    waiter = _Waiter(run, deadline - time.time())
    try:
        for i, (at_step, rank) in enumerate(plan):
            while time.time() < deadline:
                s = run.status()
                if s.state.is_terminal:
                    break
                pid = s.worker_pids.get(rank)
                if s.step >= at_step and s.restarts == i and pid and alive(pid):
                    t_kill = time.time()
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        continue
                    kills.append({"t_kill": t_kill, "rank": rank, "pid": pid, "round": s.round, "at_step": s.step})
                    break
                time.sleep(0.02)
    finally:
        result = waiter.finish(cancel=False, timeout_s=max(30.0, deadline - time.time() + 60))
        tail.stop()
    state = result.state.value if result is not None else f"FAILED: {waiter.error}"
    loads = {r: read_jsonl(out_dir / f"rank{r}.jsonl") for r in (0, 1)}
    samples = []
    for k in kills:
        row: dict[str, Any] = {"rank": k["rank"], "at_step": k["at_step"]}
        for r in (0, 1):
            rec = min((x for x in loads[r] if x["round"] > k["round"]), key=lambda x: x["round"], default=None)
            if rec is None:
                continue
            base = k["t_kill"]
            entry = {
                "kill_to_restored_s": _r(rec["t_load_end"] - base), "source": rec["source"], "step": rec["step"],
                "load_s": _r(rec["load_s"]), "breakdown_s": {
                    "kill_to_script_start": _r(rec["t_proc"] - base),
                    "imports": _r(rec["t_import"] - rec["t_proc"]),
                    "process_group": _r(rec["t_init"] - rec["t_import"]),
                    "corpus": _r(rec["t_data"] - rec["t_init"]),
                    "model_and_optimizer": _r(rec["t_model"] - rec["t_data"]),
                    "state_alloc": _r(rec["t_state"] - rec["t_model"]),
                    "load_call": _r(rec["t_load_end"] - rec["t_load_start"]),
                }}
            decided = tail.find("restore_decided", lambda e, rd=rec["round"]: e.get("round") == rd)
            if decided:  # the ranks agreed on the restore (the last one asked): waiting vs copying
                entry["breakdown_s"]["load_wait_for_peers"] = _r(max(0.0, tail.wall(decided[0]) - rec["t_load_start"]))
                entry["breakdown_s"]["load_after_agreement"] = _r(rec["t_load_end"] - max(tail.wall(decided[0]),
                                                                                          rec["t_load_start"]))
            fails = tail.find("worker_failed", lambda e, rd=k["round"]: e.get("round") == rd)
            if fails:
                entry["breakdown_s"]["kill_to_failure_event"] = _r(tail.wall(fails[0]) - base)
            rdv = tail.find("rendezvous_completed", lambda e, rd=k["round"]: e.get("round") == rd + 1)
            if rdv:
                entry["breakdown_s"]["kill_to_next_round"] = _r(tail.wall(rdv[0]) - base)
            own = sum(entry["breakdown_s"][x] or 0.0 for x in ("corpus", "model_and_optimizer", "state_alloc"))
            entry["without_script_setup_s"] = _r(entry["kill_to_restored_s"] - own)
            row["replacement" if r == k["rank"] else "other_rank"] = entry
        samples.append(row)
    bytes_saved = [r.get("bytes") for r in ours_records(log_dir) if r.get("type") == "checkpoint"]
    values = [s["replacement"]["kill_to_restored_s"] for s in samples if "replacement" in s]
    lean = [s["replacement"]["without_script_setup_s"] for s in samples if "replacement" in s]
    return {"state": state, "without_script_setup_median_s": _r(median(lean)), "state_bytes_per_rank": bytes_saved[-1] if bytes_saved else None,
            "failure_config": _failure_dict(failure), "kills": samples,
            "kill_to_state_restored_median_s": _r(median(values)), "log_dir": str(log_dir)}


# ----- c: hang detection -------------------------------------------------------------------------


def run_hang_ours(cfg: dict, work: Path) -> dict[str, Any]:
    failure = Failure(max_restarts=5, hang_timeout_s=cfg["hang_timeout_s"])
    job = Job(
        name="recovery-hang", entrypoint=str(CHARLM / "train.py"), args=["--steps", "2000", "--seed", "0"],
        nodes=Nodes(min=2, max=2, nproc_per_node=1), accelerator="cpu", scheduler="local",
        checkpoint=Checkpoint(dir=str(work / "hang-ckpt"), persist_every_steps=cfg["ckpt_every"], keep_last=2),
        failure=failure, log_dir=str(work / "runs"),
    )
    run = _submit(job)
    log_dir = Path(run.handle.log_dir)
    tail = EventTail(log_dir)
    waiter = _Waiter(run, 600)
    out: dict[str, Any] = {"hang_timeout_s": cfg["hang_timeout_s"], "hang_timeout_chosen": "explicit",
                           "failure_config": _failure_dict(failure), "log_dir": str(log_dir)}
    stopped: int | None = None
    try:
        got = {}

        def ready() -> bool:
            s = run.status()
            pid = s.worker_pids.get(1)
            if s.step >= INJECT_AT_STEP and pid and alive(pid):
                got.update(pid=pid, round=s.round)
                return True
            return False

        if not _wait_until(ready, 180):
            out["error"] = f"the job did not reach step {INJECT_AT_STEP}"
            return out
        stopped = got["pid"]
        t_stop = time.time()
        os.kill(stopped, signal.SIGSTOP)
        hang = lambda e: e.get("failure_kind") == "hang"  # noqa: E731
        if _wait_until(lambda: tail.find("worker_failed", hang), cfg["hang_timeout_s"] + 120):
            ev = tail.find("worker_failed", hang)[0]
            out["detect_s"] = _r(tail.wall(ev) - t_stop)
            out["detected_by"] = {k: ev.get(k) for k in ("node_id", "rank", "detail")}
        else:
            out["error"] = "no hang detected"
        recs = lambda: [r for r in ours_records(log_dir) if r.get("type") == "step" and r["inc"] > got["round"]]  # noqa: E731
        if _wait_until(lambda: len(recs()) >= 1, 120):
            out["stop_to_next_step_s"] = _r(recs()[0]["t"] - t_stop)
        out["other_failures"] = [{k: e.get(k) for k in ("rank", "failure_kind", "detail")}
                                 for e in tail.find("worker_failed") if not hang(e)]
    finally:
        waiter.finish(cancel=True)
        tail.stop()
        if stopped is not None and alive(stopped):
            out["stopped_worker_left_alive"] = True
            kill_tree(stopped, 1.0)
    return out


class TorchrunHang:
    """torchrun with its default collective timeout; SIGSTOP rank 1; watch (in a thread) for
    torchrun to notice — a worker exits, a restart starts, or torchrun exits — until the cap."""

    def __init__(self, cfg: dict, work: Path) -> None:
        self.cap_s = cfg["torchrun_hang_cap_s"]
        self.side = TorchrunSide(work / "torchrun-hang", steps=100_000, ckpt_every=cfg["ckpt_every"], max_restarts=3,
                                 pg_timeout_s=0)
        _TORCHRUNS.append(self.side)
        self.out: dict[str, Any] = {"collective_timeout": "torch default (gloo: 30 min)", "cap_s": self.cap_s}
        self.t_stop: float | None = None
        self._thread: threading.Thread | None = None
        self._done = threading.Event()

    def start(self) -> bool:
        side = self.side
        side.launch()
        ok = _wait_until(lambda: sum(r.get("type") == "step" for r in side.records(0)) >= INJECT_AT_STEP
                         and side.victim(1) is not None, 180)
        if not ok:
            self.out["error"] = "torchrun did not reach the step"
            side.kill()
            return False
        self.pids = {r: side.victim(r)[0] for r in (0, 1)}
        self.t_stop = time.time()
        os.kill(self.pids[1], signal.SIGSTOP)
        self.cpu_at_stop = tree_cpu_s(side.pid)
        self._thread = threading.Thread(target=self._watch, name="torchrun-hang", daemon=True)
        self._thread.start()
        return True

    def _watch(self) -> None:
        side = self.side
        while time.time() - self.t_stop < self.cap_s:
            why = None
            if side.popen.poll() is not None:
                why = "torchrun exited"
            elif not alive(self.pids[0]):
                why = "the blocked worker exited (collective timeout)"
            elif any(r.get("type") == "start" and r["restart"] > 0 for r in side.records(0)):
                why = "torchrun restarted the workers"
            if why:
                self.out.update(noticed=True, detect_s=_r(time.time() - self.t_stop), how=why)
                break
            time.sleep(0.2)
        else:
            self.out.update(noticed=False, detect_s_lower_bound=_r(time.time() - self.t_stop))
        self.out["cpu_s_while_hung"] = _r(tree_cpu_s(side.pid) - self.cpu_at_stop)
        self._done.set()

    def finish(self) -> dict[str, Any]:
        if self._thread is not None:
            self._thread.join()
        self.side.kill()
        return self.out


# ----- d: re-rendezvous 2 -> 1 -> 2 ----------------------------------------------------------------


def run_rerendezvous(cfg: dict, work: Path) -> dict[str, Any]:
    nodes = Nodes(min=1, max=2, nproc_per_node=1)
    failure = Failure(max_restarts=10, heartbeat_timeout_s=cfg["heartbeat_timeout_s"])
    job = Job(
        name="recovery-elastic", entrypoint=str(HERE / "_recovery_worker.py"),
        args=["--steps", "2000", "--out-dir", str(work / "elastic-out")],
        nodes=nodes, accelerator="cpu", scheduler="local",
        checkpoint=Checkpoint(dir=str(work / "elastic-ckpt"), persist_every_steps=cfg["ckpt_every"], keep_last=2),
        failure=failure, log_dir=str(work / "runs"),
    )
    run = _submit(job)
    log_dir = Path(run.handle.log_dir)
    tail = EventTail(log_dir)
    waiter = _Waiter(run, 600)
    out: dict[str, Any] = {"nodes": attrs.asdict(nodes), "failure_config": _failure_dict(failure), "log_dir": str(log_dir)}
    try:
        if not _wait_until(lambda: run.status().step >= INJECT_AT_STEP, 180):
            out["error"] = "the job did not reach the step"
            return out
        handle = json.loads((log_dir / "handle.json").read_text())
        agent = int(handle["agents"]["node-1"])
        last_before = run.status().step
        t_kill = time.time()
        os.kill(agent, signal.SIGKILL)
        out["killed_agent_pid"] = agent
        relaunched: dict[str, float] = {}
        after = lambda e: tail.wall(e) > t_kill  # noqa: E731

        def rounds(world: int) -> list[dict]:
            return tail.find("rendezvous_completed", lambda e: after(e) and e.get("world_size") == world)

        def steps_in(rnd: int) -> list[dict]:
            return [r for r in ours_records(log_dir) if r["inc"] == rnd]

        def progressed() -> bool:
            with contextlib.suppress(FileNotFoundError, ValueError, psutil.NoSuchProcess):
                info = json.loads((log_dir / "handle.json").read_text())
                for name, pid in info.get("relaunched", {}).items():
                    relaunched.setdefault(name, psutil.Process(int(pid)).create_time())
            two = [e for e in rounds(2) if rounds(1) and e["round"] > rounds(1)[0]["round"]]
            return bool(two) and sum(r.get("type") == "step" for r in steps_in(two[0]["round"])) >= 1

        done = _wait_until(progressed, 120 + 2 * cfg["heartbeat_timeout_s"], poll_s=0.1)
        r1 = rounds(1)
        if r1:
            rnd = r1[0]["round"]
            recs = steps_in(rnd)
            step1 = next((r for r in recs if r.get("type") == "step"), None)
            restore1 = next((r for r in recs if r.get("type") == "restore"), None)
            fails = tail.find("worker_failed", after)
            out["down_2_to_1"] = {
                "kill_to_first_1node_step_s": _r(step1["t"] - t_kill) if step1 else None,
                "note": None if step1 else "the replacement joined before the 1-node round completed a step",
                "kill_to_failure_event_s": _r(tail.wall(fails[0]) - t_kill) if fails else None,
                "kill_to_1node_round_s": _r(tail.wall(r1[0]) - t_kill),
                "restore": restore1, "last_step_before_kill": last_before,
            }
        two = [e for e in rounds(2) if r1 and e["round"] > r1[0]["round"]]
        scale = tail.find("membership_changed", after)
        lost = tail.find("node_relaunched", after)
        if two and scale:
            rnd = two[0]["round"]
            recs = steps_in(rnd)
            step2 = next((r for r in recs if r.get("type") == "step"), None)
            restore2 = next((r for r in recs if r.get("type") == "restore"), None)
            t_join = tail.wall(scale[0]) - nodes.last_call_s
            t_agent = min(relaunched.values()) if relaunched else None
            one = [r["step"] for r in steps_in(r1[0]["round"]) if r.get("type") == "step"] if r1 else []
            out["up_1_to_2"] = {
                "last_1node_step": max(one, default=None),
                "join_to_first_2node_step_s": _r(step2["t"] - t_join) if step2 else None,
                "agent_start_to_first_2node_step_s": _r(step2["t"] - t_agent) if step2 and t_agent else None,
                "scale_up_decision_to_first_2node_step_s": _r(step2["t"] - tail.wall(scale[0])) if step2 else None,
                "kill_to_node_declared_lost_s": _r(tail.wall(lost[0]) - t_kill) if lost else None,
                "kill_to_first_2node_step_s": _r(step2["t"] - t_kill) if step2 else None,
                "restore": restore2,
            }
        if not done:
            out["error"] = "the job did not get back to 2 nodes in time"
    finally:
        waiter.finish(cancel=True)
        tail.stop()
    return out


# ----- ratios, table, main ------------------------------------------------------------------------


def young_daly(c_s: float, m_s: float, r_s: float) -> dict[str, float]:
    """Young's optimal interval and the expected goodput there (see the module docstring)."""
    return {"C_s": c_s, "M_s": m_s, "R_s": r_s, "tau_opt_s": math.sqrt(2 * c_s * m_s),
            "goodput": 1 - math.sqrt(2 * c_s / m_s) - r_s / m_s}


SIDES = ("dlrover-core", "torchrun")


def _samples(a: dict[str, Any], side: str) -> list[dict[str, Any]]:
    """Uninterrupted kill → next step samples of ``side`` from every run of experiment a."""
    out = []
    for run in ("mtbf", "series"):
        for x in (a.get(run) or {}).get(side, {}).get("kill_to_next_step", []):
            if x["uninterrupted"]:
                out.append({**x, "run": run})
    return out


def compute(res: dict[str, Any], cfg: dict) -> tuple[dict[str, Any], dict[str, str]]:
    """``(ratios, goals)``; fills ``res["a"]["pooled"]`` and ``res["a"]["young_daly"]``."""
    ratios: dict[str, Any] = {}
    goals = {k: (f"{op} {g:g}" if op in ("<=", ">=") else op) for k, (g, op) in GOALS.items()}
    a = res.get("a")
    if a:
        pooled = {}
        for side in SIDES:
            samples = _samples(a, side)
            keys = samples[0]["breakdown_s"].keys() if samples else ()
            pooled[side] = {
                "kill_to_next_step_median_s": _r(median([x["next_step_s"] for x in samples])), "samples": len(samples),
                "breakdown_median_s": {k: _r(median([x["breakdown_s"][k] for x in samples
                                                     if x["breakdown_s"].get(k) is not None]), 2) for k in keys},
            }
        a["pooled"] = pooled
        o, t = (pooled[x]["kill_to_next_step_median_s"] for x in SIDES)
        ratios["kill_to_next_step_vs_torchrun"] = _r(o / t) if o and t else None
        ours, tr = a["mtbf"]["dlrover-core"], a["mtbf"]["torchrun"]
        og, tg = ours["goodput"], tr["goodput"]
        ratios["goodput_vs_torchrun_mtbf180"] = _r(og / tg) if og and tg else None
        ratios["time_to_finish_vs_torchrun"] = _r(ours["wall_s"] / tr["wall_s"]) if ours["wall_s"] and tr["wall_s"] else None
        yd = {}
        for side in SIDES:
            run = a["mtbf"][side]
            n, c, k = len(run["kills"]), run["checkpoint_cost_mean_s"], pooled[side]["kill_to_next_step_median_s"]
            if c is None or k is None:
                continue
            r = max(0.0, k - (run["step_dt_median_s"] or 0.0))
            m = run["wall_s"] / n if n else cfg["mtbf_s"]
            yd[side] = {"realized_M": young_daly(c, m, r), "nominal_M": young_daly(c, cfg["mtbf_s"], r),
                        "kills": n}
        a["young_daly"] = yd
        jr = (ours.get("job_result") or {}).get("goodput")
        if "dlrover-core" in yd and jr is not None:
            expected = yd["dlrover-core"]["realized_M"]["goodput"]
            ratios["goodput_gap_to_young_daly_pts"] = _r(100 * (expected - jr), 2)
            a["young_daly_gap_variants_pts"] = {
                "jobresult_goodput": _r(100 * (expected - jr), 2),
                "same_definition_goodput": _r(100 * (expected - og), 2) if og is not None else None,
                "excluding_first_start": _r(100 * (expected - ours["productive_s"] / (ours["wall_s"] - ours["launch_to_first_step_s"])), 2)
                if ours.get("launch_to_first_step_s") else None,
                "nominal_M": _r(100 * (yd["dlrover-core"]["nominal_M"]["goodput"] - jr), 2),
            }
    b = res.get("b")
    if b:
        ratios["kill_to_state_restored_s"] = b["kill_to_state_restored_median_s"]
    c = res.get("c")
    if c:
        ours, tr = c["dlrover-core"], c["torchrun"]
        o = ours.get("detect_s")
        t = tr.get("detect_s") or tr.get("detect_s_lower_bound")
        ratios["hang_detect_vs_torchrun"] = _r(o / t, 4) if o and t else None
        if o and tr.get("noticed") is False:
            ratios["hang_detect_vs_torchrun_is_upper_bound"] = True
            ratios["hang_detect_vs_torchrun_at_documented_default"] = _r(o / 1800.0, 4)
    d = res.get("d")
    if d and "down_2_to_1" in d:
        down = d["down_2_to_1"]["kill_to_first_1node_step_s"]
        up = (d.get("up_1_to_2") or {}).get("join_to_first_2node_step_s")
        ratios["rerendezvous_2_to_1_s"] = down
        ratios["rerendezvous_1_to_2_s"] = up
        restore = max((x["restore"]["load_s"] for x in (d["down_2_to_1"], d.get("up_1_to_2") or {}) if x.get("restore")),
                      default=0.0)
        ratios["rerendezvous_2_1_2_s"] = max(down, up) if down is not None and up is not None else None
        ratios["rerendezvous_goal_s"] = _r(2 + restore)
        goals["rerendezvous_2_1_2_s"] = f"<= {2 + restore:.2f} (2 + restore {restore:.2f}), each transition"
    return ratios, goals


def met(key: str, value: Any, ratios: dict[str, Any]) -> bool | None:
    if value is None:
        return None
    goal, op = GOALS[key]
    if key == "rerendezvous_2_1_2_s":
        return value <= ratios.get("rerendezvous_goal_s", goal)
    return value >= goal if op == ">=" else value <= goal


def _s(v: Any, nd: int = 3) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def _each(samples: list[dict]) -> str:
    """Kill → next step of each kill; * interrupted by the next kill, (r) a kill during a recovery."""
    return ", ".join(_s(x["next_step_s"], 2) + ("" if x["uninterrupted"] else "*") + ("(r)" if x["during_recovery"] else "")
                     for x in samples)


def tables(res: dict[str, Any], ratios: dict[str, Any], goals: dict[str, str], reasons: dict[str, str],
           cfg: dict) -> list[Table]:
    t = Table(title="Recovery, raw numbers (seconds unless noted)", title_justify="left")
    t.add_column("what")
    t.add_column("dlrover-core", justify="right")
    t.add_column("torchrun", justify="right")
    a = res.get("a")
    if a:
        o, tr = a["mtbf"]["dlrover-core"], a["mtbf"]["torchrun"]
        t.add_row(f"[b]a. SIGKILLs at random, MTBF {cfg['mtbf_s']:g} s, {cfg['steps']} steps, checkpoint every "
                  f"{cfg['ckpt_every']} steps[/b]", "", "")
        rows: list[tuple[str, Any, Any]] = [
            ("  outcome", o["state"], tr["state"]),
            ("  kills injected (uninterrupted)", f"{len(o['kills'])} ({o['uninterrupted_kills']})",
             f"{len(tr['kills'])} ({tr['uninterrupted_kills']})"),
            ("  kill → next step, each (* interrupted, (r) during a recovery)", _each(o["kill_to_next_step"]),
             _each(tr["kill_to_next_step"])),
            ("  launch → first step", o["launch_to_first_step_s"], tr["launch_to_first_step_s"]),
            ("  wall, launch → end (same work)", o["wall_s"], tr["wall_s"]),
            ("  productive (steps in the final model)", o["productive_s"], tr["productive_s"]),
            ("  goodput (same definition both sides)", _s(o["goodput"], 4), _s(tr["goodput"], 4)),
            ("  goodput, JobResult", _s((o.get("job_result") or {}).get("goodput"), 4), ""),
            ("  recomputed", o["recomputed_s"], tr["recomputed_s"]),
            ("  step time, median", _s(o["step_dt_median_s"], 4), _s(tr["step_dt_median_s"], 4)),
            ("  checkpoint cost C (mean stall per save)", _s(o["checkpoint_cost_mean_s"], 5),
             _s(tr["checkpoint_cost_mean_s"], 5)),
            ("  saves (memory, every step | torch.save, every K)", o["checkpoint_saves"], tr["checkpoint_saves"]),
            ("  restores (source: count)", ", ".join(f"{k}: {v}" for k, v in _count(o["restores"]).items()) or "—",
             ", ".join(f"{k}: {v}" for k, v in _count(tr["restores"]).items()) or "—"),
            ("  failed or hung torchrun restarts", "",
             f"{len(tr['torchrun_restarts']['failed_or_hung'])} of {tr['torchrun_restarts']['restarts']}"
             + (" (hung)" if tr["torchrun_restarts"]["hung"] else "")),
            ("  nodes excluded (Failure.max_node_failures) and replaced", len(o.get("nodes_excluded", [])), ""),
            ("  load average (1 min) at start, end", ", ".join(map(str, o["load_average"])),
             ", ".join(map(str, tr["load_average"]))),
        ]
        series = a.get("series")
        if series:
            so, st = series["dlrover-core"], series["torchrun"]
            rows += [
                (f"[b]a'. {len(a['series_schedule'])} SIGKILLs, one every {SERIES_GAP_S:g} s[/b]", "", ""),
                ("  kill → next step, each", _each(so["kill_to_next_step"]), _each(st["kill_to_next_step"])),
                ("  failed or hung torchrun restarts", "",
                 f"{len(st['torchrun_restarts']['failed_or_hung'])} of {st['torchrun_restarts']['restarts']}"),
            ]
        po, pt = a["pooled"]["dlrover-core"], a["pooled"]["torchrun"]
        rows.append((f"[b]kill → next step, median of uninterrupted kills (n = {po['samples']} | {pt['samples']})[/b]",
                     po["kill_to_next_step_median_s"], pt["kill_to_next_step_median_s"]))
        bo, bt = po["breakdown_median_s"], pt["breakdown_median_s"]
        rows.append(("  ours: failure reported | next round | restored | first step",
                     " | ".join(_s(bo.get(k), 2) for k in ("failure_reported", "next_round", "restored", "first_step")), ""))
        rows.append(("  torchrun: new script | torch imported | group | restored | first step", "",
                     " | ".join(_s(bt.get(k), 2) for k in ("new_script_start", "torch_imported", "process_group",
                                                           "restored", "first_step"))))
        yd = a.get("young_daly") or {}
        if yd:
            yo, yt = (yd.get(x, {}).get("realized_M") for x in SIDES)
            rows.append(("  Young/Daly: C, M (realized), R, τ_opt",
                         f"{yo['C_s']:.4f}, {yo['M_s']:.0f}, {yo['R_s']:.2f}, {yo['tau_opt_s']:.2f}" if yo else "—",
                         f"{yt['C_s']:.4f}, {yt['M_s']:.0f}, {yt['R_s']:.2f}, {yt['tau_opt_s']:.2f}" if yt else "—"))
            rows.append(("  Young/Daly expected goodput (nominal M)",
                         f"{_s(yo['goodput'], 4)} ({_s(yd['dlrover-core']['nominal_M']['goodput'], 4)})" if yo else "—",
                         f"{_s(yt['goodput'], 4)} ({_s(yd['torchrun']['nominal_M']['goodput'], 4)})" if yt else "—"))
        for name, x, y in rows:
            t.add_row(name, _s(x), _s(y))
    e = res.get("e")
    if e:
        tr_e = e["torchrun_restarts"]
        t.add_row("[b]e. torchrun, init_method='env://' (no per-restart store prefix), SIGKILLs 15 s apart[/b]", "", "")
        t.add_row("  outcome", "", e["state"])
        t.add_row("  kills | restarts | restarts that failed or hung", "",
                  f"{len(e['kills'])} | {tr_e['restarts']} | {len(tr_e['failed_or_hung'])}")
        t.add_row("  kill → next step, each", "", _each(e["kill_to_next_step"]))
    b = res.get("b")
    if b:
        t.add_row(f"[b]b. SIGKILL → state restored, {STATE_MIB} MiB per rank (+ model), memory snapshot every step[/b]",
                  "", "")
        t.add_row("  median, replacement worker", _s(b["kill_to_state_restored_median_s"]), "")
        t.add_row("  median without the script's own setup (data, model + optimizer, 1 GiB alloc)",
                  _s(b.get("without_script_setup_median_s")), "")
        for k in b["kills"]:
            rep = k.get("replacement") or {}
            bd = rep.get("breakdown_s", {})
            t.add_row(f"  rank {k['rank']} at step {k['at_step']}: restored from {rep.get('source')}, load_s "
                      f"{_s(rep.get('load_s'), 2)}", _s(rep.get("kill_to_restored_s")), "")
            t.add_row("    kill → failure event | next round | script start; then imports | group | corpus | "
                      "model+optimizer | 1 GiB alloc | load",
                      " | ".join(_s(bd.get(x), 2) for x in ("kill_to_failure_event", "kill_to_next_round",
                                                              "kill_to_script_start", "imports", "process_group",
                                                              "corpus", "model_and_optimizer", "state_alloc",
                                                              "load_call")), "")
            if bd.get("load_wait_for_peers") is not None:
                t.add_row("    load: waiting for the other rank to ask | after the master's decision",
                          f"{_s(bd['load_wait_for_peers'], 2)} | {_s(bd['load_after_agreement'], 2)}", "")
    c = res.get("c")
    if c:
        o, tr = c["dlrover-core"], c["torchrun"]
        t.add_row("[b]c. SIGSTOP rank 1 → hang detected[/b]", "", "")
        t.add_row("  detection", _s(o.get("detect_s")),
                  _s(tr.get("detect_s")) if tr.get("noticed") else f"> {_s(tr.get('detect_s_lower_bound'), 0)} (never)")
        t.add_row("  setting", f"hang_timeout_s={o.get('hang_timeout_s'):g} (explicit)",
                  "defaults (gloo 30 min)")
        t.add_row("  SIGSTOP → next step", _s(o.get("stop_to_next_step_s")), "—")
        if tr.get("cpu_s_while_hung") is not None:
            t.add_row(f"  CPU seconds used by the hung torchrun in its {tr.get('cap_s', 0):g} s beside the other runs", "",
                      _s(tr["cpu_s_while_hung"], 1))
    d = res.get("d")
    if d:
        t.add_row("[b]d. Nodes(min=1, max=2): SIGKILL node 1's agent[/b]", "", "")
        down, up = d.get("down_2_to_1") or {}, d.get("up_1_to_2") or {}
        t.add_row("  2 → 1: kill → first 1-node step", _s(down.get("kill_to_first_1node_step_s")), "")
        t.add_row("    kill → failure event | 1-node round", f"{_s(down.get('kill_to_failure_event_s'), 2)} | "
                                                           f"{_s(down.get('kill_to_1node_round_s'), 2)}", "")
        if down.get("restore"):
            t.add_row("    restore: source, step (last step before the kill), load_s",
                      f"{down['restore'].get('source')}, {down['restore'].get('step')} ({down.get('last_step_before_kill')}), "
                      f"{_s(down['restore'].get('load_s'), 3)}", "")
        t.add_row("  1 → 2: replacement joins → first 2-node step", _s(up.get("join_to_first_2node_step_s")), "")
        t.add_row("    agent start → step | scale-up decision → step", f"{_s(up.get('agent_start_to_first_2node_step_s'), 2)} | "
                  f"{_s(up.get('scale_up_decision_to_first_2node_step_s'), 2)}", "")
        t.add_row("    kill → node declared lost | → first 2-node step", f"{_s(up.get('kill_to_node_declared_lost_s'), 2)} | "
                  f"{_s(up.get('kill_to_first_2node_step_s'), 2)}", "")
        if up.get("restore"):
            t.add_row("    restore: source, step (last 1-node step), load_s",
                      f"{up['restore'].get('source')}, {up['restore'].get('step')} ({up.get('last_1node_step')}), "
                      f"{_s(up['restore'].get('load_s'), 3)}", "")
        if d.get("error"):
            t.add_row("  [red]error[/red]", d["error"], "")

    r = Table(title="Ratios and goals", title_justify="left")
    r.add_column("ratio")
    r.add_column("value", justify="right")
    r.add_column("goal")
    r.add_column("")
    r.add_column("why missed / note")
    for key in GOALS:
        v = ratios.get(key)
        ok = met(key, v, ratios)
        mark = "n/a" if ok is None else ("[green]met[/green]" if ok else "[red]missed[/red]")
        shown = _s(v, 4 if key == "hang_detect_vs_torchrun" else 3)
        if key == "hang_detect_vs_torchrun" and ratios.get("hang_detect_vs_torchrun_is_upper_bound"):
            shown = "≤ " + shown
        if key == "rerendezvous_2_1_2_s" and ratios.get("rerendezvous_2_to_1_s") is not None:
            shown = f"{shown} (2→1 {_s(ratios.get('rerendezvous_2_to_1_s'), 2)}, 1→2 {_s(ratios.get('rerendezvous_1_to_2_s'), 2)})"
        r.add_row(key, shown, goals.get(key, ""), mark, reasons.get(key, ""))
    if ratios.get("time_to_finish_vs_torchrun") is not None:
        r.add_row("time_to_finish_vs_torchrun (no goal)", _s(ratios["time_to_finish_vs_torchrun"]), "", "",
                  "wall time of run a, same work on both sides")
    return [t, r]


def _count(restores: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in restores:
        out[x["source"]] = out.get(x["source"], 0) + 1
    return out


def _shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


def cleanup() -> dict[str, Any]:
    """Kill whatever our jobs and torchruns left; remove their /dev/shm segments. Reports both."""
    report: dict[str, Any] = {}
    for side in _TORCHRUNS:
        side.kill()
    left = processes_with_env("DLROVER_JOB_ID", _JOB_IDS)
    if left:
        report["processes_left"] = [{"pid": p.pid, "cmd": " ".join(p.cmdline()[:6])} for p in left
                                    if p.is_running()]
        for p in left:
            kill_tree(p.pid, 1.0)
    segs = sorted(n for n in _shm() if any(j in n for j in _JOB_IDS))
    if segs:
        report["shm_left"] = segs
        for n in segs:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{n}")
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="scaled down by 12 (under 5 minutes)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    p.add_argument("--only", default="a,b,c,d,e", help="experiments to run, e.g. 'a' or 'b,d' (e: full run only)")
    p.add_argument("--workdir", default=None, help="scratch directory (default: a temporary one, removed)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory (logs)")
    p.add_argument("--torchrun-hang-cap-s", type=float, default=None, help="override the mode's cap (120 / 300 s)")
    p.add_argument("--hang-timeout-s", type=float, default=None, help="override dlrover-core's hang_timeout_s (10 s)")
    a = p.parse_args(argv)
    mode = "quick" if a.quick else "full"
    cfg = dict(MODES[mode])
    if a.torchrun_hang_cap_s is not None:
        cfg["torchrun_hang_cap_s"] = a.torchrun_hang_cap_s
    if a.hang_timeout_s is not None:
        cfg["hang_timeout_s"] = a.hang_timeout_s
    only = {x.strip() for x in a.only.split(",") if x.strip()}

    def on_signal(signum: int, _frame: object) -> None:  # clean up (finally below) on SIGTERM too
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    scratch = Path(tempfile.mkdtemp(prefix="recovery-bench-", dir=a.workdir))
    shm_before = _shm()
    load_before = os.getloadavg()
    t0 = time.monotonic()
    res: dict[str, Any] = {}
    schedule = fault_schedule(seed=a.seed, mtbf_s=cfg["mtbf_s"], horizon_s=cfg["mtbf_s"] * 20, world_size=2)
    say(f"mode {mode}; scratch {scratch}; load average {load_before[0]:.2f}")
    hang_tr: TorchrunHang | None = None
    try:
        if "c" in only:
            say(f"c. torchrun hang (defaults; capped at {cfg['torchrun_hang_cap_s']:g} s; it sits idle beside the other "
                "experiments) ...")
            hang_tr = TorchrunHang(cfg, scratch)
            hang_tr.start()
        if "a" in only:
            say(f"a. dlrover-core, {cfg['steps']} steps, SIGKILLs at random (MTBF {cfg['mtbf_s']:g} s, seed {a.seed}) ...")
            res["a"] = {"schedule": schedule[:40], "mtbf": {}}
            for side, fn in zip(SIDES, (run_ours, run_torchrun), strict=True):
                if side == "torchrun":
                    say("a. torchrun, same schedule ...")
                x = res["a"]["mtbf"][side] = fn(cfg, schedule, scratch, steps=cfg["steps"], tag="mtbf")
                say(f"   {x['state']}: goodput {_s(x['goodput'], 4)}, wall {_s(x['wall_s'], 1)} s, kills "
                    f"{len(x['kills'])}, kill → next step {_each(x['kill_to_next_step'])}")
            if cfg["kill_series"]:
                series = [{"offset_s": SERIES_GAP_S * (i + 1), "rank": 1 - i % 2} for i in range(cfg["kill_series"])]
                steps = SERIES_STEPS_PER_KILL * (cfg["kill_series"] + 1)
                res["a"].update(series_schedule=series, series={})
                for side, fn in zip(SIDES, (run_ours, run_torchrun), strict=True):
                    say(f"a'. {side}, {len(series)} SIGKILLs {SERIES_GAP_S:g} s apart, {steps} steps ...")
                    x = res["a"]["series"][side] = fn(cfg, series, scratch, steps=steps, tag="series")
                    say(f"   {x['state']}: kill → next step {_each(x['kill_to_next_step'])}")
        if "e" in only and cfg["plain_store_kills"]:
            n = cfg["plain_store_kills"]
            plain = [{"offset_s": 15.0 * (i + 1), "rank": i % 2} for i in range(n)]
            say(f"e. torchrun with init_method='env://' (no per-restart prefix), {n} SIGKILLs 15 s apart ...")
            x = run_torchrun(cfg, plain, scratch, steps=SERIES_STEPS_PER_KILL * (n + 1), tag="plain", store="plain",
                             max_restarts=3 * n, pg_timeout_s=60.0, only_training=True)
            res["e"] = x
            say(f"   {x['state']}: restarts {x['torchrun_restarts']['restarts']}, failed or hung "
                f"{len(x['torchrun_restarts']['failed_or_hung'])}")
        if "b" in only:
            say(f"b. dlrover-core, {STATE_MIB} MiB per rank, {cfg['restore_kills']} SIGKILLs ...")
            res["b"] = run_restore(cfg, scratch)
            say(f"   kill → state restored, median {_s(res['b']['kill_to_state_restored_median_s'])} s")
        if "c" in only:
            say(f"c. dlrover-core hang (hang_timeout_s={cfg['hang_timeout_s']:g}) ...")
            ours_hang = run_hang_ours(cfg, scratch)
            say(f"   detected after {_s(ours_hang.get('detect_s'))} s")
        if "d" in only:
            say("d. dlrover-core, Nodes(min=1, max=2), SIGKILL node 1's agent ...")
            res["d"] = run_rerendezvous(cfg, scratch)
            say(f"   2 → 1 {_s((res['d'].get('down_2_to_1') or {}).get('kill_to_first_1node_step_s'))} s, 1 → 2 "
                f"{_s((res['d'].get('up_1_to_2') or {}).get('join_to_first_2node_step_s'))} s")
        if hang_tr is not None:
            left = cfg["torchrun_hang_cap_s"] - (time.time() - (hang_tr.t_stop or time.time()))
            say(f"c. waiting for torchrun's hang (up to {max(0.0, left):.0f} s more) ...")
            res["c"] = {"dlrover-core": ours_hang, "torchrun": hang_tr.finish()}
    finally:
        if hang_tr is not None:
            hang_tr.side.kill()
        left = cleanup()
        time.sleep(0.5)
        shm_new = sorted(n for n in _shm() - shm_before if any(j in n for j in _JOB_IDS) or "torch" in n)
        if not a.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    ratios, goals = compute(res, cfg)
    reasons = annotate(res, ratios, cfg)
    for tbl in tables(res, ratios, goals, reasons, cfg):
        console.print(tbl)
    doc = {
        "command": "python benchmarks/" + " ".join([Path(__file__).name, *(argv if argv is not None else sys.argv[1:])]),
        "mode": mode, "config": cfg, "seed": a.seed,
        "machine": {"cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "load_average_before": [round(x, 2) for x in load_before],
                    "load_average_after": [round(x, 2) for x in os.getloadavg()]},
        "wall_s": round(time.monotonic() - t0, 1),
        "ratios": ratios, "goals": goals,
        "met": {k: met(k, ratios.get(k), ratios) for k in GOALS}, "why_missed": reasons,
        "results": res,
        "cleanup": {**left, "our_shm_entries_left": shm_new, "job_ids": sorted(_JOB_IDS)},
    }
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(doc, indent=2, default=str))
    console.print(f"done in {doc['wall_s']} s" + (f"; JSON in {a.json}" if a.json else "")
                  + (f"; [red]left behind: {left}[/red]" if left else "") + (f"; [red]left in /dev/shm: {shm_new}[/red]" if shm_new else ""))
    return 0


def annotate(res: dict[str, Any], ratios: dict[str, Any], cfg: dict) -> dict[str, str]:
    """Why each goal was missed (or could not be measured), in words, from the raw numbers."""
    reasons: dict[str, str] = {}
    a, b, c, d = (res.get(k) for k in "abcd")
    for key in GOALS:
        if ratios.get(key) is None and key in ("kill_to_next_step_vs_torchrun", "goodput_vs_torchrun_mtbf180",
                                               "goodput_gap_to_young_daly_pts") and a:
            reasons[key] = "not measured: no uninterrupted kill on one side (see the raw table)"
    if a and met("kill_to_next_step_vs_torchrun", ratios.get("kill_to_next_step_vs_torchrun"), ratios) is False:
        po, pt = a["pooled"]["dlrover-core"], a["pooled"]["torchrun"]
        bo, bt = po["breakdown_median_s"], pt["breakdown_median_s"]
        reasons["kill_to_next_step_vs_torchrun"] = (
            f"ours {_s(po['kill_to_next_step_median_s'], 2)} s: next round at {_s(bo.get('next_round'), 2)} s, then "
            f"{_s((bo.get('restored') or 0) - (bo.get('next_round') or 0), 2)} s of worker start until restored "
            f"(group, corpus, model, optimizer, restore) and {_s((bo.get('first_step') or 0) - (bo.get('restored') or 0), 2)} s "
            f"to the first step; torchrun {_s(pt['kill_to_next_step_median_s'], 2)} s of which "
            f"{_s((bt.get('torch_imported') or 0) - (bt.get('new_script_start') or 0), 2)} s importing torch")
    if a and met("goodput_vs_torchrun_mtbf180", ratios.get("goodput_vs_torchrun_mtbf180"), ratios) is False:
        o, t = a["mtbf"]["dlrover-core"], a["mtbf"]["torchrun"]
        excluded = len(o.get("nodes_excluded", []))
        reasons["goodput_vs_torchrun_mtbf180"] = (
            f"goodput {_s(o['goodput'], 3)} vs {_s(t['goodput'], 3)}: {len(o['kills'])} vs {len(t['kills'])} kills, "
            + (f"{excluded} node(s) excluded after max_node_failures SIGKILLs (its replacement restores from "
               f"storage, not memory), " if excluded else "")
            + f"recomputed {_s(o['recomputed_s'], 1)} vs {_s(t['recomputed_s'], 1)} s, "
            f"launch → first step {_s(o['launch_to_first_step_s'], 1)} vs {_s(t['launch_to_first_step_s'], 1)} s, "
            f"median step {_s(o['step_dt_median_s'], 3)} vs {_s(t['step_dt_median_s'], 3)} s")
    if a and met("goodput_gap_to_young_daly_pts", ratios.get("goodput_gap_to_young_daly_pts"), ratios) is False:
        o = a["mtbf"]["dlrover-core"]
        v = a.get("young_daly_gap_variants_pts") or {}
        jr = o.get("job_result") or {}
        reasons["goodput_gap_to_young_daly_pts"] = (
            f"the formula has no job start: launch → first step {_s(o['launch_to_first_step_s'], 1)} s of "
            f"{_s(o['wall_s'], 0)} s (gap without it: {_s(v.get('excluding_first_start'), 1)} pts); JobResult: startup "
            f"{_s(jr.get('startup_s'), 1)} s, rendezvous {_s(jr.get('rendezvous_s'), 1)} s, checkpoint stalls "
            f"{_s(o['checkpoint_stall_total_s'], 1)} s")
    if b and met("kill_to_state_restored_s", ratios.get("kill_to_state_restored_s"), ratios) is False:
        k = next((x.get("replacement") for x in b["kills"] if x.get("replacement")), None)
        if k:
            bd = k["breakdown_s"]
            reasons["kill_to_state_restored_s"] = (
                f"first kill: {_s(bd.get('kill_to_script_start'), 2)} s until the replacement script runs (failure "
                f"reported at {_s(bd.get('kill_to_failure_event'), 2)} s, round at {_s(bd.get('kill_to_next_round'), 2)} s), "
                f"then group {_s(bd.get('process_group'), 2)} + data {_s(bd.get('corpus'), 2)} + model/optimizer "
                f"{_s(bd.get('model_and_optimizer'), 2)} + 1 GiB alloc {_s(bd.get('state_alloc'), 2)} + load "
                f"{_s(bd.get('load_call'), 2)} s; {_s(b.get('without_script_setup_median_s'), 2)} s without the "
                f"script's own setup (median)")
    if c and met("hang_detect_vs_torchrun", ratios.get("hang_detect_vs_torchrun"), ratios) is False:
        reasons["hang_detect_vs_torchrun"] = (
            f"ours {_s(c['dlrover-core'].get('detect_s'), 1)} s; torchrun did not notice within the "
            f"{cfg['torchrun_hang_cap_s']:g} s cap (a lower bound: this ratio is an upper bound); at its documented "
            f"1800 s it would be {_s(ratios.get('hang_detect_vs_torchrun_at_documented_default'), 4)}")
    if c and c["dlrover-core"].get("detect_s") is None:
        reasons["hang_detect_vs_torchrun"] = f"not measured: {c['dlrover-core'].get('error')}"
    if d and met("rerendezvous_2_1_2_s", ratios.get("rerendezvous_2_1_2_s"), ratios) is False:
        down, up = d.get("down_2_to_1") or {}, d.get("up_1_to_2") or {}
        reasons["rerendezvous_2_1_2_s"] = (
            f"2→1: failure reported at {_s(down.get('kill_to_failure_event_s'), 2)} s, 1-node round at "
            f"{_s(down.get('kill_to_1node_round_s'), 2)} s (the round waits Nodes.last_call_s = "
            f"{d['nodes']['last_call_s']:g} s: the killed node counts as live until heartbeat_timeout_s), then worker "
            f"start and restore; 1→2: {d['nodes']['last_call_s']:g} s last call after the join, then "
            f"{_s(up.get('scale_up_decision_to_first_2node_step_s'), 2)} s from the scale-up decision to the first step")
    if d and d.get("error"):
        reasons["rerendezvous_2_1_2_s"] = f"{d['error']}; " + reasons.get("rerendezvous_2_1_2_s", "")
    return reasons


if __name__ == "__main__":
    sys.exit(main())
