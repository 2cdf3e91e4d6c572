"""The JobMaster: the effects shell around the job master's decisions.

All methods are thread-safe (one lock); the HTTP server calls them from its threads and a
ticker thread calls :meth:`JobMaster.tick` to complete rounds, notice silent nodes and
decide scale-ups. The rules are pure functions of a view of the job
(:mod:`~dlrover_core.master.decisions`); the JobMaster applies what they decide in one place
— journal ahead (:class:`~dlrover_core.master.journal.WriteAhead`), one event that also logs,
then the effects (answers, relaunches) — and its collaborators keep the state of one concern
each: the job's record (:mod:`~dlrover_core.master.book`), the node table
(:mod:`~dlrover_core.master.nodes`), rendezvous rounds (:mod:`~dlrover_core.master.rendezvous`),
the live world (:mod:`~dlrover_core.master.live`), the goodput timeline
(:mod:`~dlrover_core.master.goodput`), node checks (:mod:`~dlrover_core.master.node_check`),
checkpoint commits and restores (:mod:`~dlrover_core.master.checkpoints`), failure verdicts
(:mod:`~dlrover_core.master.failures`) and what the master shows
(:mod:`~dlrover_core.master.views`).

Every agent call takes its request message and returns its answer
(:mod:`dlrover_core.protocol.messages`). Agents learn what to do from the ``action`` in
every answer (:class:`~dlrover_core.protocol.messages.Action`): ``"none"`` (carry on),
``"restart"`` (stop your workers and join the next rendezvous round), ``"replace"`` (only
the failed workers restart, as joiners of the running world) or ``"stop"`` (the job is over
for you: it ended, or your node was excluded).

Beyond the failure rules of :mod:`~dlrover_core.master.decisions`: a node silent for
``Failure.heartbeat_timeout_s`` is lost (its workers' failure is counted, and the scheduler
backend relaunches it); a node that failed ``Failure.max_node_failures`` times within
``Failure.node_failure_window_s`` is excluded and replaced by a new node; with
``Failure(node_check=True)`` the nodes of a round about to form first run the accelerator's
check in pairs (:mod:`~dlrover_core.master.node_check`); a round forms only when one is
required, and with ``Nodes(min < max)`` nodes waiting to join a smaller round make the job
restart into a bigger one (a membership change, not counted).

Journal (:mod:`~dlrover_core.master.journal`): every decision is written ahead — a snapshot
before it takes effect, one log line per node-level change — so a master restarted from the
journal loses nothing: it reopens the running round's store on its port, answers again an
agent whose answer was lost, and relaunches a node whose relaunch it ordered but may not
have issued; should an agent run a round the journal missed, every node restarts into a
round past it. Heartbeats write nothing.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

from dlrover_core import rundir
from dlrover_core.logging import get_logger
from dlrover_core.master import views
from dlrover_core.master.book import JobBook
from dlrover_core.master.checkpoints import CheckpointCoordinator
from dlrover_core.master.decisions import (
    JobView,
    RoundView,
    decide_exit,
    decide_success,
    success_end,
)
from dlrover_core.master.fleet import Fleet
from dlrover_core.master.goodput import GoodputTracker, StepRate
from dlrover_core.master.journal import Journal, WriteAhead
from dlrover_core.master.live import LiveRecovery
from dlrover_core.master.node_check import NodeChecks
from dlrover_core.master.nodes import NodeRecord, NodeTable
from dlrover_core.master.recovery import Recovery
from dlrover_core.master.rendezvous import RendezvousManager, Round
from dlrover_core.master.replicas import ReplicaIndex
from dlrover_core.master.rounds import Rounds, StoreFactory, StoreReopener
from dlrover_core.protocol.events import EventKind, JobEvent
from dlrover_core.protocol.messages import (
    Action,
    ActionAnswer,
    AssignNode,
    Cancel,
    CheckpointErrorReport,
    Exited,
    FailureReport,
    Heartbeat,
    HeartbeatAnswer,
    Join,
    Joined,
    LiveAssignment,
    LiveReform,
    NodeAssigned,
    NodeCheckReport,
    NodeRelaunch,
    Poll,
    PollState,
    Register,
    Registered,
    RestoreDecision,
    RestorePlanRequest,
    RestoreVerify,
    RestoreVerifyAnswer,
    RoundAssignment,
    ShardAnswer,
    ShardReport,
    Succeeded,
)
from dlrover_core.protocol.result import JobResult
from dlrover_core.protocol.status import JobState, MasterStatus
from dlrover_core.spec import JobSpec
from dlrover_core.storage.base import CheckpointStorage

__all__ = ["JobMaster"]

log = get_logger()

#: Seconds a restarted master adds to every node's heartbeat timeout: what an agent may need
#: to find it (a request timing out on the dead address, 5 s, then a retry wait, 1 s).
_RESTORE_GRACE_S = 10.0
#: A save that waited longer than this for a free snapshot slot (seconds) is an event:
#: the storage writes slower than the job asks for persists.
_BACKPRESSURE_EVENT_S = 0.05
#: How long a forming generation of the live world waits for a survivor that neither asked
#: for its place nor is known dead (seconds); it rejoins later, with its state.
_LIVE_STRAGGLER_S = 30.0
#: Strategies whose training state every data-parallel rank holds whole (a live peer can
#: give it to a replacement); any other (``fsdp``, ``mesh``, ``auto``) restarts every worker.


class JobMaster:
    """Decides, for the whole job, when rounds start, when workers restart and when it ends.

    Args:
        job: the Job (resolved: no ``"auto"`` left).
        job_id: this run's id.
        store_host: address workers use to reach the round stores.
        store_factory: makes a fresh TCPStore server per round.
        storage: the job's checkpoint storage (commits and restore decisions); ``None``
            when the master does not coordinate checkpoints.
        relaunch: starts a (replacement) agent for a node id, through the scheduler backend;
            ``None`` when the backend cannot.
        log_dir: where ``events.jsonl`` goes (``None``: nowhere).
        emit: called with every :class:`JobEvent` (plugin observers).
        clock: monotonic seconds (injectable for tests).
        journal: where decisions are written ahead (``None``: nowhere; see
            :mod:`~dlrover_core.master.journal`).
        reopen_store: reopens a round's store on its port after a master restart (``None``:
            a restarted master opens a new round instead when the running one needs its store).
    """

    def __init__(self, job: JobSpec, job_id: str, *, store_host: str, store_factory: StoreFactory,
                 storage: CheckpointStorage | None = None, relaunch: Callable[[NodeRelaunch], None] | None = None,
                 log_dir: Path | None = None, emit: Callable[[JobEvent], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, journal: Journal | None = None,
                 reopen_store: StoreReopener | None = None) -> None:
        self.job, self.job_id, self.store_host = job, job_id, store_host
        self._emit_hook, self.clock = emit, clock
        self._lock = threading.RLock()
        self._events_file = open(log_dir / rundir.EVENTS, "a", buffering=1) if log_dir else None
        self.log_dir = log_dir
        self.rdzv = RendezvousManager(min_nodes=job.nodes.min, max_nodes=job.nodes.max, node_unit=job.nodes.node_unit,
                                      last_call_s=job.nodes.last_call_s, clock=clock)
        self.nodes = NodeTable()
        self.book = JobBook()
        self.goodput = GoodputTracker()
        self.rate = StepRate()  # rank 0's steps per second, samples/s, tokens/s and the ETA
        self.replicas = ReplicaIndex()  # which node holds which rank's snapshot replicas (not journaled: heartbeats say)
        self.node_checks = NodeChecks(store_factory=store_factory, store_host=store_host, clock=clock)
        self.journal = journal
        self.wal = WriteAhead(journal, self._lock, self.snapshot)
        self._version = 0  # snapshots taken (a newer one always wins in the journal)
        self._whole_rounds_from = 0  # rounds this master heard from their start (a restored one: the next)
        self.fleet = Fleet(self, relaunch=relaunch, report_failure=lambda report: self.failure(report, lost=True))
        self.rounds = Rounds(self, fleet=self.fleet, store_factory=store_factory, reopen_store=reopen_store)
        self.recovery = Recovery(self, fleet=self.fleet, rounds=self.rounds)
        self.livework = LiveRecovery(why_not=job.live_blocker, store_host=store_host, clock=clock,
                                     event=self.event, straggler_timeout_s=_LIVE_STRAGGLER_S, sharded=job.live_sharded,
                                     replica_groups=job.replica_groups,
                                     has_replica=lambda node_id, rank: bool(self.rounds.replica_holders(node_id, [rank])))
        self.started = clock()
        self.ended: float | None = None
        self.checkpoints = (CheckpointCoordinator(storage, keep_last=job.checkpoint.keep_last,
                                                  event=self._checkpoint_event) if storage is not None else None)
        if self.checkpoints is not None and self.checkpoints.latest is not None:
            self.goodput.last_committed_step = self.checkpoints.latest

    # ----- the record, as the API and the tests read it ----------------------------------------

    state = property(lambda self: self.book.state)
    reason = property(lambda self: self.book.reason)
    restarts = property(lambda self: self.book.restarts)
    required_round = property(lambda self: self.book.required_round)
    failures = property(lambda self: self.book.failures)
    metrics = property(lambda self: self.book.metrics)
    live = property(lambda self: self.livework.world, doc="The running round's live world (docs/design.md §5a).")
    live_why = property(lambda self: self.livework.why_not, doc="Why failures restart every worker (\"\": they need not).")

    # ----- helpers -------------------------------------------------------------------

    def now_s(self) -> float:
        return self.clock() - self.started

    def event(self, kind: str, /, *, level: str = "info", log_fields: dict[str, Any] | None = None, **data: Any) -> None:
        """One fact: a log line (``kind`` at ``level``, with ``data`` or, when the event
        carries more than a console line should, ``log_fields``) and a :class:`JobEvent`
        (events.jsonl, plugin observers)."""
        getattr(log, level)(kind, **(data if log_fields is None else log_fields))
        event = JobEvent(kind=kind, job_id=self.job_id, time_s=self.now_s(), data=data, unix_time_s=time.time())
        if self._events_file is not None:
            self._events_file.write(json.dumps(event.to_dict()) + "\n")
        if self._emit_hook is not None:
            self._emit_hook(event)

    def _checkpoint_event(self, kind: str, /, **data: Any) -> None:
        if kind == "checkpoint_committed":
            self.goodput.committed(data["step"])
        self.event(kind, **data)
        if kind == "checkpoint_committed":
            self.wal.decided("step_committed")

    def note_node(self, node: NodeRecord, *, succeeded: bool = False, point: str | None = None) -> None:
        entry: dict[str, Any] = {"node": node.to_journal(), **self.book.node_entry(node.node_id)}
        self.wal.note({**entry, "succeeded": True} if succeeded else entry, node_id=node.node_id, point=point)

    def write_journal(self) -> bool:
        """Write a snapshot now unless nothing changed (the periodic write for soft state)."""
        return self.wal.write_if_changed()

    def node(self, node_id: int) -> NodeRecord:
        return self.nodes.get_or_add(node_id, self.clock())

    def action(self, round_index: int, node: NodeRecord | None = None) -> Action:
        if self.state.is_terminal or (node is not None and node.state == "excluded"):
            return Action.STOP
        return Action.RESTART if round_index < self.required_round else Action.NONE

    def view(self) -> JobView:
        rnd = self.rdzv.latest
        current = None if rnd is None else RoundView(index=rnd.index, node_ids=rnd.node_ids, world_size=rnd.world_size)
        held = (self.book.held[0], self.book.held[2]) if self.book.held is not None else None
        return JobView(state=self.state, required_round=self.required_round, current=current, restarts=self.restarts,
                       max_restarts=self.job.failure.max_restarts, held=held, live_round=self.livework.open_round,
                       live_why=self.livework.why_not_now)

    def finish(self, state: JobState, reason: str = "") -> None:
        if self.state.is_terminal:
            return
        self.book.state, self.book.reason, self.book.held = state, reason, None
        self.ended = self.clock()
        self.event(EventKind.JOB_FINISHED, state=state.value, reason=reason, restarts=self.restarts)
        self.wal.decided("job_finished")

    # ----- agent calls -----------------------------------------------------------------

    def assign_node(self, message: AssignNode) -> NodeAssigned:
        """A host's launcher (``dlrover run`` without ``--node-rank``) asks for its node id
        (:meth:`Fleet.assign`); answered ``stop`` when the job is over or ``rdzv_id`` names
        another job, and node id -1 with ``action`` none while the job has all its nodes (the
        host asks again)."""
        with self._lock:
            if message.rdzv_id and message.rdzv_id != self.job_id:
                return NodeAssigned(node_id=-1, job_id=self.job_id, action=Action.STOP,
                                    reason=f"the job master at this endpoint runs job {self.job_id!r}, not "
                                           f"{message.rdzv_id!r}: give every host the same --rdzv-id")
            if self.state.is_terminal:
                return NodeAssigned(node_id=-1, job_id=self.job_id, action=Action.STOP,
                                    reason=f"job {self.job_id} already ended {self.state.value}")
            node_id = self.fleet.assign(message.key)
            if node_id is None:
                return NodeAssigned(node_id=-1, job_id=self.job_id, action=Action.NONE,
                                    reason=f"the job has its nodes.max={self.job.nodes.max} nodes: this host waits "
                                           "until one is lost (it then stands in for it) or leaves")
            return NodeAssigned(node_id=node_id, job_id=self.job_id)

    def register(self, message: Register) -> Registered:
        """An agent starts for ``node_id``; it gets a new fencing token (:meth:`Fleet.register`).
        When the node's fenced agent was a member of the current round (a relaunch issued
        twice, both agents started), every node restarts into a new round, not counted."""
        with self.wal.batch():
            before, rnd = self.nodes.get(message.node_id), self.rdzv.latest
            ran = (before is not None and before.state in ("running", "waiting") and rnd is not None
                   and message.node_id in rnd and rnd.index >= self.required_round)
            node = self.fleet.register(message.node_id, host=message.host, pid=message.pid,
                                       replica_addr=message.replica_addr)
            if ran:  # its agent in the round is fenced now: the round cannot go on without it (nor wait for it)
                self.rounds.new_round(f"node {message.node_id} has a new agent (pid {message.pid}) while its "
                                      f"fenced one was in round {rnd.index}")  # type: ignore[union-attr]
            return Registered(action=self.action(self.required_round, node), job_id=self.job_id, token=node.token)

    def fenced(self, node_id: int, token: int | None) -> bool:
        """Whether a call for ``node_id`` carrying ``token`` comes from a replaced agent."""
        with self._lock:
            return self.fleet.fenced(node_id, token)

    def join(self, message: Join) -> Joined:
        """A node joins the next rendezvous round."""
        with self._lock:
            node = self.node(message.node_id)
            node.last_heartbeat = self.clock()
            if self.action(self.required_round, node) == Action.STOP:
                return Joined(action=Action.STOP)
            return Joined(round=self.rounds.join(node, message.nproc))

    def poll(self, message: Poll) -> RoundAssignment:
        """Whether the round ``node_id`` waits for is complete; if so, its place in it."""
        with self._lock:
            node = self.node(message.node_id)
            node.last_heartbeat = self.clock()
            if self.action(self.required_round, node) == Action.STOP:
                return RoundAssignment(state=PollState.STOP, action=Action.STOP)
            return self.rounds.poll(node)

    def heartbeat(self, message: Heartbeat) -> HeartbeatAnswer:
        node_id, round_index = message.node_id, message.round
        with self._lock:
            node = self.node(node_id)
            if self.fleet.fenced(node_id, message.token) or (message.token is None and message.pid is not None
                                                         and node.pid and message.pid != node.pid):
                return HeartbeatAnswer(action=Action.STOP, fenced=True)  # a stale agent of a node that was relaunched
            node.last_heartbeat = self.clock()
            if node.state == "dead":  # came back: it must rejoin through rendezvous
                node.state = "registered"
            node.workers = dict(message.workers)
            if message.steps:
                node.steps.update(message.steps)
            self.replicas.update(node_id, message.replicas)
            for record in message.records:
                self._record(record)
            latest = self.rdzv.latest
            if round_index >= 0 and (latest is None or round_index > latest.index) and not self.state.is_terminal:
                self.rounds.unknown(node_id, round_index)
            self._check_saves(round_index, message.saves, message.steps)
            return HeartbeatAnswer(action=self.action(round_index, node), **self.rounds.replica_source(node, round_index))

    def _record(self, record: Any) -> None:
        """Fold one of rank 0's progress records (a ``dlrover_core.protocol.progress`` record,
        typed by ``Heartbeat.records``) into the goodput, the rate, the metrics and the events.
        ``record.type`` is its ``RecordType``, str-valued."""
        self.goodput.add(record, now=self.clock())
        self.rate.add(record)
        if record.type == "step":
            self.metrics.update(record.metrics)
        elif record.type == "checkpoint" and record.waited_s > _BACKPRESSURE_EVENT_S:
            # a save waited for the storage (both snapshot slots were still being persisted)
            self.event(EventKind.CHECKPOINT_BACKPRESSURE, step=record.step, waited_s=record.waited_s)
        elif record.type == "restore":
            self.event(EventKind.CHECKPOINT_RESTORED, step=record.step, source=record.source, load_s=record.load_s)
            why = self.checkpoints.restore_why if self.checkpoints is not None and record.source == "storage" else ""
            self.book.failures = [
                (attrs.evolve(f, restored_step=record.step, restored_from=record.source, restored_why=why)
                 if f.restored_step is None and counted else f, counted) for f, counted in self.failures]

    # ----- checkpoints -------------------------------------------------------------------

    def _coordinator(self) -> CheckpointCoordinator:
        if self.checkpoints is None:
            raise ValueError("this master does not coordinate checkpoints (no storage)")
        return self.checkpoints

    def checkpoint_shard(self, message: ShardReport) -> ShardAnswer:
        """A rank's shard of a step is durable in storage (written by incarnation ``message.round``)."""
        with self._lock:
            if self.fleet.fenced(message.node_id, message.token):
                return ShardAnswer(committed=self._coordinator().latest, stale=True, reason="fenced agent")
            return self._coordinator().shard_done(message)

    def checkpoint_error(self, message: CheckpointErrorReport) -> ActionAnswer:
        """Persisting a shard failed. A failed write (disk full, permission) is recorded and
        shown in the status; training goes on. A ``fatal`` one (a write stuck past
        ``checkpoint.persist_timeout_s``, or a final checkpoint that is not durable) ends
        the job FAILED with the saver's reason, which names the storage, the step and the
        error — no node is blamed for it."""
        with self._lock:
            if self.fleet.fenced(message.node_id, message.token):
                return ActionAnswer(action=Action.STOP)
            self.event(EventKind.CHECKPOINT_PERSIST_FAILED, node_id=message.node_id, rank=message.rank, step=message.step,
                        error=message.error, storage=message.storage, fatal=bool(message.fatal))
            if self.checkpoints is not None:
                self.checkpoints.persist_failed(message)
            if message.fatal:
                self.finish(JobState.FAILED, message.error)
            return ActionAnswer(action=self.action(self.required_round))

    def restore_plan(self, message: RestorePlanRequest) -> RestoreDecision:
        """A rank's snapshots in memory; answers the restore decision once every rank reported."""
        return self._restore_call(lambda coordinator: coordinator.restore_plan(message))

    def restore_verify(self, message: RestoreVerify) -> RestoreVerifyAnswer:
        """A rank checked its shard of the storage step it is about to load (``ok`` or
        ``error``); answers ``waiting`` / ``ok`` / ``retry`` (with an older step) / ``failed``."""
        return self._restore_call(lambda coordinator: coordinator.verify(message))

    def _restore_call(self, call: Callable[[CheckpointCoordinator], Any]) -> Any:
        with self._lock:
            coordinator = self._coordinator()
            before = coordinator.restore_count
            answer = call(coordinator)
            if coordinator.restore_count != before:  # the lineage changed: a restarted master must know it
                self.wal.decided("restore_decided")
            return answer

    def _check_saves(self, round_index: int, saves: dict[int, tuple[int, ...]], steps: dict[int, int]) -> None:
        """Fold ranks' storage saves and progress into the same-steps rule; a violation
        fails the job at once (the step can never be committed)."""
        live = self.live
        if (self.checkpoints is None or self.state.is_terminal or round_index < 0
                # a master that died heard part of this round's saves (heartbeats are not journaled)
                or round_index < self._whole_rounds_from
                # ranks changed hands in the live world: a rank's saves and steps span processes
                or (live is not None and live.round == round_index and live.generation > 0)):
            return
        problem = self.checkpoints.fold(round_index, saves, steps)
        if problem is not None:
            self.finish(JobState.FAILED, problem)

    # ----- failures ----------------------------------------------------------------------

    def failure(self, message: FailureReport, *, lost: bool = False) -> ActionAnswer:
        """Workers of a node failed (or the node was lost) in a round: decided
        (:mod:`~dlrover_core.master.decisions`) and applied by :class:`Recovery`."""
        with self.wal.batch():
            return self.recovery.failure(message, lost=lost)

    def succeeded(self, message: Succeeded) -> ActionAnswer:
        """Every worker of a node exited 0; the job succeeds when every node it needs did."""
        with self._lock:
            node = self.node(message.node_id)
            node.last_heartbeat = self.clock()
            rnd, live, coordinator = self.rdzv.latest, self.live, self.checkpoints
            needed = (() if rnd is None else rnd.node_ids if live is None or live.closed or live.round != rnd.index
                      else tuple(live.nodes()))
            decision = decide_success(self.view(), round_index=message.round,
                                      succeeded=frozenset({*self.book.succeeded, node.node_id}), needed=needed)
            if decision.counts:
                node.state = "succeeded"
                self.book.succeeded.add(node.node_id)
                self.note_node(node, succeeded=True, point="node_succeeded")
                log.info("node_succeeded", node_id=node.node_id, round=message.round)
            if decision.complete:
                self.finish(*success_end(
                    final_problem=coordinator.final_problem() if coordinator is not None else None,
                    lost_steps=coordinator.lost_steps() if coordinator is not None else [],
                    latest=coordinator.latest if coordinator is not None else None,
                    last_persist_error=coordinator.last_persist_error if coordinator is not None else None))
            return ActionAnswer(action=self.action(message.round, node))

    def exited(self, message: Exited) -> ActionAnswer:
        """The agent of a node exited (the job ended for it, or it was stopped: scaled down,
        preempted): the others go on live without it, or restart into a round without it;
        too few nodes left fails the job at once."""
        with self.wal.batch():
            node = self.node(message.node_id)
            was = node.state
            if node.state != "excluded":
                node.state = "exited"
                self.book.gone_why[node.node_id] = "exited"
            self.rdzv.leave(node.node_id)
            self.note_node(node)
            view, rnd = self.view(), self.rdzv.latest
            member = (rnd is not None and node.node_id in rnd and not view.state.is_terminal
                      and rnd.index >= self.required_round and was in ("running", "waiting")
                      and node.node_id not in self.book.succeeded)
            live_why = self.livework.node_left(rnd.index, node.node_id) if member else None  # type: ignore[union-attr]
            why = decide_exit(view, node_id=node.node_id, was=was, succeeded=node.node_id in self.book.succeeded,
                              live_why=live_why)
            if why is not None:
                log.warning("node_exited_mid_round", node_id=node.node_id, round=rnd.index)  # type: ignore[union-attr]
            if why:
                self.rounds.new_round(why)
            elif why == "":  # the others go on without it (a membership change, not counted)
                self.event(EventKind.MEMBERSHIP_CHANGED, round=rnd.index, from_nodes=len(rnd.node_ids),  # type: ignore[union-attr]
                            to_nodes=len(self.live.nodes()), reason=f"node {node.node_id} exited; the others go on live")
            self.fleet.check_below_min()
            return ActionAnswer(action=Action.STOP)

    def cancel(self, message: Cancel) -> ActionAnswer:
        """End the job CANCELLED with ``message.reason``."""
        with self._lock:
            self.finish(JobState.CANCELLED, message.reason or Cancel().reason)
            return ActionAnswer(action=Action.STOP)

    # ----- recovery without stopping (docs/design.md §5a) ---------------------------------

    def live_reform(self, message: LiveReform) -> LiveAssignment:
        """A worker asks for its place in the live world's next generation (or says it is
        ready to be re-formed, or caught up): see :mod:`~dlrover_core.master.live`."""
        with self.wal.batch():
            ended = self.state.value if self.state.is_terminal else ""
            return self.livework.reform(message, ended=ended, required_round=self.required_round)

    # ----- node checks ---------------------------------------------------------------------

    def node_check(self, message: NodeCheckReport) -> ActionAnswer:
        """A node's result of a node-check round."""
        with self._lock:
            if self.node_checks.report(message):
                self.rounds.advance_check()
            return ActionAnswer()

    # ----- periodic work -----------------------------------------------------------------

    def tick(self) -> None:
        """Complete a due round; declare silent nodes lost; scale up; time out a stuck
        rendezvous; order a restart held for the other ranks' reports once its wait is over."""
        with self.wal.batch():
            if self.state.is_terminal:
                return
            self.rounds.try_complete()
            self.livework.tick()
            now = self.clock()
            if self.book.held is not None and now > self.book.held[1]:
                self.recovery.release_held()
            self.fleet.find_silent(now)
            if self.state.is_terminal:
                return
            self.rounds.scale_up(now)
            if self.node_checks.timed_out():
                self.rounds.advance_check(timed_out=True)
            since, join_timeout = self.rdzv.forming_since, self.job.nodes.join_timeout_s
            if since is not None and now - since > join_timeout and self.rdzv.next_index <= self.required_round:
                self.finish(JobState.FAILED, f"rendezvous round {self.rdzv.next_index} timed out after {join_timeout:g} s "
                                              f"with {len(self.rdzv.waiting)} waiting nodes (nodes.min={self.job.nodes.min})")

    # ----- journal (master restarts) ------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The master's durable state as JSON-safe data (heartbeat times excluded), with
        ``version`` (increasing) and ``seq`` (the last node change logged it includes)."""
        with self._lock:
            rnd = self.rdzv.latest
            self._version += 1
            store = self.rounds.stores.get(rnd.index) if rnd is not None else None
            return {
                "format": 2, "version": self._version, "seq": self.wal.seq, "job_id": self.job_id,
                "elapsed_s": self.now_s(), **self.book.to_journal(),
                "round": None if rnd is None else {"index": rnd.index, "node_ids": list(rnd.node_ids),
                                                   "nproc": list(rnd.nproc),
                                                   "store_port": store[0] if store is not None else None},
                "nodes": self.nodes.to_journal(), "goodput": self.goodput.to_dict(), "rate": self.rate.to_dict(),
                "pending_shards": self.checkpoints.pending_shards() if self.checkpoints else [],
                "checkpoints": self.checkpoints.to_dict() if self.checkpoints else {},
                "live_sent_away": self.livework.sent_away_to_journal(),
                "assigned": self.fleet.assigned_to_journal(),
            }

    def restore(self, snap: dict[str, Any], entries: Sequence[dict[str, Any]] = ()) -> None:
        """Resume from :meth:`snapshot` and the node changes logged after it (``entries``,
        from :meth:`Journal.load`) after a restart. Agents keep their workers; they get a
        heartbeat timeout plus ``_RESTORE_GRACE_S`` to find this master. The running
        round's store is reopened on its port (else, if a node still needs it, a new round
        is opened); a relaunch ordered but not answered is issued again if its node does
        not register within a heartbeat timeout."""
        with self.wal.batch():
            now = self.clock()
            self.started = now - float(snap["elapsed_s"])
            self.book = JobBook.from_journal(snap, entries, now=now)
            self._version = max(self._version, int(snap.get("version", 0)))
            self.wal.seq = max([int(snap.get("seq", 0)), *(int(e["seq"]) for e in entries)])
            r = snap["round"]
            rnd = None if r is None else Round(index=r["index"], node_ids=tuple(r["node_ids"]), nproc=tuple(r["nproc"]))
            self.rdzv.restore(rnd)
            self._whole_rounds_from = rnd.index + 1 if rnd is not None else 0
            self.nodes = NodeTable.from_journal([*snap["nodes"], *(e["node"] for e in entries if "node" in e)])  # later lines win
            current = rnd if rnd is not None and rnd.index >= self.required_round else None
            self.fleet.restored(now, _RESTORE_GRACE_S, current, snap.get("assigned") or {},
                                [e["assigned"] for e in entries if "assigned" in e])
            if current is not None and r.get("store_port"):
                self.rounds.reopen(current.index, int(r["store_port"]))
            self.goodput = GoodputTracker.from_dict(snap["goodput"])
            self.rate = StepRate.from_dict(snap.get("rate") or {})  # (a journal from before it: none)
            self.livework.load_sent_away(snap.get("live_sent_away") or ())
            if self.checkpoints is not None:
                self.checkpoints.load_dict(snap.get("checkpoints") or {"pending_shards": snap["pending_shards"]})
            self.event(EventKind.MASTER_RECOVERED, round=r["index"] if r else None, nodes=len(self.nodes), restarts=self.restarts,
                       logged_changes=len(entries))
            self.wal.decided("master_recovered")

    # ----- views -------------------------------------------------------------------------

    def drained(self) -> bool:
        """The job is over and every registered agent has exited (or was declared dead)."""
        with self._lock:
            return self.state.is_terminal and all(n.gone for n in self.nodes.values())

    def status(self) -> MasterStatus:
        """The job's live status, with the node table (``/v1/status``)."""
        with self._lock:
            message = self.reason or self.fleet.waiting_message() or views.storage_warning(self.checkpoints)
            return views.master_status(self, message=message, elapsed_s=self.now_s(), wall_s=self._wall_s())

    def result(self) -> JobResult:
        with self._lock:
            return views.job_result(self, wall_s=self._wall_s())

    def _wall_s(self) -> float:
        """Seconds from the master's start to the job's end (or now), never 0."""
        end = self.ended if self.ended is not None else self.clock()
        return max(end - self.started, 1e-9)
