"""Recovery benchmark: dlrover-core, ``torchrun --max-restarts`` and TorchFT side by side, in one run.

    python benchmarks/recovery.py [--quick] [--json PATH] [--seed N] [--only a,b,c,d,e]

Every side trains the char LM of ``examples/charlm`` (same model, data order, optimizer, LR
schedule, seeds, validation schedule, checkpoint interval K) with 2 workers on this machine,
and every side gets the same SIGKILLs (experiment a):

* **dlrover-core**: ``Job(nodes=Nodes(min=2, max=2, nproc_per_node=1), scheduler="local")``
  running ``examples/charlm/train.py`` with ``Failure(max_restarts=100)`` and otherwise the
  defaults (warm standbys, live recovery, ``max_node_failures=3``, 300 s collective timeout):
  the script loops with ``train.steps()``, so when a worker dies the survivor re-forms a
  1-process group in place and goes on with the whole global batch (in micro-batches), and
  the dead worker's agent starts a replacement (a warm standby: torch already imported) that
  joins at a step boundary and receives the live state from the survivor (docs/design.md §5a).
  Flash Checkpoint: a memory snapshot every step, persisted every K steps.
* **torchrun**: ``torchrun --standalone --nnodes 1 --nproc-per-node 2 --max-restarts 100``
  running ``_recovery_torchrun_train.py`` (plain DDP, ``torch.save`` + fsync every K steps
  from rank 0, ``torch.load`` on start, a per-restart ``PrefixStore`` against the gloo restart
  trap, 300 s collective timeout as ours). One torchrun agent for both workers is torchrun's
  fastest way to restart (no rendezvous between agents): the baseline gets its best case. A
  SIGKILL restarts both workers (cold: new interpreters import torch again).
* **TorchFT** (``torchft`` 0.2.0, ``_recovery_torchft_train.py``): DDP across replica groups
  as in torchft's ``train_ddp.py`` and README — 2 replica groups of 1 process, each with a
  ``Manager(min_replica_size=1, timeout=30 s)``, ``ProcessGroupGloo(timeout=5 s)``,
  ``PGTransport`` (live state to a recovering group over the process group, 10 s), the
  default asynchronous quorum, ``init_sync=False`` (same seed everywhere, as the Manager's
  docstring recommends), torchft's DDP and optimizer wrappers; the lighthouse started as its
  README does (``torchft_lighthouse --min_replicas 1 --quorum_tick_ms 100
  --join_timeout_ms 10000``; ``heartbeat_timeout_ms`` left at its 5 s default). TorchFT
  expects the scheduler to restart a dead replica group; here a supervisor thread per group
  restarts it the moment it exits (cold, like torchrun: faster than torchft's own torchrun
  launcher) and hosts its ``TCPStore``. Checkpoints every K steps with ``torch.save`` +
  fsync (model, optimizer, the Manager's state), loaded on start; a group behind its peer
  heals from it. While a group is down its half of each step's batch is skipped (as
  torchft's ``DistributedSampler`` documents), where dlrover-core's survivor trains the whole
  global batch. One fix to torchft 0.2.0 is needed on CPU: its DDP gradient hook asserts on
  the future of a failed gloo all-reduce, which kills the survivor whenever its peer dies
  (``assert fut._fut`` in ``torchft/ddp.py``); the script's hook returns the bucket instead
  (the Manager has already marked the step failed), which is what torchft intends.

The survivors' failure detection differs by design and is left at each side's documented
setting: dlrover-core's agent sees the worker exit and the survivor's collective fails at
once; TorchFT's survivor also fails at once but its next quorum waits until the lighthouse
stops counting the dead group as healthy (``heartbeat_timeout_ms``, 5 s) or until it rejoins.
If TorchFT cannot run here (not installed, does not import), its results say why, with the
error, and the other sides still run (``pip install torchft``).

Experiments (``--only`` picks some):

a. **Failures at random, MTBF 180 s.** One seeded exponential schedule of SIGKILLs (offsets
   from each side's first training step, a random rank each) hits all three sides; a failure
   due while that rank has no live worker hits the next one as soon as it exists. Measured
   per kill, from every worker's step records (seconds from the SIGKILL):
   *survivor step* — the first step a worker alive before the kill began after it and
   completed (torchrun has none: every worker restarts); *next step* — the first step the
   killed worker's replacement completed (torchrun: the restarted workers); *full world* —
   the first step of that replacement at world size 2. Medians over the kills whose
   measure came before the next kill, pooled over a and a'. Goodput is measured the same
   way on every side: productive time — the ``dt`` of the steps the final model builds on
   (rank 0's records at each step; TorchFT: committed steps of participating rank 0), ``dt``
   leaving out checkpoint saves, restores and the time spent re-forming (dlrover-core:
   ``train.steps()`` restarts the step timer after a re-form; TorchFT: the main thread's wait
   for the quorum) — over wall time from launch to the job's end. Degraded steps (world size
   1) count as productive on both live sides. dlrover-core's ``JobResult.goodput`` is shown
   too. ``recomputed_steps``: steps dlrover-core trained again after a restore, from
   ``JobResult.failures`` (step at the failure minus the restored step); the same count from
   the progress records is shown beside it. Then a dlrover-core run of the same length and
   seed without kills: ``final_val_loss_vs_uninterrupted`` compares the final validation
   losses.
a'. (full run only) 4 SIGKILLs 25 s apart on each side, for more samples.
e. (full run only) The gloo restart trap: torchrun with the script's ``--store plain``
   (``init_method="env://"``, as most scripts are written), 4 SIGKILLs at least 15 s apart,
   each once the current workers have trained a step, a 60 s collective timeout and 12
   restarts allowed: how many restarts fail or hang.
b. **Kill to state restored, 1 GiB.** A 2-node dlrover-core job of ``_recovery_worker.py``
   (a plain loop, not ``train.steps()``: every worker restarts and restores) whose state is
   the char LM plus extra buffers, 1 GiB per rank, saved with the Checkpointer every step to
   memory; a worker is SIGKILLed (repeatedly) and the replacement logs the wall time
   ``Checkpointer.load`` returned.
c. **Hang detection, equal timeouts.** SIGSTOP rank 1 once the job has trained
   ``INJECT_AT_STEP`` steps; both sides get the same detection budget H (``hang_timeout_s``,
   10 s; ``--hang-timeout-s`` sets it for both). dlrover-core: ``Failure(hang_timeout_s=H)``
   set explicitly (derived, it would be max(60 s, 20 x the median step time) = 60 s here),
   measured from the SIGSTOP to the master's ``worker_failed`` event of kind ``hang``.
   torchrun: its agent only watches for worker exits, and a gloo job's only hang detection is
   the process group's collective timeout (torch's default is 30 minutes), so the training
   script's ``init_process_group(timeout=H)`` gets the same H (``--pg-timeout-s``): the
   surviving rank's all-reduce fails after H and the worker exits; measured from the SIGSTOP
   to that exit (or a restart, or torchrun exiting, whichever comes first), capped at
   ``--torchrun-hang-cap-s``; if it never notices, the cap is a lower bound and the ratio an
   upper bound. The two sides run one after the other, torchrun first, with nothing else of
   this benchmark running; the timeouts each side used are in the JSON
   (``results.c.timeouts_s`` and ``config.hang_timeouts_s``).
d. **Re-rendezvous 2 → 1 → 2.** ``Nodes(min=1, max=2)``, the char LM in
   ``_recovery_worker.py --live`` (``train.steps()``): SIGKILL node 1's agent (its worker
   dies with it). Seconds from the kill to the first step at world size 1, and from the
   replacement agent's join (the master's ``membership_changed`` event minus
   ``Nodes.last_call_s``, the master's scale-up rule, when a new round forms; its
   ``live_node_joining`` event when the node joins the running world) to the first step at
   world size 2, whatever path the product takes (a live re-form or a new round; ``path``
   says which). The master declares the killed node lost
   after ``Failure(heartbeat_timeout_s=...)`` (10 s here; default 30 s) and relaunches it.

**Young/Daly.** Young (1974), "A first order approximation to the optimum checkpoint
interval", CACM 17(9):530-531, and Daly (2006), "A higher order estimate of the optimum
checkpoint interval for restart dumps", FGCS 22(3):303-312: with checkpoint cost C, mean time
between failures M and restart cost R, the waste per unit time at interval tau is about
C/tau + tau/(2M) + R/M, minimal at Young's tau = sqrt(2 C M), where the expected goodput is

    G_YD = 1 - sqrt(2 C / M) - R / M.

We use exactly that (first order). C: the mean training stall of one checkpoint save in run a
(dlrover-core: a memory snapshot, taken every step; persists run in the agent). M: wall time
of run a over the failures injected in it (the realized MTBF; the nominal one is shown too).
R: the median time from a kill to the next step of the training that goes on (the survivor's
step on the live sides, the restarted workers' on torchrun) minus the median step time.
``goodput_gap_to_young_daly_pts`` = 100 (G_YD - ``JobResult.goodput`` of run a); the JSON
also has the gap for the same-definition goodput and without the job's first start, which the
formula does not model.

Run a lasts 3000 steps (some 10 minutes of training per side here, 3 to 4 MTBFs); ``--quick``
scales the MTBF down by 15 (12 s) and runs 160 steps (3 kills per side with seed 0, the first
two 0.5 s apart), skips a' and e, does 2 kills in b instead of 5 and caps torchrun's hang at
120 s instead of 300 s (with equal timeouts it is noticed long before either); it takes about
8 minutes here (9.4 measured while other jobs kept the load average at 4.5 to 6.5 on these 2
cores; c alone, ``--only c``: 1.5 minutes). The full run takes an estimated 75
minutes (a: about 11 minutes per side and for the run without kills, a': 5 per side, e: 3,
b-d: 6).

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
import shlex
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
    TORCHFT_LIGHTHOUSE_ARGS,
    EventTail,
    FaultInjector,
    TorchftSide,
    TorchrunSide,
    alive,
    fault_schedule,
    first_step_t,
    kill_samples,
    kill_tree,
    lineage,
    median,
    ours_files,
    ours_records,
    ours_step_events,
    peer_step_events,
    processes_with_env,
    read_jsonl,
    torchft_unavailable,
    torchrun_breakdown,
    torchrun_records,
)
from _results import write_result  # noqa: E402  (benchmarks/ is the script's directory)

from dlrover_core import Checkpoint, Failure, Job, Nodes  # noqa: E402
from dlrover_core.errors import DLRoverError  # noqa: E402

#: ratio key -> (goal, "<=" or ">=")
GOALS: dict[str, tuple[float, str]] = {
    "kill_to_survivor_step_vs_torchrun": (0.1, "<="),
    "kill_to_survivor_step_s": (0.5, "<="),
    "kill_to_full_world_vs_torchrun": (0.5, "<="),
    "kill_to_next_step_vs_torchrun": (0.33, "<="),
    "goodput_vs_torchrun_mtbf180": (1.15, ">="),
    "goodput_vs_torchft": (1.0, ">="),
    "recomputed_steps": (0.0, "<="),
    "final_val_loss_vs_uninterrupted": (0.01, "<="),
    "goodput_gap_to_young_daly_pts": (2.0, "<="),
    "kill_to_state_restored_s": (0.8, "<="),
    "hang_detect_vs_torchrun": (0.1, "<="),
    "rerendezvous_2_1_2_s": (2.3, "<="),
}

MODES = {
    "quick": {"steps": 160, "mtbf_s": 12.0, "scale": 1 / 15, "ckpt_every": 25, "kill_series": 0, "plain_store_kills": 0,
              "restore_kills": 2, "hang_timeout_s": 10.0, "torchrun_hang_cap_s": 120.0, "heartbeat_timeout_s": 10.0,
              "side_timeout_s": 240.0},
    "full": {"steps": 3000, "mtbf_s": 180.0, "scale": 1.0, "ckpt_every": 25, "kill_series": 4, "plain_store_kills": 4,
             "restore_kills": 5, "hang_timeout_s": 10.0, "torchrun_hang_cap_s": 300.0, "heartbeat_timeout_s": 10.0,
             "side_timeout_s": 1800.0},
}

SIDES = ("dlrover-core", "torchrun", "torchft")
FULL_WORLD = 2
#: a': SIGKILLs this far apart (seconds from the first step), this many steps per kill
SERIES_GAP_S = 25.0
SERIES_STEPS_PER_KILL = 100
STATE_MIB = 1024
INJECT_AT_STEP = 10
#: per kill: what followed it (see ``kill_samples``)
MEASURES = ("survivor_step", "next_step", "full_world")

console = Console(highlight=False, width=None if sys.stdout.isatty() else 160)
_JOB_IDS: set[str] = set()
_TORCHRUNS: list[Any] = []



def _inject_and_wait(side, schedule, victim, cfg) -> tuple[FaultInjector, int | None]:
    """Run ``schedule``'s SIGKILLs against a peer side (torchrun, TorchFT) until it ends, stalls
    150 s or times out; the side is killed in every case. Returns the injector and the exit code."""
    inj = FaultInjector(schedule, anchor=side.anchor, victim=victim)
    inj.start()
    try:
        code = side.wait(timeout_s=cfg["side_timeout_s"], stall_s=150.0)
    finally:
        inj.stop()
        side.kill()
    return inj, code

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


def _ours_victim(run: Any, world_size: int = FULL_WORLD):
    """The schedule's rank r is the worker of global rank r in the round; once that slot is
    gone from a running round (its node was excluded and relaunched into the live world),
    the relaunched node's new slot takes its place until the next round ranks them anew."""
    slot_of = {r: r for r in range(world_size)}
    seen_round = [None]

    def victim(rank: int) -> tuple[int, int, int] | None:
        s = run.status()
        if s.state.is_terminal:
            return None
        if s.round != seen_round[0]:
            seen_round[0] = s.round
            slot_of.update({r: r for r in range(world_size)})
        slot = slot_of[rank]
        if slot not in s.worker_pids:
            new = sorted(k for k in s.worker_pids if k not in slot_of.values() and k > max(slot_of.values()))
            if not new:
                return None
            slot = slot_of[rank] = new[0]
        pid = s.worker_pids.get(slot)
        return (pid, s.round, slot) if pid else None

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


def _round_worlds(tail: EventTail) -> dict[int, int]:
    """Round -> world size, from the master's ``rendezvous_completed`` events."""
    return {int(e["round"]): int(e["world_size"]) for e in tail.find("rendezvous_completed") if "world_size" in e}


# ----- a: failures at random ---------------------------------------------------------------------


def _side_summary(name: str, records: list[dict], events: list[dict], kills: list[dict], t_launch: float,
                  t_end: float | None, state: str, breakdown, restores: list[dict] | None = None) -> dict[str, Any]:
    """One side's run a: goodput from ``records`` (the lineage: rank 0's steps, restores and
    saves in order), kill samples from ``events`` (every worker's steps)."""
    lin = lineage(records)
    wall = (t_end or time.time()) - t_launch
    stalls = [r["stall_s"] for r in records if r.get("type") in ("checkpoint", "save")]
    dts = [r["dt"] for r in records if r.get("type") == "step"]
    # steps of the full world only: dlrover-core's records say their world, TorchFT's their
    # quorum's ``participants``; torchrun's all run at full size (it restarts every worker)
    full_dts = [r["dt"] for r in records if r.get("type") == "step"
                and r.get("world", r.get("participants", FULL_WORLD)) == FULL_WORLD]
    if restores is None:
        restores = [r for r in records if r.get("type") == "restore"]
    samples = kill_samples(kills, events, full_world=FULL_WORLD)
    for i, (sample, kill) in enumerate(zip(samples, kills, strict=True)):
        until = kills[i + 1]["t_kill"] if i + 1 < len(kills) else math.inf  # what followed this kill, not the next
        sample["breakdown_s"] = {k: _r(v, 3) for k, v in breakdown({**kill, "t_next_kill": until}).items()}
    first = next((e["t"] for e in events), None)
    out = {
        "side": name, "state": state, "wall_s": _r(wall), "productive_s": _r(lin["productive_s"]),
        "goodput": _r(lin["productive_s"] / wall, 4) if wall > 0 else None,
        "launch_to_first_step_s": _r(first - t_launch) if first else None,
        "recomputed_s": _r(lin["recomputed_s"]), "recomputed_steps_from_progress": lin["recomputed_steps"],
        "steps_kept": lin["steps"], "last_step": lin["last_step"],
        "step_dt_median_s": _r(median(dts), 4), "steps_executed": len(dts),
        "step_dt_median_full_world_s": _r(median(full_dts), 4) if full_dts else None,
        "checkpoint_saves": len(stalls), "checkpoint_cost_mean_s": _r(sum(stalls) / len(stalls), 5) if stalls else None,
        "checkpoint_stall_total_s": _r(sum(stalls)),
        "restores": [{"step": r["step"], "load_s": r.get("load_s"), "source": r.get("source", "torch.load")}
                     for r in restores],
        "kills": kills, "kill_samples": samples,
    }
    for m in MEASURES:
        good = [s[f"{m}_s"] for s in samples if s[f"{m}_uninterrupted"]]
        out[f"{m}_median_s"] = _r(median(good))
        out[f"{m}_samples"] = len(good)
    return out


def _ours_breakdown(tail: EventTail, events: list[dict]):
    """Where a dlrover-core recovery's time went (seconds from the kill): the failure reported
    to the master; the survivors' generation formed (``live_reformed``, reason ``error``); the
    survivors' first step; the replacement let in (``live_reformed``, reason ``grow``); a new
    round (``rendezvous_completed``: only when every worker restarted instead)."""

    def breakdown(kill: dict) -> dict[str, float | None]:
        t, inc, until = kill["t_kill"], kill["incarnation"], kill["t_next_kill"]

        def first(kind: str, pred=lambda e: True) -> float | None:
            e = next((e for e in tail.find(kind) if t - 0.05 < tail.wall(e) < until and pred(e)), None)
            return None if e is None else tail.wall(e) - t

        return {"failure_reported": first("worker_failed"),
                "reformed": first("live_reformed", lambda e: e.get("reason") == "error"),
                "grown": first("live_reformed", lambda e: e.get("reason") == "grow"),
                "next_round": first("rendezvous_completed", lambda e: e["round"] > inc)}

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
    worlds = _round_worlds(tail)
    records = ours_records(log_dir, worlds)
    events = ours_step_events(log_dir, worlds)
    out = _side_summary("dlrover-core", records, events, inj.kills, t_launch, t_end,
                        result.state.value if result else f"FAILED: {error}", _ours_breakdown(tail, events))
    out.update(failure_config=_failure_dict(failure), log_dir=str(log_dir),
               load_average=[round(load0, 2), round(os.getloadavg()[0], 2)],
               nodes_excluded=[{"node_id": e.get("node_id"), "reason": e.get("reason")}
                               for e in tail.find("node_excluded")],
               live_reforms=[{k: e.get(k) for k in ("round", "generation", "world_size", "reason", "wait_s")}
                             for e in tail.find("live_reformed")],
               live_unavailable=[e.get("reason") for e in tail.find("live_recovery_unavailable")],
               failure_actions=[e.get("action") for e in tail.find("worker_failed")],
               hangs=[{k: e.get(k) for k in ("round", "node_id", "rank", "step", "detail")}
                      for e in tail.find("worker_failed", lambda e: e.get("failure_kind") == "hang")])
    if result is not None:
        res = result.to_dict()
        failures = res.get("failures") or []
        out["recomputed_steps"] = sum(max(0, int(f["step"]) - int(f["restored_step"])) for f in failures
                                      if f.get("restored_step") is not None and f.get("step") is not None)
        out["job_result"] = {k: v for k, v in res.items() if k not in ("failures", "metrics")}
        out["job_result"]["failures"] = len(failures)
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
    inj, code = _inject_and_wait(side, schedule, side.training_victim if only_training else side.victim, cfg)
    state = ("SUCCEEDED" if code == 0 else f"FAILED (exit code {code})" if code is not None
             else "HUNG (no step for 150 s)" if side.hung else "TIMED OUT")
    records = side.records(0)
    events = peer_step_events(side.out_dir, side.nproc)
    out = _side_summary("torchrun", records, events, inj.kills, side.t_launch, side.t_exit, state,
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
    out["final_val_loss"] = last[-1].get("val_loss") if last else None
    return out


def _torchft_breakdown(kill: dict, by_group: dict[int, list[dict]]) -> dict[str, float | None]:
    """Where a TorchFT recovery's time went (seconds from the kill): the survivor's wait for
    the quorum in its first committed step after the kill (the lighthouse waits until the dead
    group's heartbeat expires or it rejoins) and that step; the restarted group's process
    start, torch and torchft imported, Manager up, healed (the step it received the live
    state in), first step with both groups."""
    t, g, inc, until = kill["t_kill"], kill["rank"], kill["incarnation"], kill.get("t_next_kill", math.inf)
    own = [r for r in by_group.get(g, []) if r["inc"] > inc and r.get("t", t) < until]
    other = [r for o, recs in by_group.items() if o != g for r in recs if r.get("t", t) < until]
    surv = next((r for r in other if r.get("type") == "step" and r.get("committed") and r.get("t_start", 0) > t), None)
    launch = next((r for r in own if r.get("type") == "launch"), None)
    start = next((r for r in own if r.get("type") == "start"), None)
    healed = next((r for r in own if r.get("type") == "step" and r.get("healed")), None)
    full = next((r for r in own if r.get("type") == "step" and r.get("committed") and r.get("participants", 0) >= FULL_WORLD),
                None)
    return {
        "survivor_quorum_wait": surv["blocked_s"] if surv else None,
        "survivor_step": surv["t"] - t if surv else None,
        "new_process_start": launch["t"] - t if launch else None,
        "torch_imported": start["t_import"] - t if start else None,
        "manager_up": start["t_init"] - t if start else None,
        "healed": healed["t"] - t if healed else None,
        "full_world": full["t"] - t if full else None,
    }


def run_torchft(cfg: dict, schedule: list[dict], work: Path, *, steps: int, tag: str) -> dict[str, Any]:
    """TorchFT on ``_recovery_torchft_train.py`` with ``schedule`` of SIGKILLs."""
    why = torchft_unavailable()
    config = {"lighthouse": " ".join(("torchft_lighthouse", *TORCHFT_LIGHTHOUSE_ARGS)), "replica_groups": 2,
              "processes_per_group": 1, "restart": "supervisor thread, at once, cold", "manager_timeout_s": 30.0,
              "gloo_timeout_s": 5.0, "transport": "PGTransport (10 s)", "init_sync": False, "min_replica_size": 1,
              "patch": "DDP gradient hook: return the bucket when the all-reduce failed (torchft 0.2.0 asserts)"}
    if why:
        return {"side": "torchft", "state": "NOT RUN", "error": why, "config": config}
    side = TorchftSide(work / f"torchft-{tag}", steps=steps, ckpt_every=cfg["ckpt_every"])
    _TORCHRUNS.append(side)
    load0 = os.getloadavg()[0]
    try:
        side.launch()
    except Exception as exc:
        side.kill()
        return {"side": "torchft", "state": "NOT RUN", "error": f"{type(exc).__name__}: {exc}", "config": config}
    inj, code = _inject_and_wait(side, schedule, side.victim, cfg)
    state = ("SUCCEEDED" if code == 0 else "FAILED (a replica group gave up)" if code is not None
             else "HUNG (no step for 150 s)" if side.hung else "TIMED OUT")
    by_group = {g: torchrun_records(side.out_dir, g) for g in range(side.groups)}
    merged = sorted((r for recs in by_group.values() for r in recs), key=lambda r: r.get("t", 0.0))
    records = [r for r in merged if (r.get("type") == "step" and r.get("committed") and r.get("replica_rank") == 0)
               or r.get("type") == "save"]
    restores = [r for r in merged if r.get("type") == "restore"]
    events = peer_step_events(side.out_dir, side.groups, torchft=True)
    out = _side_summary("torchft", records, events, inj.kills, side.t_launch, side.t_exit, state,
                        lambda kill: _torchft_breakdown(kill, by_group), restores=restores)
    steps_all = [r for r in merged if r.get("type") == "step"]
    out.update(config=config, exit_codes=side.exits, load_average=[round(load0, 2), round(os.getloadavg()[0], 2)],
               steps_not_committed=sum(1 for r in steps_all if not r.get("committed")),
               heals=sum(1 for r in steps_all if r.get("healed")),
               errors_reported=len([r for r in merged if r.get("type") == "error"]))
    kept = [r for r in records if r.get("type") == "step"]
    out["final_loss"] = kept[-1].get("loss") if kept else None
    out["final_val_loss"] = kept[-1].get("val_loss") if kept else None
    if code != 0 or not kept:
        out["error"] = side.error or "see log_tail"
        out["log_tail"] = side.log_tail()
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
        t_detect = t_stop
        if _wait_until(lambda: tail.find("worker_failed", hang), cfg["hang_timeout_s"] + 120):
            ev = tail.find("worker_failed", hang)[0]
            t_detect = tail.wall(ev)
            out["detect_s"] = _r(t_detect - t_stop)
            out["detected_by"] = {k: ev.get(k) for k in ("node_id", "rank", "detail", "action")}
        else:
            out["error"] = "no hang detected"
        # the training going on: any worker's step after the detection (live or a new round)
        recs = lambda: [e for e in ours_step_events(log_dir, _round_worlds(tail)) if e["t"] > t_detect]  # noqa: E731
        if _wait_until(lambda: len(recs()) >= 1, 120):
            first = recs()[0]
            out["stop_to_next_step_s"] = _r(first["t"] - t_stop)
            out["next_step_world_size"] = first["world"]
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
    """torchrun whose gloo process group has the same timeout as dlrover-core's
    ``hang_timeout_s`` (``init_process_group(timeout=...)``); SIGSTOP rank 1; watch (in a
    thread) for torchrun to notice — a worker exits, a restart starts, or torchrun exits —
    until the cap."""

    def __init__(self, cfg: dict, work: Path) -> None:
        self.cap_s = cfg["torchrun_hang_cap_s"]
        self.pg_timeout_s = cfg["hang_timeout_s"]
        self.side = TorchrunSide(work / "torchrun-hang", steps=100_000, ckpt_every=cfg["ckpt_every"], max_restarts=3,
                                 pg_timeout_s=self.pg_timeout_s)
        _TORCHRUNS.append(self.side)
        self.out: dict[str, Any] = {
            "pg_timeout_s": self.pg_timeout_s,
            "timeout_mechanism": "init_process_group('gloo', timeout=timedelta(seconds=pg_timeout_s)) in "
                                 "_recovery_torchrun_train.py (--pg-timeout-s); torchrun's agent watches exits only",
            "torch_default_pg_timeout_s": 1800.0, "cap_s": self.cap_s, "argv": self.side.argv}
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
        self._done.set()

    def run(self) -> dict[str, Any]:
        """Start, SIGSTOP, wait until torchrun notices or the cap passes, kill it; the results."""
        if self.start():
            say(f"   SIGSTOPped rank 1 (pid {self.pids[1]}); waiting up to {self.cap_s:g} s ...")
        return self.finish()

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
        args=["--steps", "2000", "--out-dir", str(work / "elastic-out"), "--live"],
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
        status = run.status()
        last_before, round_before = status.step, status.round
        t_kill = time.time()
        os.kill(agent, signal.SIGKILL)
        out["killed_agent_pid"] = agent
        relaunched: dict[str, float] = {}
        after = lambda e: tail.wall(e) > t_kill  # noqa: E731

        def steps_after() -> list[dict]:
            return [e for e in ours_step_events(log_dir, _round_worlds(tail)) if e["t"] > t_kill]

        def first_at(world: int, since: float) -> dict | None:
            return next((e for e in steps_after() if e["world"] == world and e["t"] > since), None)

        def progressed() -> bool:
            with contextlib.suppress(FileNotFoundError, ValueError, psutil.NoSuchProcess):
                info = json.loads((log_dir / "handle.json").read_text())
                for name, pid in info.get("relaunched", {}).items():
                    relaunched.setdefault(name, psutil.Process(int(pid)).create_time())
            one = first_at(1, t_kill)
            return one is not None and first_at(2, one["t"]) is not None

        done = _wait_until(progressed, 120 + 2 * cfg["heartbeat_timeout_s"], poll_s=0.1)
        files = ours_files(log_dir, _round_worlds(tail))

        def restore_in(rnd: int) -> dict | None:
            r = next((r for r in files if r.get("type") == "restore" and r["inc"] == rnd and r["slot"] == 0), None)
            return None if r is None else {k: r.get(k) for k in ("step", "source", "load_s")}

        one = first_at(1, t_kill)
        fails = tail.find("worker_failed", after)
        lost = tail.find("node_relaunched", after)
        reforms = [e for e in tail.find("live_reformed", after)]
        rounds = [e for e in tail.find("rendezvous_completed", after)]
        if one is not None:
            live = one["gen"][0] == round_before and one["gen"][1] > 0
            out["down_2_to_1"] = {
                "path": "live (the survivor re-formed in place)" if live else "new round (every worker restarted)",
                "kill_to_first_1node_step_s": _r(one["t"] - t_kill),
                "kill_to_failure_event_s": _r(tail.wall(fails[0]) - t_kill) if fails else None,
                "kill_to_1node_reform_s": _r(tail.wall(reforms[0]) - t_kill) if live and reforms else None,
                "kill_to_1node_round_s": _r(tail.wall(rounds[0]) - t_kill) if not live and rounds else None,
                "restore": None if live else restore_in(one["gen"][0]), "last_step_before_kill": last_before,
                "failure_actions": [e.get("action") for e in fails],
            }
            two = first_at(2, one["t"])
            scale = tail.find("membership_changed", after)
            joining = tail.find("live_node_joining", after)  # the live path: the relaunched node registered
            if two is not None:
                t_join = (tail.wall(scale[0]) - nodes.last_call_s if scale
                          else tail.wall(joining[0]) if joining else None)
                t_agent = min(relaunched.values()) if relaunched else None
                live_up = two["gen"][0] == one["gen"][0]
                ones = [e["step"] for e in steps_after() if e["world"] == 1]
                out["up_1_to_2"] = {
                    "path": "live (the replacement joined the running world)" if live_up else "new round (every worker restarted)",
                    "last_1node_step": max(ones, default=None),
                    "join_to_first_2node_step_s": _r(two["t"] - (t_join if t_join is not None else t_agent))
                    if (t_join or t_agent) else None,
                    "join_measured_from": ("membership_changed - last_call_s" if scale else "live_node_joining" if joining
                                           else "relaunched agent start"),
                    "agent_start_to_first_2node_step_s": _r(two["t"] - t_agent) if t_agent else None,
                    "scale_up_decision_to_first_2node_step_s": _r(two["t"] - tail.wall(scale[0])) if scale else None,
                    "kill_to_node_declared_lost_s": _r(tail.wall(lost[0]) - t_kill) if lost else None,
                    "kill_to_first_2node_step_s": _r(two["t"] - t_kill),
                    "restore": None if live_up else restore_in(two["gen"][0]),
                }
        out["live_unavailable"] = [e.get("reason") for e in tail.find("live_recovery_unavailable", after)]
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


def _ran(x: dict[str, Any] | None) -> bool:
    return bool(x) and x.get("state") != "NOT RUN"


def _pool(a: dict[str, Any], side: str) -> dict[str, Any]:
    """Medians of each measure over the kills of every run of experiment a (``mtbf``,
    ``series``) where it came before the next kill, and of the breakdown."""
    samples = [s for run in ("mtbf", "series") for s in ((a.get(run) or {}).get(side) or {}).get("kill_samples", [])]
    out: dict[str, Any] = {"kills": len(samples)}
    for m in MEASURES:
        good = [s[f"{m}_s"] for s in samples if s[f"{m}_uninterrupted"]]
        out[f"{m}_median_s"], out[f"{m}_samples"] = _r(median(good)), len(good)
    keys = list(dict.fromkeys(k for s in samples for k in s.get("breakdown_s", {})))
    out["breakdown_median_s"] = {k: _r(median([s["breakdown_s"][k] for s in samples if s["breakdown_s"].get(k) is not None]), 2)
                                 for k in keys}
    return out


def _div(a: float | None, b: float | None, nd: int = 3) -> float | None:
    return _r(a / b, nd) if a is not None and b else None


def compute(res: dict[str, Any], cfg: dict) -> tuple[dict[str, Any], dict[str, str]]:
    """``(ratios, goals)``; fills ``res["a"]["pooled"]`` and ``res["a"]["young_daly"]``."""
    ratios: dict[str, Any] = {}
    goals = {k: f"{op} {g:g}" for k, (g, op) in GOALS.items()}
    a = res.get("a")
    if a:
        mt = a["mtbf"]
        sides = [s for s in SIDES if _ran(mt.get(s))]
        pooled = a["pooled"] = {s: _pool(a, s) for s in sides}
        o, tr, ft = (pooled.get(s, {}) for s in SIDES)
        tr_next = tr.get("next_step_median_s")
        ratios["kill_to_survivor_step_vs_torchrun"] = _div(o.get("survivor_step_median_s"), tr_next)
        ratios["kill_to_survivor_step_s"] = o.get("survivor_step_median_s")
        ratios["kill_to_full_world_vs_torchrun"] = _div(o.get("full_world_median_s"), tr_next)
        ratios["kill_to_next_step_vs_torchrun"] = _div(o.get("next_step_median_s"), tr_next)
        ratios["kill_to_survivor_step_vs_torchft"] = _div(o.get("survivor_step_median_s"), ft.get("survivor_step_median_s"))
        ratios["kill_to_full_world_vs_torchft"] = _div(o.get("full_world_median_s"), ft.get("full_world_median_s"))
        ours = mt.get("dlrover-core") or {}
        og = ours.get("goodput")
        for side, key in (("torchrun", "goodput_vs_torchrun_mtbf180"), ("torchft", "goodput_vs_torchft")):
            other = mt.get(side) or {}
            ratios[key] = _div(og, other.get("goodput")) if _ran(other) else None
            ratios[f"time_to_finish_vs_{side}"] = _div(ours.get("wall_s"), other.get("wall_s")) if _ran(other) else None
        ratios["recomputed_steps"] = ours.get("recomputed_steps", ours.get("recomputed_steps_from_progress"))
        ratios["recomputed_steps_from_progress"] = ours.get("recomputed_steps_from_progress")
        if ours and "recomputed_steps" not in ours:
            ratios["recomputed_steps_source"] = "progress records (no JobResult: the run did not finish)"
        clean = a.get("uninterrupted") or {}
        lc, l0 = ours.get("final_val_loss"), clean.get("final_val_loss")
        ratios["final_val_loss_vs_uninterrupted"] = _r(abs(lc - l0) / l0, 5) if lc is not None and l0 else None
        a["final_val_loss"] = {"uninterrupted (dlrover-core)": l0,
                               **{s: (mt.get(s) or {}).get("final_val_loss") for s in SIDES}}
        yd = {}
        for side in sides:
            run = mt[side]
            p = pooled[side]
            n, c = len(run["kills"]), run["checkpoint_cost_mean_s"]
            k = p.get("survivor_step_median_s") if side != "torchrun" else p.get("next_step_median_s")
            if c is None or k is None:
                continue
            r = max(0.0, k - (run["step_dt_median_s"] or 0.0))
            m = run["wall_s"] / n if n else cfg["mtbf_s"]
            yd[side] = {"realized_M": young_daly(c, m, r), "nominal_M": young_daly(c, cfg["mtbf_s"], r), "kills": n}
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
        ours_c, tr_c = c["dlrover-core"], c["torchrun"]
        o_s = ours_c.get("detect_s")
        t_s = tr_c.get("detect_s") or tr_c.get("detect_s_lower_bound")
        ratios["hang_detect_vs_torchrun"] = _r(o_s / t_s, 4) if o_s and t_s else None
        if o_s and tr_c.get("noticed") is False:
            ratios["hang_detect_vs_torchrun_is_upper_bound"] = True
    d = res.get("d")
    if d and "down_2_to_1" in d:
        down = d["down_2_to_1"]["kill_to_first_1node_step_s"]
        up = (d.get("up_1_to_2") or {}).get("join_to_first_2node_step_s")
        ratios["rerendezvous_2_to_1_s"] = down
        ratios["rerendezvous_1_to_2_s"] = up
        ratios["rerendezvous_2_1_2_s"] = max(down, up) if down is not None and up is not None else None
        goals["rerendezvous_2_1_2_s"] = "<= 2.3, each transition"
    return ratios, goals


def met(key: str, value: Any, ratios: dict[str, Any]) -> bool | None:
    if value is None:
        return None
    goal, op = GOALS[key]
    return value >= goal if op == ">=" else value <= goal


def _s(v: Any, nd: int = 3) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def _each(samples: list[dict], measure: str = "next_step") -> str:
    """One measure of each kill; * came after the next kill, (r) a kill during a recovery."""
    return ", ".join(_s(x[f"{measure}_s"], 2) + ("" if x[f"{measure}_uninterrupted"] else "*")
                     + ("(r)" if x["during_recovery"] else "") for x in samples) or "—"


def _count(restores: list[dict]) -> str:
    out: dict[str, int] = {}
    for x in restores:
        out[x["source"]] = out.get(x["source"], 0) + 1
    return ", ".join(f"{k}: {v}" for k, v in out.items()) or "—"


def _side_rows(cfg: dict, a: dict[str, Any]) -> list[tuple[str, Any, Any, Any]]:
    mt = a["mtbf"]
    o, tr, ft = (mt.get(s) or {} for s in SIDES)
    cols = (o, tr, ft)

    def row(name: str, fn, nd: int = 3) -> tuple[str, Any, Any, Any]:
        vals = []
        for x in cols:
            try:
                vals.append(_s(fn(x), nd) if _ran(x) else (x.get("state", "—") if x else "—"))
            except (KeyError, TypeError):
                vals.append("—")
        return (name, *vals)

    rows = [
        row("  outcome", lambda x: x["state"]),
        row("  kills injected", lambda x: len(x["kills"])),
        row("  kill → survivor step, each (* after the next kill, (r) during a recovery)",
            lambda x: _each(x["kill_samples"], "survivor_step")),
        row("  kill → replacement's first step, each", lambda x: _each(x["kill_samples"], "next_step")),
        row("  kill → full world again, each", lambda x: _each(x["kill_samples"], "full_world")),
        row("  launch → first step", lambda x: x["launch_to_first_step_s"]),
        row("  wall, launch → end (same work)", lambda x: x["wall_s"]),
        row("  productive (steps in the final model)", lambda x: x["productive_s"]),
        row("  goodput (same definition on every side)", lambda x: x["goodput"], 4),
        row("  goodput, JobResult", lambda x: (x.get("job_result") or {}).get("goodput") if x is o else None, 4),
        row("  recomputed: s | steps (progress)", lambda x: f"{_s(x['recomputed_s'], 1)} | {x['recomputed_steps_from_progress']}"),
        row("  step time, median (every step)", lambda x: x["step_dt_median_s"], 4),
        row("  step time, median (world size 2)", lambda x: x.get("step_dt_median_full_world_s"), 4),
        row("  checkpoint cost C (mean stall per save)", lambda x: x["checkpoint_cost_mean_s"], 5),
        row("  saves (memory every step | torch.save every K)", lambda x: x["checkpoint_saves"]),
        row("  restores (source: count)", lambda x: _count(x["restores"])),
        row("  final validation loss", lambda x: x.get("final_val_loss"), 4),
        row("  load average (1 min) at start, end", lambda x: ", ".join(map(str, x["load_average"]))),
    ]
    rows.append(("  dlrover-core: live re-forms | nodes excluded | fell back to restarts",
                 f"{len(o.get('live_reforms', []))} | {len(o.get('nodes_excluded', []))} | {len(o.get('live_unavailable', []))}"
                 if o else "—", "", ""))
    if _ran(tr):
        rows.append(("  torchrun: restarts that failed or hung", "",
                     f"{len(tr['torchrun_restarts']['failed_or_hung'])} of {tr['torchrun_restarts']['restarts']}"
                     + (" (hung)" if tr["torchrun_restarts"]["hung"] else ""), ""))
    if _ran(ft):
        rows.append(("  torchft: steps not committed | heals | group restarts", "", "",
                     f"{ft['steps_not_committed']} | {ft['heals']} | {sum(1 for e in ft['exit_codes'] if e['code'] != 0)}"))
    elif ft:
        rows.append(("  torchft: error", "", "", str(ft.get("error", ""))[:200]))
    return rows


def tables(res: dict[str, Any], ratios: dict[str, Any], goals: dict[str, str], reasons: dict[str, str],
           cfg: dict) -> list[Table]:
    t = Table(title="Recovery, raw numbers (seconds unless noted)", title_justify="left")
    t.add_column("what")
    for side in SIDES:
        t.add_column(side, justify="right")
    a = res.get("a")
    if a:
        t.add_row(f"[b]a. SIGKILLs at random, MTBF {cfg['mtbf_s']:g} s, {cfg['steps']} steps, checkpoint every "
                  f"{cfg['ckpt_every']} steps[/b]", "", "", "")
        for r in _side_rows(cfg, a):
            t.add_row(*(str(x) for x in r))
        clean = a.get("uninterrupted") or {}
        t.add_row("  dlrover-core without kills: final validation loss | wall | goodput",
                  f"{_s(clean.get('final_val_loss'), 4)} | {_s(clean.get('wall_s'), 1)} | {_s(clean.get('goodput'), 4)}", "", "")
        series = a.get("series")
        if series:
            t.add_row(f"[b]a'. {len(a['series_schedule'])} SIGKILLs, one every {SERIES_GAP_S:g} s[/b]", "", "", "")
            for m in MEASURES:
                t.add_row(f"  kill → {m.replace('_', ' ')}, each",
                          *(_each(series[s]["kill_samples"], m) if _ran(series.get(s)) else "—" for s in SIDES))
        pooled = a.get("pooled", {})
        t.add_row("[b]medians over the kills (a, a'), n[/b]", "", "", "")
        for m in MEASURES:
            t.add_row(f"  kill → {m.replace('_', ' ')}",
                      *(f"{_s(pooled[s][f'{m}_median_s'], 2)} (n={pooled[s][f'{m}_samples']})" if s in pooled else "—"
                        for s in SIDES))
        bo = pooled.get("dlrover-core", {}).get("breakdown_median_s", {})
        bt = pooled.get("torchrun", {}).get("breakdown_median_s", {})
        bf = pooled.get("torchft", {}).get("breakdown_median_s", {})
        t.add_row("  ours: failure reported | survivors re-formed | replacement in (grow) | new round",
                  " | ".join(_s(bo.get(k), 2) for k in ("failure_reported", "reformed", "grown", "next_round")), "", "")
        t.add_row("  torchrun: new script | torch imported | group | restored | first step", "",
                  " | ".join(_s(bt.get(k), 2) for k in ("new_script_start", "torch_imported", "process_group",
                                                        "restored", "first_step")), "")
        t.add_row("  torchft: survivor's quorum wait | survivor step | new process | torch+torchft imported | Manager up | "
                  "healed | full world", "", "",
                  " | ".join(_s(bf.get(k), 2) for k in ("survivor_quorum_wait", "survivor_step", "new_process_start",
                                                        "torch_imported", "manager_up", "healed", "full_world")))
        yd = a.get("young_daly") or {}
        if yd:
            def fmt(side: str) -> str:
                y = yd.get(side, {}).get("realized_M")
                return (f"{y['C_s']:.4f}, {y['M_s']:.0f}, {y['R_s']:.2f}, {y['tau_opt_s']:.2f} → "
                        f"{y['goodput']:.4f}") if y else "—"
            t.add_row("  Young/Daly: C, M (realized), R, τ_opt → expected goodput", *(fmt(s) for s in SIDES))
    e = res.get("e")
    if e:
        tr_e = e["torchrun_restarts"]
        t.add_row("[b]e. torchrun, init_method='env://' (no per-restart store prefix), SIGKILLs 15 s apart[/b]", "", "", "")
        t.add_row("  outcome", "", e["state"], "")
        t.add_row("  kills | restarts | restarts that failed or hung", "",
                  f"{len(e['kills'])} | {tr_e['restarts']} | {len(tr_e['failed_or_hung'])}", "")
        t.add_row("  kill → next step, each", "", _each(e["kill_samples"]), "")
    b = res.get("b")
    if b:
        t.add_row(f"[b]b. SIGKILL → state restored, {STATE_MIB} MiB per rank (+ model), memory snapshot every step[/b]",
                  "", "", "")
        t.add_row("  median, replacement worker", _s(b["kill_to_state_restored_median_s"]), "", "")
        t.add_row("  median without the script's own setup (data, model + optimizer, 1 GiB alloc)",
                  _s(b.get("without_script_setup_median_s")), "", "")
        for k in b["kills"]:
            rep = k.get("replacement") or {}
            bd = rep.get("breakdown_s", {})
            t.add_row(f"  rank {k['rank']} at step {k['at_step']}: restored from {rep.get('source')}, load_s "
                      f"{_s(rep.get('load_s'), 2)}", _s(rep.get("kill_to_restored_s")), "", "")
            t.add_row("    kill → failure event | next round | script start; then imports | group | corpus | "
                      "model+optimizer | 1 GiB alloc | load",
                      " | ".join(_s(bd.get(x), 2) for x in ("kill_to_failure_event", "kill_to_next_round",
                                                              "kill_to_script_start", "imports", "process_group",
                                                              "corpus", "model_and_optimizer", "state_alloc",
                                                              "load_call")), "", "")
    c = res.get("c")
    if c:
        o, tr = c["dlrover-core"], c["torchrun"]
        t.add_row("[b]c. SIGSTOP rank 1 → hang detected[/b]", "", "", "")
        t.add_row("  detection", _s(o.get("detect_s")),
                  _s(tr.get("detect_s")) if tr.get("noticed") else f"> {_s(tr.get('detect_s_lower_bound'), 0)} (never)", "")
        t.add_row("  timeout", f"hang_timeout_s={o.get('hang_timeout_s'):g} (explicit)",
                  f"init_process_group(timeout={tr.get('pg_timeout_s'):g} s)", "")
        t.add_row("  SIGSTOP → next step (world size)", f"{_s(o.get('stop_to_next_step_s'))} ({o.get('next_step_world_size')})",
                  "—", "")
        if tr.get("how"):
            t.add_row("  noticed by", "the master (worker_failed, hang)", str(tr["how"]), "")
    d = res.get("d")
    if d:
        t.add_row("[b]d. Nodes(min=1, max=2): SIGKILL node 1's agent[/b]", "", "", "")
        down, up = d.get("down_2_to_1") or {}, d.get("up_1_to_2") or {}
        t.add_row(f"  2 → 1: kill → first 1-node step ({down.get('path', '—')})", _s(down.get("kill_to_first_1node_step_s")),
                  "", "")
        t.add_row("    kill → failure event | 1-node re-form or round", f"{_s(down.get('kill_to_failure_event_s'), 2)} | "
                  f"{_s(down.get('kill_to_1node_reform_s') or down.get('kill_to_1node_round_s'), 2)}", "", "")
        if down.get("restore"):
            t.add_row("    restore: source, step (last step before the kill), load_s",
                      f"{down['restore'].get('source')}, {down['restore'].get('step')} ({down.get('last_step_before_kill')}), "
                      f"{_s(down['restore'].get('load_s'), 3)}", "", "")
        t.add_row(f"  1 → 2: replacement joins → first 2-node step ({up.get('path', '—')})",
                  _s(up.get("join_to_first_2node_step_s")), "", "")
        t.add_row("    agent start → step | scale-up decision → step", f"{_s(up.get('agent_start_to_first_2node_step_s'), 2)} | "
                  f"{_s(up.get('scale_up_decision_to_first_2node_step_s'), 2)}", "", "")
        t.add_row("    kill → node declared lost | → first 2-node step", f"{_s(up.get('kill_to_node_declared_lost_s'), 2)} | "
                  f"{_s(up.get('kill_to_first_2node_step_s'), 2)}", "", "")
        if up.get("restore"):
            t.add_row("    restore: source, step (last 1-node step), load_s",
                      f"{up['restore'].get('source')}, {up['restore'].get('step')} ({up.get('last_1node_step')}), "
                      f"{_s(up['restore'].get('load_s'), 3)}", "", "")
        if d.get("error"):
            t.add_row("  [red]error[/red]", d["error"], "", "")

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
        shown = _s(v, 4 if key in ("hang_detect_vs_torchrun", "final_val_loss_vs_uninterrupted") else 3)
        if key == "hang_detect_vs_torchrun" and ratios.get("hang_detect_vs_torchrun_is_upper_bound"):
            shown = "≤ " + shown
        if key == "rerendezvous_2_1_2_s" and ratios.get("rerendezvous_2_to_1_s") is not None:
            shown = f"{shown} (2→1 {_s(ratios.get('rerendezvous_2_to_1_s'), 2)}, 1→2 {_s(ratios.get('rerendezvous_1_to_2_s'), 2)})"
        r.add_row(key, shown, goals.get(key, ""), mark, reasons.get(key, ""))
    for key, note in (("kill_to_survivor_step_vs_torchft", "ours over TorchFT's survivor"),
                      ("kill_to_full_world_vs_torchft", "ours over TorchFT's restarted group back in"),
                      ("time_to_finish_vs_torchrun", "wall time of run a, same work"),
                      ("time_to_finish_vs_torchft", "wall time of run a, same work"),
                      ("recomputed_steps_from_progress", "the same count from the progress records")):
        if ratios.get(key) is not None:
            r.add_row(f"{key} (no goal)", _s(ratios[key]), "", "", note)
    return [t, r]


def _shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


def cleanup() -> dict[str, Any]:
    """Kill whatever our jobs, torchruns and TorchFT groups left; remove their /dev/shm
    segments. Reports both."""
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


def _side_line(x: dict[str, Any]) -> str:
    if not _ran(x):
        return f"   NOT RUN: {x.get('error')}"
    return (f"   {x['state']}: goodput {_s(x['goodput'], 4)}, wall {_s(x['wall_s'], 1)} s, kills {len(x['kills'])}; "
            f"kill → survivor step {_each(x['kill_samples'], 'survivor_step')}; → replacement's step "
            f"{_each(x['kill_samples'])}; → full world {_each(x['kill_samples'], 'full_world')}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="scaled down by 15 (about 7 minutes)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault schedule")
    p.add_argument("--only", default="a,b,c,d,e", help="experiments to run, e.g. 'a' or 'b,d' (e: full run only)")
    p.add_argument("--sides", default=",".join(SIDES), help="sides of experiment a, e.g. 'dlrover-core,torchft'")
    p.add_argument("--workdir", default=None, help="scratch directory (default: a temporary one, removed)")
    p.add_argument("--keep", action="store_true", help="keep the scratch directory (logs)")
    p.add_argument("--torchrun-hang-cap-s", type=float, default=None, help="override the mode's cap (120 / 300 s)")
    p.add_argument("--hang-timeout-s", type=float, default=None,
                   help="c's detection budget for both sides (10 s): dlrover-core's Failure.hang_timeout_s and "
                        "torchrun's gloo init_process_group(timeout=...)")
    a = p.parse_args(argv)
    mode = "quick" if a.quick else "full"
    cfg = dict(MODES[mode])
    if a.torchrun_hang_cap_s is not None:
        cfg["torchrun_hang_cap_s"] = a.torchrun_hang_cap_s
    if a.hang_timeout_s is not None:
        cfg["hang_timeout_s"] = a.hang_timeout_s
    cfg["hang_timeouts_s"] = {"dlrover-core": {"Failure.hang_timeout_s": cfg["hang_timeout_s"]},
                              "torchrun": {"init_process_group(timeout=)": cfg["hang_timeout_s"]}}
    argv_used = list(argv if argv is not None else sys.argv[1:])
    only = {x.strip() for x in a.only.split(",") if x.strip()}
    sides = [s for s in SIDES if s in {x.strip() for x in a.sides.split(",")}]
    runners = {"dlrover-core": run_ours, "torchrun": run_torchrun, "torchft": run_torchft}

    stop: list[str] = []

    def on_signal(signum: int, _frame: object) -> None:  # clean up (finally below) on SIGTERM too
        stop.append(signal.Signals(signum).name)
        raise KeyboardInterrupt(stop[-1])

    def check_stop() -> None:  # JobRun.wait() takes a KeyboardInterrupt as "cancel the job" and returns
        if stop:
            raise KeyboardInterrupt(stop[0])

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
        if "a" in only:
            res["a"] = {"schedule": schedule[:40], "mtbf": {}}
            for side in sides:
                say(f"a. {side}, {cfg['steps']} steps, SIGKILLs at random (MTBF {cfg['mtbf_s']:g} s, seed {a.seed}) ...")
                x = res["a"]["mtbf"][side] = runners[side](cfg, schedule, scratch, steps=cfg["steps"], tag="mtbf")
                check_stop()
                say(_side_line(x))
            if "dlrover-core" in sides:
                say(f"a. dlrover-core, {cfg['steps']} steps, no kills (the final validation loss to compare with) ...")
                x = res["a"]["uninterrupted"] = run_ours(cfg, [], scratch, steps=cfg["steps"], tag="clean")
                check_stop()
                say(f"   {x['state']}: final validation loss {_s(x.get('final_val_loss'), 4)}, wall {_s(x['wall_s'], 1)} s")
            if cfg["kill_series"]:
                series = [{"offset_s": SERIES_GAP_S * (i + 1), "rank": 1 - i % 2} for i in range(cfg["kill_series"])]
                steps = SERIES_STEPS_PER_KILL * (cfg["kill_series"] + 1)
                res["a"].update(series_schedule=series, series={})
                for side in sides:
                    say(f"a'. {side}, {len(series)} SIGKILLs {SERIES_GAP_S:g} s apart, {steps} steps ...")
                    x = res["a"]["series"][side] = runners[side](cfg, series, scratch, steps=steps, tag="series")
                    check_stop()
                    say(_side_line(x))
        if "e" in only and cfg["plain_store_kills"]:
            n = cfg["plain_store_kills"]
            plain = [{"offset_s": 15.0 * (i + 1), "rank": i % 2} for i in range(n)]
            say(f"e. torchrun with init_method='env://' (no per-restart prefix), {n} SIGKILLs 15 s apart ...")
            x = run_torchrun(cfg, plain, scratch, steps=SERIES_STEPS_PER_KILL * (n + 1), tag="plain", store="plain",
                             max_restarts=3 * n, pg_timeout_s=60.0, only_training=True)
            res["e"] = x
            say(f"   {x['state']}: restarts {x['torchrun_restarts']['restarts']}, failed or hung "
                f"{len(x['torchrun_restarts']['failed_or_hung'])}")
        check_stop()
        if "b" in only:
            say(f"b. dlrover-core, {STATE_MIB} MiB per rank, {cfg['restore_kills']} SIGKILLs ...")
            res["b"] = run_restore(cfg, scratch)
            say(f"   kill → state restored, median {_s(res['b']['kill_to_state_restored_median_s'])} s")
        check_stop()
        if "c" in only:
            h = cfg["hang_timeout_s"]
            say(f"c. torchrun hang (gloo init_process_group timeout {h:g} s, the same as dlrover-core's "
                f"hang_timeout_s; capped at {cfg['torchrun_hang_cap_s']:g} s) ...")
            hang_tr = TorchrunHang(cfg, scratch)
            tr_hang = hang_tr.run()
            say(f"   noticed after {_s(tr_hang.get('detect_s'))} s ({tr_hang.get('how')})" if tr_hang.get("noticed")
                else f"   not noticed within {_s(tr_hang.get('detect_s_lower_bound'), 0)} s {tr_hang.get('error') or ''}")
            check_stop()
            say(f"c. dlrover-core hang (hang_timeout_s={h:g}) ...")
            ours_hang = run_hang_ours(cfg, scratch)
            say(f"   detected after {_s(ours_hang.get('detect_s'))} s")
            res["c"] = {"dlrover-core": ours_hang, "torchrun": tr_hang,
                        "timeouts_s": {"dlrover-core": ours_hang.get("hang_timeout_s"),
                                       "torchrun": tr_hang.get("pg_timeout_s")}}
        check_stop()
        if "d" in only:
            say("d. dlrover-core, Nodes(min=1, max=2), SIGKILL node 1's agent ...")
            res["d"] = run_rerendezvous(cfg, scratch)
            say(f"   2 → 1 {_s((res['d'].get('down_2_to_1') or {}).get('kill_to_first_1node_step_s'))} s, 1 → 2 "
                f"{_s((res['d'].get('up_1_to_2') or {}).get('join_to_first_2node_step_s'))} s")
        check_stop()
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
        "command": shlex.join(["python", f"benchmarks/{Path(__file__).name}", *argv_used]),
        "python_executable": sys.executable,
        "mode": mode, "config": cfg, "seed": a.seed, "sides": sides,
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
        write_result(a.json, doc, default=str)
    console.print(f"done in {doc['wall_s']} s" + (f"; JSON in {a.json}" if a.json else "")
                  + (f"; [red]left behind: {left}[/red]" if left else "") + (f"; [red]left in /dev/shm: {shm_new}[/red]" if shm_new else ""))
    return 0


def annotate(res: dict[str, Any], ratios: dict[str, Any], cfg: dict) -> dict[str, str]:
    """Why each goal was missed (or could not be measured), in words, from the raw numbers."""
    reasons: dict[str, str] = {}
    a, b, c, d = (res.get(k) for k in "abcd")
    missed = lambda key: met(key, ratios.get(key), ratios) is False  # noqa: E731
    if a:
        mt, pooled = a["mtbf"], a.get("pooled", {})
        o, tr, ft = (mt.get(s) or {} for s in SIDES)
        po, pt, pf = (pooled.get(s, {}) for s in SIDES)
        bo = po.get("breakdown_median_s", {})
        for key in GOALS:
            if key in ("kill_to_state_restored_s", "hang_detect_vs_torchrun", "rerendezvous_2_1_2_s"):
                continue
            if ratios.get(key) is None:
                if key == "goodput_vs_torchft" and not _ran(ft):
                    reasons[key] = f"not measured: TorchFT did not run: {ft.get('error', 'not selected')}"
                elif key == "final_val_loss_vs_uninterrupted":
                    reasons[key] = "not measured: a run without a final validation loss (see the raw table)"
                else:
                    reasons[key] = "not measured: no kill whose recovery came before the next kill on a side, or a side failed"
        torchrun_next = f"torchrun's restarted workers: {_s(pt.get('next_step_median_s'), 2)} s"
        if missed("kill_to_survivor_step_vs_torchrun") or missed("kill_to_survivor_step_s"):
            why = (f"ours {_s(po.get('survivor_step_median_s'), 2)} s (median, n={po.get('survivor_step_samples')}): failure "
                   f"reported at {_s(bo.get('failure_reported'), 2)} s, survivors re-formed at {_s(bo.get('reformed'), 2)} s, "
                   f"then the first step at world size 1 — the whole global batch on one worker, in micro-batches "
                   f"(median step at world size 2: {_s(o.get('step_dt_median_full_world_s'), 3)} s); {torchrun_next}")
            if bo.get("next_round") is not None:
                why += f"; some kills restarted every worker (new round at {_s(bo.get('next_round'), 2)} s)"
            for key in ("kill_to_survivor_step_vs_torchrun", "kill_to_survivor_step_s"):
                if missed(key):
                    reasons[key] = why
        if missed("kill_to_full_world_vs_torchrun") or missed("kill_to_next_step_vs_torchrun"):
            why = (f"ours {_s(po.get('full_world_median_s'), 2)} s to the full world, {_s(po.get('next_step_median_s'), 2)} s to "
                   f"the replacement's first step (n={po.get('full_world_samples')}): the replacement (a warm standby when "
                   f"one is ready) runs the script's own setup (corpus, model, optimizer, Checkpointer) before it asks to "
                   f"join; it was let in (grow) at {_s(bo.get('grown'), 2)} s, then the state broadcast and a step; "
                   f"{torchrun_next}")
            if o.get("nodes_excluded"):
                why += (f"; {len(o['nodes_excluded'])} node(s) excluded (Failure.max_node_failures=3 SIGKILLs of one node "
                        f"within 300 s): their replacement is a relaunched node, whose new agent's standby is still "
                        f"importing torch when its worker starts")
            for key in ("kill_to_full_world_vs_torchrun", "kill_to_next_step_vs_torchrun"):
                if missed(key):
                    reasons[key] = why
        for key, other, name in (("goodput_vs_torchrun_mtbf180", tr, "torchrun"), ("goodput_vs_torchft", ft, "TorchFT")):
            if missed(key):
                excluded = len(o.get("nodes_excluded", []))
                reasons[key] = (
                    (f"dlrover-core {o['state']}; " if o.get("state") != "SUCCEEDED" else "")
                    + (f"{len(o['hangs'])} hang(s) detected ({str(o['hangs'][0].get('detail'))[:90]}), "
                       if o.get("hangs") else "") + (
                    f"goodput {_s(o['goodput'], 3)} vs {name} {_s(other['goodput'], 3)}: {len(o['kills'])} vs "
                    f"{len(other['kills'])} kills, "
                    + (f"{excluded} node(s) excluded after max_node_failures SIGKILLs, " if excluded else "")
                    + (f"{len(o.get('live_unavailable', []))} failure(s) restarted every worker "
                       f"({'; '.join(map(str, o.get('live_unavailable', [])[:2]))}), " if o.get("live_unavailable") else "")
                    + f"recomputed {_s(o['recomputed_s'], 1)} vs {_s(other['recomputed_s'], 1)} s, launch → first step "
                    f"{_s(o['launch_to_first_step_s'], 1)} vs {_s(other['launch_to_first_step_s'], 1)} s, median step "
                    f"{_s(o['step_dt_median_s'], 3)} vs {_s(other['step_dt_median_s'], 3)} s, checkpoint stalls "
                    f"{_s(o['checkpoint_stall_total_s'], 1)} vs {_s(other['checkpoint_stall_total_s'], 1)} s, wall "
                    f"{_s(o['wall_s'], 1)} vs {_s(other['wall_s'], 1)} s (load average {o.get('load_average')} vs "
                    f"{other.get('load_average')})"))
        if missed("recomputed_steps"):
            reasons["recomputed_steps"] = (
                f"{ratios['recomputed_steps']} step(s) trained again after restores; failure actions: "
                + "; ".join(str(x) for x in o.get("failure_actions", [])[:4])
                + (f"; live recovery unavailable: {'; '.join(map(str, o.get('live_unavailable', [])[:2]))}"
                   if o.get("live_unavailable") else ""))
        if missed("final_val_loss_vs_uninterrupted"):
            reasons["final_val_loss_vs_uninterrupted"] = (
                f"{_s(o.get('final_val_loss'), 4)} with kills vs {_s((a.get('uninterrupted') or {}).get('final_val_loss'), 4)} "
                f"without: the steps at world size 1 train the same global batch but in another order of micro-batches and "
                f"with other dropout masks, and a discarded step is trained again with new masks")
        if missed("goodput_gap_to_young_daly_pts"):
            v = a.get("young_daly_gap_variants_pts") or {}
            jr = o.get("job_result") or {}
            reasons["goodput_gap_to_young_daly_pts"] = (
                f"the formula has no job start: launch → first step {_s(o['launch_to_first_step_s'], 1)} s of "
                f"{_s(o['wall_s'], 0)} s (gap without it: {_s(v.get('excluding_first_start'), 1)} pts); JobResult: startup "
                f"{_s(jr.get('startup_s'), 1)} s, rendezvous {_s(jr.get('rendezvous_s'), 1)} s, checkpoint stalls "
                f"{_s(o['checkpoint_stall_total_s'], 1)} s")
        if not _ran(ft) and ft:
            reasons.setdefault("goodput_vs_torchft", f"not measured: TorchFT did not run: {ft.get('error')}")
    if b and missed("kill_to_state_restored_s"):
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
    if c and missed("hang_detect_vs_torchrun"):
        tr_c = c["torchrun"]
        reasons["hang_detect_vs_torchrun"] = (
            f"equal timeouts ({_s(c['dlrover-core'].get('hang_timeout_s'), 1)} s each): ours "
            f"{_s(c['dlrover-core'].get('detect_s'), 1)} s, torchrun "
            + (f"{_s(tr_c.get('detect_s'), 1)} s ({tr_c.get('how')})" if tr_c.get("noticed")
               else f"did not notice within the {cfg['torchrun_hang_cap_s']:g} s cap (a lower bound: the ratio is an "
                    f"upper bound){': ' + tr_c['error'] if tr_c.get('error') else ''}")
            + "; with the same budget both sides detect after about the timeout, so the ratio is near 1")
    if c and c["dlrover-core"].get("detect_s") is None:
        reasons["hang_detect_vs_torchrun"] = f"not measured: {c['dlrover-core'].get('error')}"
    if d and missed("rerendezvous_2_1_2_s"):
        down, up = d.get("down_2_to_1") or {}, d.get("up_1_to_2") or {}
        parts = [f"2→1 ({down.get('path')}): failure reported at {_s(down.get('kill_to_failure_event_s'), 2)} s"]
        if down.get("kill_to_1node_round_s") is not None:
            parts.append(f"1-node round at {_s(down.get('kill_to_1node_round_s'), 2)} s (the round waits "
                         f"Nodes.last_call_s = {d['nodes']['last_call_s']:g} s: the killed node counts as live until "
                         f"heartbeat_timeout_s), then worker start and restore")
        if down.get("kill_to_1node_reform_s") is not None:
            parts.append(f"re-formed at {_s(down.get('kill_to_1node_reform_s'), 2)} s")
        if d.get("live_unavailable"):
            parts.append(f"live recovery unavailable: {'; '.join(map(str, d['live_unavailable'][:2]))}")
        if up.get("join_measured_from") == "membership_changed - last_call_s":
            parts.append(f"1→2 ({up.get('path')}): {_s(up.get('join_to_first_2node_step_s'), 2)} s from the join, "
                         f"{d['nodes']['last_call_s']:g} s of it the last call, then "
                         f"{_s(up.get('scale_up_decision_to_first_2node_step_s'), 2)} s from the scale-up decision to "
                         f"the first step")
        else:
            parts.append(f"1→2 ({up.get('path')}): {_s(up.get('join_to_first_2node_step_s'), 2)} s from the join "
                         f"({up.get('join_measured_from')}): the relaunched node's worker starts (its agent's standby is "
                         f"still importing torch), runs the script's setup and asks to join; "
                         f"{_s(up.get('agent_start_to_first_2node_step_s'), 2)} s from the relaunched agent's start")
        reasons["rerendezvous_2_1_2_s"] = "; ".join(parts)
    if d and d.get("error"):
        reasons["rerendezvous_2_1_2_s"] = f"{d['error']}; " + reasons.get("rerendezvous_2_1_2_s", "")
    return reasons


if __name__ == "__main__":
    sys.exit(main())
