"""The JobMaster: node table, rendezvous rounds, restart budget, goodput and the job's fate.

All methods are thread-safe (one lock); the HTTP server calls them from its threads and a
ticker thread calls :meth:`JobMaster.tick` to complete rounds, notice silent nodes and
decide scale-ups. The JobMaster decides; its collaborators keep the state of one concern
each: the node table (:mod:`~dlrover_core.master.nodes`), rendezvous rounds
(:mod:`~dlrover_core.master.rendezvous`), the goodput timeline
(:mod:`~dlrover_core.master.goodput`), node checks (:mod:`~dlrover_core.master.node_check`),
checkpoint commits and restores (:mod:`~dlrover_core.master.checkpoints`), failure verdicts
(:mod:`~dlrover_core.master.failures`) and the journal (:mod:`~dlrover_core.master.journal`).

Every agent call takes its request message and returns its answer
(:mod:`dlrover_core.protocol.messages`). Agents learn what to do from the ``action`` in
every answer (:class:`~dlrover_core.protocol.messages.Action`):

* ``"none"``: carry on;
* ``"restart"``: stop your workers and join the next rendezvous round;
* ``"stop"``: the job is over for you (it ended, or your node was excluded); stop and exit.

Decisions (DESIGN §5, §5a):

* a failure in a job whose training state is replicated (``ddp``; no ``fsdp``/``mesh``/``auto``)
  and whose workers all loop with ``train.steps()`` does not stop the others: the failed
  workers (or a lost node's) are marked dead in the round's live world
  (:mod:`~dlrover_core.master.live`), the agent is answered ``replace``, the survivors form
  the next generation of the process group among themselves and the replacements join it
  with their live state. It costs one restart of the budget, like any failure; the round
  goes on. Otherwise (``failure.live_recovery=False``, sharded state, a script without
  ``train.steps()``, no survivor) every worker restarts, and the failure record says why;
* the first failure of a round restarts every worker into the next round while the job-wide
  budget (``Failure.max_restarts``) lasts; later failures of the same round are its
  consequences and cost nothing;
* the same exception on every rank at the same step in two failing rounds in a row stops the
  job with the traceback (:class:`~dlrover_core.master.failures.DeterministicErrorDetector`);
* a node silent for ``Failure.heartbeat_timeout_s`` is lost: its workers' failure is
  counted, and the scheduler backend relaunches it; a node that failed
  ``Failure.max_node_failures`` times within ``Failure.node_failure_window_s`` is excluded and
  replaced by a new node;
* with ``Failure(node_check=True)``, the nodes of a round about to form first run the
  accelerator's check in pairs (:mod:`~dlrover_core.master.node_check`); a faulty node is
  excluded and replaced, stragglers are reported (and excluded if asked);
* a round forms only when one is required; with ``Nodes(min < max)`` survivors go on without
  a lost node, and when nodes wait to join a running round that has fewer than ``max``, the
  job restarts into a bigger round (a membership change, not counted as a failure);
* a node of the running round that exits (scaled down, preempted) makes the others go on
  live without it, or else restart into a round without it (a membership change, not
  counted): no worker goes on alone in a world whose other ranks are gone. When the live nodes, with those being relaunched, are
  fewer than ``nodes.min``, the job fails at once with a reason naming them; while a round
  waits for nodes that may still come, the status says so ("waiting for 1 more node; live:
  node 0 (1 < nodes.min=2)");
* an exception raised before the first step (at import or start-up) by every rank of a
  round is the script's, not a node's: the job stops after that first round with the
  exception's type and message, and no node is blamed (the restart the first report ordered
  waits up to ``_SCRIPT_ERROR_WAIT_S`` for the other ranks' reports).

Journal (:mod:`~dlrover_core.master.journal`): every decision above is written ahead — a
snapshot before it takes effect (before the answer that carries it, before the relaunch it
orders), and one log line per node-level change (registered, told its place, succeeded,
exited) — so a master restarted from the journal loses nothing: it reopens the running
round's store on its port, answers again an agent whose answer was lost, and relaunches a
node whose relaunch it ordered but may not have issued; should an agent run a round the
journal missed, every node restarts into a round past it. Heartbeats write nothing.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs

from dlrover_core.logging import get_logger
from dlrover_core.master.checkpoints import CheckpointCoordinator
from dlrover_core.master.failures import (
    DeterministicErrorDetector,
    before_first_step,
    describe,
    failure_record,
    mark_root_causes,
)
from dlrover_core.master.goodput import GoodputTracker, StepRate
from dlrover_core.master.journal import Journal
from dlrover_core.master.live import LiveWorld
from dlrover_core.master.node_check import NodeChecks
from dlrover_core.master.nodes import NodeRecord, NodeTable, plural
from dlrover_core.master.rendezvous import RendezvousManager, Round
from dlrover_core.protocol.codec import decode, encode
from dlrover_core.protocol.events import JobEvent
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
    WorkerFailure,
)
from dlrover_core.protocol.result import FailureRecord, JobResult
from dlrover_core.protocol.status import JobState, MasterStatus
from dlrover_core.spec import JobSpec
from dlrover_core.storage.base import CheckpointStorage

__all__ = ["JobMaster"]

log = get_logger()

#: Returns ``(port, store)`` of a fresh TCPStore server for a new round.
StoreFactory = Callable[[], tuple[int, Any]]
#: Opens a TCPStore server again on a given port: a restarted master reopens the running
#: round's store where its workers look for it. Raises when the port is taken.
StoreReopener = Callable[[int], Any]

#: Seconds a restarted master adds to every node's heartbeat timeout: what an agent may need
#: to find it (a request timing out on the dead address, 5 s, then a retry wait, 1 s).
_RESTORE_GRACE_S = 10.0
#: A save that waited longer than this for a free snapshot slot (seconds) is an event:
#: the storage writes slower than the job asks for persists.
_BACKPRESSURE_EVENT_S = 0.05
#: Seconds the restart ordered by an exception raised before the first step waits for the
#: other ranks' reports: when they all raised the same, the job stops instead (the script's error).
_SCRIPT_ERROR_WAIT_S = 10.0
#: How long a forming generation of the live world waits for a survivor that neither asked
#: for its place nor is known dead (seconds); it rejoins later, with its state.
_LIVE_STRAGGLER_S = 30.0
#: Strategies whose training state every data-parallel rank holds whole (a live peer can
#: give it to a replacement); any other (``fsdp``, ``mesh``, ``auto``) restarts every worker.
_REPLICATED_STRATEGIES = frozenset({"ddp", "amp", "compile", "checkpoint"})


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

    def __init__(
        self,
        job: JobSpec,
        job_id: str,
        *,
        store_host: str,
        store_factory: StoreFactory,
        storage: CheckpointStorage | None = None,
        relaunch: Callable[[NodeRelaunch], None] | None = None,
        log_dir: Path | None = None,
        emit: Callable[[JobEvent], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        journal: Journal | None = None,
        reopen_store: StoreReopener | None = None,
    ) -> None:
        self.job = job
        self.job_id = job_id
        self.store_host = store_host
        self._store_factory = store_factory
        self._stores: dict[int, tuple[int, Any]] = {}
        self._relaunch = relaunch
        self._relauncher = ThreadPoolExecutor(1, thread_name_prefix="dlrover-relaunch") if relaunch else None
        self._emit_hook = emit
        self._clock = clock
        self._lock = threading.RLock()
        self._events_file = open(log_dir / "events.jsonl", "a", buffering=1) if log_dir else None
        self.log_dir = log_dir
        self.rdzv = RendezvousManager(
            min_nodes=job.nodes.min, max_nodes=job.nodes.max, node_unit=job.nodes.node_unit,
            last_call_s=job.nodes.last_call_s, clock=clock,
        )
        self.nodes = NodeTable()
        self.required_round = 0
        self._succeeded_nodes: set[int] = set()
        self.state = JobState.PENDING
        self.reason = ""
        self.restarts = 0
        #: every failure reported, and whether it counted (took a restart: a restore after it is its recovery)
        self.failures: list[tuple[FailureRecord, bool]] = []
        self.metrics: dict[str, float] = {}
        self.goodput = GoodputTracker()
        self.rate = StepRate()  # rank 0's steps per second, samples/s, tokens/s and the ETA
        self._errors = DeterministicErrorDetector()
        self.node_checks = NodeChecks(store_factory=store_factory, store_host=store_host, clock=clock)
        self.journal = journal
        self._reopen_store = reopen_store
        self._version = 0  # snapshots taken (a newer one always wins in the journal)
        self._seq = 0  # node changes logged
        self._due: list[str] = []  # journal points decided in the current batch, not written yet
        self._deferred: list[Callable[[], None]] = []  # effects that wait for that write (relaunches)
        self._batch_depth = 0
        self._relaunching: dict[int, float] = {}  # node id -> when its relaunch was ordered, until it registers
        self._gone_why: dict[int, str] = {}  # node id -> why it left the job (for a below-min reason)
        self._held: tuple[int, float, int] | None = None  # (round, until, node): a restart awaiting a verdict
        self._whole_rounds_from = 0  # rounds this master heard from their start (a restored one: the next)
        self._last_token = 0  # the newest fencing token given to an agent
        self._assigned: dict[str, int] = {}  # launcher key -> node id handed out (AssignNode)
        self.live: LiveWorld | None = None  # the running round's live world (DESIGN §5a)
        self.live_why = self._live_blocker()  # why failures restart every worker ("": they need not)
        self._live_told = 0  # transitions of the live world already turned into events
        self._not_live_why = ""  # why the last failure restarted every worker instead
        self.started = clock()
        self.ended: float | None = None
        self.checkpoints = (
            CheckpointCoordinator(storage, keep_last=job.checkpoint.keep_last, event=self._checkpoint_event)
            if storage is not None else None
        )
        if self.checkpoints is not None and self.checkpoints.latest is not None:
            self.goodput.last_committed_step = self.checkpoints.latest

    # ----- helpers -------------------------------------------------------------------

    def _now(self) -> float:
        return self._clock() - self.started

    def _event(self, kind: str, /, **data: Any) -> None:
        event = JobEvent(kind=kind, job_id=self.job_id, time_s=self._now(), data=data, unix_time_s=time.time())
        if self._events_file is not None:
            self._events_file.write(json.dumps(event.to_dict()) + "\n")
        if self._emit_hook is not None:
            self._emit_hook(event)

    def _checkpoint_event(self, kind: str, /, **data: Any) -> None:
        if kind == "checkpoint_committed":
            self.goodput.add({"type": "checkpoint", "step": data["step"], "stall_s": 0.0, "committed": True})
        self._event(kind, **data)
        if kind == "checkpoint_committed":
            self._decided("step_committed")

    # ----- journal (write-ahead) ------------------------------------------------------

    @contextlib.contextmanager
    def _batch(self) -> Iterator[None]:
        """Hold the lock; decisions taken inside are journaled once, when the outermost batch
        ends (a tick that loses 1,000 nodes writes one snapshot), and their deferred effects
        run after that write."""
        with self._lock:
            self._batch_depth += 1
            try:
                yield
            finally:
                self._batch_depth -= 1
                if self._batch_depth == 0:
                    self._flush_journal()

    def _decided(self, point: str) -> None:
        """A decision the job must survive was taken (``point`` names it): journal it before
        it takes effect — now, or at the end of the current batch."""
        self._due.append(point)
        if self._batch_depth == 0:
            self._flush_journal()

    def _after_journal(self, effect: Callable[[], None]) -> None:
        """Run ``effect`` once the decisions taken so far are journaled."""
        if self._batch_depth == 0:
            self._flush_journal()
            effect()
        else:
            self._deferred.append(effect)

    def _flush_journal(self) -> None:
        due, self._due = self._due, []
        deferred, self._deferred = self._deferred, []
        if due and self.journal is not None:
            try:
                self.journal.write(self.snapshot(), points=dict.fromkeys(due))
            except OSError as exc:  # the job goes on; a master restart would lose this decision
                log.error("master_journal_failed", points=list(dict.fromkeys(due)), error=f"{type(exc).__name__}: {exc}")
        for effect in deferred:
            effect()

    def _note_node(self, node: NodeRecord, *, succeeded: bool = False, point: str | None = None) -> None:
        """Log one node's change (a line, not a snapshot) before the answer or the effect
        that follows it: registered, told its place, succeeded, exited, lost, excluded, its
        relaunch ordered. (A snapshot of 10,000 nodes per lost node would stall the master
        just when many are lost.)"""
        if self.journal is None:
            return
        self._seq += 1
        entry: dict[str, Any] = {"seq": self._seq, "node": node.to_journal(),
                                 "relaunching": node.node_id in self._relaunching,
                                 "gone_why": self._gone_why.get(node.node_id)}
        if succeeded:
            entry["succeeded"] = True
        try:
            self.journal.append(entry, point=point)
        except OSError as exc:
            log.error("master_journal_failed", node_id=node.node_id, error=f"{type(exc).__name__}: {exc}")

    def write_journal(self) -> bool:
        """Write a snapshot now, unless nothing changed since the last one (the periodic
        write for soft state: progress, metrics, goodput). Returns whether it wrote."""
        if self.journal is None:
            return False
        return self.journal.write(self.snapshot(), skip_unchanged=True)

    def _node(self, node_id: int) -> NodeRecord:
        return self.nodes.get_or_add(node_id, self._clock())

    def _action(self, round_index: int, node: NodeRecord | None = None) -> Action:
        if self.state.is_terminal or (node is not None and node.state == "excluded"):
            return Action.STOP
        if round_index < self.required_round:
            return Action.RESTART
        return Action.NONE

    def _finish(self, state: JobState, reason: str = "") -> None:
        if self.state.is_terminal:
            return
        self.state = state
        self.reason = reason
        self.ended = self._clock()
        self._held = None
        log.info("job_finished", state=state.value, reason=reason or None, restarts=self.restarts)
        self._event("job_finished", state=state.value, reason=reason, restarts=self.restarts)
        self._decided("job_finished")

    # ----- agent calls -----------------------------------------------------------------

    def assign_node(self, message: AssignNode) -> NodeAssigned:
        """A host's launcher (``dlrover run`` without ``--node-rank``) asks for its node id:
        the same ``key`` always gets the same id; a new key gets one past every id known
        (registered nodes, ids handed out). Answered ``stop`` when the job is over or
        ``rdzv_id`` names another job."""
        with self._lock:
            if message.rdzv_id and message.rdzv_id != self.job_id:
                return NodeAssigned(node_id=-1, job_id=self.job_id, action=Action.STOP,
                                    reason=f"the job master at this endpoint runs job {self.job_id!r}, not "
                                           f"{message.rdzv_id!r}: give every host the same --rdzv-id")
            if self.state.is_terminal:
                return NodeAssigned(node_id=-1, job_id=self.job_id, action=Action.STOP,
                                    reason=f"job {self.job_id} already ended {self.state.value}")
            node_id = self._assigned.get(message.key)
            if node_id is None:
                known = max(max(self.nodes, default=-1), max(self._assigned.values(), default=-1))
                node_id = self._assigned[message.key] = known + 1
                log.info("node_assigned", node_id=node_id, key=message.key)
            return NodeAssigned(node_id=node_id, job_id=self.job_id)

    def register(self, message: Register) -> Registered:
        """An agent starts for ``node_id``. It gets a new fencing token: from now on the
        node's earlier agents (frozen, partitioned, then back) are fenced — every call they
        make is answered "stop" and changes nothing — and the segments it names with the
        token are its own."""
        node_id, host, pid = message.node_id, message.host, message.pid
        with self._lock:
            node = self._node(node_id)
            if node.state != "excluded":
                node.state = "registered"
            node.host, node.pid = host, pid
            node.last_heartbeat = self._clock()
            self._last_token += 1  # (a counter: a scan of the node table per register is 10,000² at scale)
            node.token = self._last_token
            self._relaunching.pop(node_id, None)
            self._gone_why.pop(node_id, None)
            self._note_node(node)
            log.info("node_registered", node_id=node_id, host=host, pid=pid, token=node.token)
            return Registered(action=self._action(self.required_round, node), job_id=self.job_id, token=node.token)

    def fenced(self, node_id: int, token: int | None) -> bool:
        """Whether a call for ``node_id`` carrying ``token`` comes from an agent that was
        replaced (a newer agent of that node registered). Calls without a token are not
        fenced."""
        if token is None:
            return False
        with self._lock:
            return self._fenced(node_id, token)

    def _fenced(self, node_id: int, token: int | None) -> bool:
        if token is None:
            return False
        node = self.nodes.get(node_id)
        stale = node is not None and node.token > token
        if stale:
            log.warning("agent_fenced", node_id=node_id, token=token, current=node.token)
        return stale

    def join(self, message: Join) -> Joined:
        node_id = message.node_id
        with self._lock:
            node = self._node(node_id)
            node.last_heartbeat = self._clock()
            if self._action(self.required_round, node) == Action.STOP:
                return Joined(action=Action.STOP)
            rnd = self.rdzv.latest
            if (rnd is not None and rnd.index >= self.required_round and node_id in rnd and node.state == "waiting"
                    and node.round < rnd.index and not self.rdzv.is_waiting(node_id)):
                return Joined(round=rnd.index)  # a join retried after it formed this round
            node.state = "waiting"
            index = self.rdzv.join(node_id, message.nproc)
            self.goodput.joined(self._clock())
            log.info("rendezvous_joined", node_id=node_id, round=index, waiting=self.rdzv.waiting_count)
            self._try_complete()
            return Joined(round=index)

    def poll(self, message: Poll) -> RoundAssignment:
        """Whether the round ``node_id`` waits for is complete; if so, its place in it."""
        node_id = message.node_id
        with self._lock:
            node = self._node(node_id)
            node.last_heartbeat = self._clock()
            if self._action(self.required_round, node) == Action.STOP:
                return RoundAssignment(state=PollState.STOP, action=Action.STOP)
            self._try_complete()
            order = self.node_checks.order(node_id)
            if order is not None:
                return order
            joining = self._live_join(node)
            if joining is not None:
                return joining
            rnd = self.rdzv.latest
            # placed: a member of the running round, not told yet (waiting), or told already
            # (running) but asking again: its answer was lost, e.g. with a master that died
            placed = (rnd is not None and rnd.index >= self.required_round and node_id in rnd
                      and not self.rdzv.is_waiting(node_id)
                      and ((node.state == "waiting" and node.round < rnd.index)
                           or (node.state == "running" and node.round == rnd.index)))
            if not placed:
                if not self.rdzv.is_waiting(node_id):  # e.g. the master restarted meanwhile
                    return RoundAssignment(state=PollState.REJOIN)
                return RoundAssignment(state=PollState.WAITING)
            assert rnd is not None
            store = self._stores.get(rnd.index)
            if store is None:  # the round's store died with the master before this one
                self._new_round(f"the store of round {rnd.index} died with the previous job master")
                return RoundAssignment(state=PollState.REJOIN)
            if node.state != "running":
                node.state, node.round = "running", rnd.index
                self._note_node(node, point="node_placed")
            port, _ = store
            node_rank = rnd.node_rank(node_id)
            return RoundAssignment(
                state=PollState.READY, round=rnd.index, node_rank=node_rank, num_nodes=len(rnd.node_ids),
                rank_offset=rnd.rank_offset(node_id), nproc=rnd.nproc[node_rank], world_size=rnd.world_size,
                store_host=self.store_host, store_port=port, restart_count=self.restarts,
                max_restarts=self.job.failure.max_restarts,
            )

    def heartbeat(self, message: Heartbeat) -> HeartbeatAnswer:
        node_id, round_index, token, pid = message.node_id, message.round, message.token, message.pid
        with self._lock:
            node = self._node(node_id)
            if self._fenced(node_id, token) or (token is None and pid is not None and node.pid and pid != node.pid):
                return HeartbeatAnswer(action=Action.STOP, fenced=True)  # a stale agent of a node that was relaunched
            node.last_heartbeat = self._clock()
            if node.state == "dead":  # came back: it must rejoin through rendezvous
                node.state = "registered"
            node.workers = dict(message.workers)
            if message.steps:
                node.steps.update(message.steps)
            for record in message.records:
                self._record(record)
            latest = self.rdzv.latest
            if round_index >= 0 and (latest is None or round_index > latest.index) and not self.state.is_terminal:
                self._unknown_round(node_id, round_index)
            self._check_saves(round_index, message.saves, message.steps)
            return HeartbeatAnswer(action=self._action(round_index, node))

    def _unknown_round(self, node_id: int, round_index: int) -> None:
        """An agent runs a round this master never formed (its predecessor died before the
        round reached the journal: a failed write). Its members cannot be told apart from
        the others, so every node restarts into a round numbered past it (not counted)."""
        log.warning("round_unknown", node_id=node_id, round=round_index,
                    known=self.rdzv.latest.index if self.rdzv.latest is not None else None)
        self.rdzv.restore(Round(index=round_index, node_ids=(), nproc=()))
        self.required_round = round_index + 1
        self.rdzv.open_round()
        self._event("membership_changed", round=self.required_round, reason=f"round {round_index} is unknown to the master")
        self._decided("membership_changed")

    def _record(self, record: dict[str, Any]) -> None:
        self.goodput.add(record, now=self._clock())
        self.rate.add(record)
        kind = record.get("type")
        if kind == "step":
            for k, v in (record.get("metrics") or {}).items():
                try:
                    self.metrics[k] = float(v)
                except (TypeError, ValueError):
                    pass
        elif kind == "checkpoint" and float(record.get("waited_s") or 0.0) > _BACKPRESSURE_EVENT_S:
            # a save waited for the storage (both snapshot slots were still being persisted)
            self._event("checkpoint_backpressure", step=record.get("step"), waited_s=record.get("waited_s"))
        elif kind == "restore":
            self._event("checkpoint_restored", step=record["step"], source=record.get("source"),
                        load_s=record.get("load_s"))
            self.failures = [
                (attrs.evolve(f, restored_step=int(record["step"]), restored_from=record.get("source"))
                 if f.restored_step is None and counted else f, counted)
                for f, counted in self.failures]

    # ----- checkpoints -------------------------------------------------------------------

    def _coordinator(self) -> CheckpointCoordinator:
        if self.checkpoints is None:
            raise ValueError("this master does not coordinate checkpoints (no storage)")
        return self.checkpoints

    def checkpoint_shard(self, message: ShardReport) -> ShardAnswer:
        """A rank's shard of a step is durable in storage (written by incarnation
        ``message.round``)."""
        with self._lock:
            if self._fenced(message.node_id, message.token):
                return ShardAnswer(committed=self._coordinator().latest, stale=True, reason="fenced agent")
            return self._coordinator().shard_done(message)

    def checkpoint_error(self, message: CheckpointErrorReport) -> ActionAnswer:
        """Persisting a shard failed. A failed write (disk full, permission) is recorded and
        shown in the status; training goes on. A ``fatal`` one (a write stuck past
        ``checkpoint.persist_timeout_s``, or a final checkpoint that is not durable) ends
        the job FAILED with the saver's reason, which names the storage, the step and the
        error — no node is blamed for it."""
        with self._lock:
            if self._fenced(message.node_id, message.token):
                return ActionAnswer(action=Action.STOP)
            self._event("checkpoint_persist_failed", node_id=message.node_id, rank=message.rank, step=message.step,
                        error=message.error, storage=message.storage, fatal=bool(message.fatal))
            if self.checkpoints is not None:
                self.checkpoints.persist_failed(message)
            if message.fatal:
                self._finish(JobState.FAILED, message.error)
            return ActionAnswer(action=self._action(self.required_round))

    def restore_plan(self, message: RestorePlanRequest) -> RestoreDecision:
        """A rank's snapshots in memory; answers the restore decision once every rank reported."""
        with self._lock:
            coordinator = self._coordinator()
            before = coordinator.restore_count
            answer = coordinator.restore_plan(message)
            if coordinator.restore_count != before:  # the lineage changed: a restarted master must know it
                self._decided("restore_decided")
            return answer

    def restore_verify(self, message: RestoreVerify) -> RestoreVerifyAnswer:
        """A rank checked its shard of the storage step it is about to load (``ok`` or
        ``error``); answers ``waiting`` / ``ok`` / ``retry`` (with an older step) / ``failed``."""
        with self._lock:
            coordinator = self._coordinator()
            before = coordinator.restore_count
            answer = coordinator.verify(message)
            if coordinator.restore_count != before:
                self._decided("restore_decided")
            return answer

    def _check_saves(self, round_index: int, saves: dict[int, tuple[int, ...]], steps: dict[int, int]) -> None:
        """Fold ranks' storage saves and progress into the same-steps rule; a violation
        fails the job at once (the step can never be committed)."""
        if self.checkpoints is None or self.state.is_terminal or round_index < 0:
            return
        if round_index < self._whole_rounds_from:
            return  # a master that died heard part of this round's saves (heartbeats are not journaled)
        if self.live is not None and self.live.round == round_index and self.live.generation > 0:
            return  # ranks changed hands in the live world: a rank's saves and steps span processes
        for rank, saved in saves.items():
            self.checkpoints.note_saves(round_index, rank, saved)
        for rank, step in steps.items():
            self.checkpoints.note_progress(round_index, rank, step)
        if saves or steps:
            problem = self.checkpoints.misuse(round_index)
            if problem is not None:
                self._finish(JobState.FAILED, problem)

    # ----- failures ----------------------------------------------------------------------

    def failure(self, message: FailureReport, *, lost: bool = False) -> ActionAnswer:
        """Workers of a node failed (or the node was lost) in a round; decide restart or stop.
        (``lost``: the master's own report of a node it declared lost; a node-level report
        from outside, a scheduler's, is evidence that the node is lost.)

        An exception every rank raised before its first step is the script's: the job stops
        after this round, with its type and message, and no node is blamed. So that every
        rank gets to report it, the restart ordered by the first such report waits (up to
        ``_SCRIPT_ERROR_WAIT_S``) for the others'."""
        node_id, round_index, failures = message.node_id, message.round, message.failures
        with self._batch():
            node = self._node(node_id)
            if not lost and failures and message.token is None and all(f.kind == "node_lost" for f in failures):
                # evidence from the scheduler that the node is gone (its agent process exited;
                # a scheduler's other node-level reports, a pod's or a job step's, go on below):
                # act now, not after failure.heartbeat_timeout_s of silence; an agent that
                # exited because its node was done (succeeded, exited, excluded) is no failure
                if node.state in ("running", "waiting", "registered") and not self.state.is_terminal:
                    self._lose(node, max(0.0, self._clock() - node.last_heartbeat), why=failures[0].detail)
                return ActionAnswer(action=self._action(round_index, node))
            if not node.gone:
                node.last_heartbeat = self._clock()
            current = self.rdzv.latest
            consequence = (self.state.is_terminal or current is None or round_index < self.required_round
                           or round_index != current.index)
            held = not consequence and self._held is not None and self._held[0] == round_index
            script = bool(failures) and all(before_first_step(f.exception) for f in failures)
            replaced = False
            self._not_live_why = ""
            world = current.world_size if current is not None else 0
            verdicts = [self._errors.record(round_index, world, f.rank, f.exception) for f in failures]
            verdict = next(((v, f.exception) for v, f in zip(verdicts, failures, strict=True) if v), None)
            ended = self.state.is_terminal  # (a worker of a cancelled job failing as its peers stop)
            if ended:
                action = f"none: the job had already ended {self.state.value}"
            elif consequence:
                action = f"none: round {round_index} was already being restarted"
            elif held:
                action = f"none: round {round_index} already failed (its restart waits for the other ranks)"
                if verdict is None and not script:  # not the script's error after all: restart now
                    self._release_held()
            elif verdict is not None:  # every rank of the round reported the same error in this call
                action = "stopped the job: the error is not retryable"
            elif not script and (live_action := self._live_failure(node, round_index, failures)) is not None:
                action = live_action
                replaced = True
            else:
                node.failed(self._now())
                silent = max((f.silent_s for f in failures), default=0.0)
                self.goodput.failed(self._clock(), silent_s=silent)
                if self.restarts < self.job.failure.max_restarts:
                    self.restarts += 1
                    if script and verdict is None:
                        self._held = (round_index, self._clock() + _SCRIPT_ERROR_WAIT_S, node_id)
                        action = (f"restart {self.restarts}/{self.job.failure.max_restarts} ordered once the other "
                                  "ranks reported (an exception before the first step may be the script's)")
                        log.info("restart_held", round=round_index, node_id=node_id, wait_s=_SCRIPT_ERROR_WAIT_S)
                    else:
                        self._order_restart(round_index)
                        action = (f"restarted all workers (round {self.required_round}, "
                                  f"restart {self.restarts}/{self.job.failure.max_restarts})"
                                  + (f"; not live: {self._not_live_why}" if self._not_live_why else ""))
                else:
                    reason = (f"restart budget exhausted (failure.max_restarts={self.job.failure.max_restarts}) "
                              f"by {self.nodes.blame()}; "
                              f"root cause: {self._first_of_round(round_index, node_id, failures)}")
                    action = "stopped the job: restart budget exhausted"
                    self._finish(JobState.FAILED, reason)
            counted = not consequence and not held and verdict is None
            reported_at = time.time()
            for f in failures:
                rec = failure_record(f, time_s=self._now(), round_index=round_index, node_id=node_id,
                                     step=self.goodput.last_step, last_committed_step=self.goodput.last_committed_step,
                                     action=action, reported_at=reported_at)
                if counted and not self.state.is_terminal:
                    rec = attrs.evolve(rec, recovery="live" if replaced else (
                        "restart_all" if round_index < self.required_round or self._held is not None else ""))
                # the result lists the job's failures, not what its end caused (a cancel); after
                # a failure that ended the job, its peers' reports may hold the root cause
                if not ended or self.state == JobState.FAILED:
                    self.failures.append((rec, counted))
                log.warning("worker_failed", node_id=node_id, rank=rec.rank, kind=rec.kind, detail=rec.detail,
                            step=rec.step, action=action)
                self._event("worker_failed", **{("failure_kind" if k == "kind" else k): v
                                                for k, v in encode(rec).items()})
            self._mark_root_causes()
            if counted and not self.state.is_terminal and round_index < self.required_round:
                self._event("workers_restarted", round=self.required_round, restarts=self.restarts)
            if verdict is not None and not self.state.is_terminal:
                kind, exc = verdict
                if kind == "script" and self._held is not None and self._held[0] == round_index:
                    blamed = self.nodes.get(self._held[2])
                    if blamed is not None and blamed.failures > 0:
                        blamed.failures -= 1  # the script's error, not its node's
                when = ("before its first step (at import or start-up): an error of the script, not of a node"
                        if kind == "script" else f"at step {exc.step}, in two failing rounds in a row")
                self._finish(JobState.FAILED, (
                    f"not retryable: every rank raised {exc.exc_type}: {exc.message} {when}; "
                    f"restarting cannot help.\n{exc.traceback}").rstrip())
            elif counted and not self.state.is_terminal and self._held is None and self._too_many_failures(node):
                self._exclude(node, self._failures_why(node))
            if replaced and not self.state.is_terminal:
                return ActionAnswer(action=Action.REPLACE)
            return ActionAnswer(action=self._action(round_index, node))

    def _mark_root_causes(self) -> None:
        marked = mark_root_causes([f for f, _ in self.failures])
        self.failures = [(m, counted) for m, (_, counted) in zip(marked, self.failures, strict=True)]

    def _first_of_round(self, round_index: int, node_id: int, failures: Sequence[WorkerFailure]) -> str:
        """The first failure of ``round_index`` known now (by when it happened, as
        :func:`mark_root_causes` orders them): ``failures``, just reported by ``node_id``, or
        one reported before, in words."""
        now = time.time()
        seen = [(f.unix_time_s if f.unix_time_s is not None else now, f.rank, node_id, describe(f), f.exit_code)
                for f in failures]
        seen += [(r.unix_time_s if r.unix_time_s is not None else now, r.rank, r.node_id, r.detail, r.exit_code)
                 for r, _ in self.failures if r.round == round_index and r.recovery != "live"]
        _, rank, node, text, code = min(seen, key=lambda t: t[0])
        return f"rank {rank} on node {node}, {text}" + (f" (exit code {code})" if code is not None else "")

    def _order_restart(self, round_index: int) -> None:
        """Every worker restarts into the round after ``round_index`` (the restart is counted
        by the caller)."""
        self.required_round = round_index + 1
        self.rdzv.open_round()
        self._close_live("every worker restarts")
        self._decided("restart_decided")

    def _release_held(self) -> None:
        """Order the restart a failure before the first step held back: the other ranks did
        not all raise the same (or did not report in time)."""
        if self._held is None:
            return
        round_index, _, node_id = self._held
        self._held = None
        if self.state.is_terminal or round_index < self.required_round:
            return
        self._order_restart(round_index)
        log.info("restart_released", round=round_index, node_id=node_id)
        self._event("workers_restarted", round=self.required_round, restarts=self.restarts)
        node = self.nodes.get(node_id)
        if node is not None and not node.gone and self._too_many_failures(node):
            self._exclude(node, self._failures_why(node))

    def _too_many_failures(self, node: NodeRecord) -> bool:
        f = self.job.failure
        return node.recent_failures(self._now(), f.node_failure_window_s) >= f.max_node_failures

    def _failures_why(self, node: NodeRecord, *, lost: bool = False) -> str:
        f = self.job.failure
        recent = node.recent_failures(self._now(), f.node_failure_window_s)
        return (f"{'lost' if lost else 'it failed'} {recent} times in {f.node_failure_window_s:g} s "
                f"(failure.max_node_failures={f.max_node_failures}, failure.node_failure_window_s="
                f"{f.node_failure_window_s:g})")

    def _exclude(self, node: NodeRecord, why: str) -> None:
        """Take a node out of the job for good and ask for a replacement."""
        node.state = "excluded"
        if self.live is not None:
            self.live.node_died(node.node_id)
        self._gone_why[node.node_id] = f"excluded: {why}"
        self.rdzv.leave(node.node_id)
        log.warning("node_excluded", node_id=node.node_id, reason=why)
        self._event("node_excluded", node_id=node.node_id, reason=why)
        replacement = max(self.nodes) + 1
        self._node(replacement).state = "registered"  # expected; silent until it starts
        self._note_node(node, point="node_excluded")
        self._start_relaunch(replacement, replaces=node.node_id, reason=f"node {node.node_id} excluded: {why}")

    def _start_relaunch(self, node_id: int, *, replaces: int | None = None, reason: str = "") -> None:
        if self._relauncher is None or self._relaunch is None:
            return
        cap = self.job.failure.max_restarts + self.job.nodes.max
        if self.nodes.relaunches() >= cap:
            self._finish(JobState.FAILED, f"gave up relaunching nodes after {cap} relaunches "
                                          "(failure.max_restarts + nodes.max)")
            return
        node = self._node(node_id)
        node.relaunches += 1
        node.last_heartbeat = self._clock()  # give the new agent a full timeout to start
        self._relaunching[node_id] = self._clock()
        log.info("node_relaunch", node_id=node_id, replaces=replaces)
        self._event("node_relaunched", node_id=node_id, replaces=replaces)
        self._note_node(node, point="relaunch_issued")
        relaunch, relauncher = self._relaunch, self._relauncher
        request = NodeRelaunch(node_id=node_id, replaces=replaces, reason=reason, attempt=node.relaunches - 1)

        def run() -> None:
            try:
                relaunch(request)
            except Exception as exc:  # the backend refused: the node stays missing
                log.error("node_relaunch_failed", node_id=node_id, error=f"{type(exc).__name__}: {exc}")
                with self._batch():
                    self._event("node_relaunch_failed", node_id=node_id, error=str(exc))
                    self._relaunching.pop(node_id, None)
                    self._gone_why.setdefault(node_id, f"its relaunch failed ({type(exc).__name__}: {exc})")
                    self._note_node(self._node(node_id))
                    self._check_below_min()

        self._after_journal(lambda: relauncher.submit(run))

    def succeeded(self, message: Succeeded) -> ActionAnswer:
        """Every worker of a node exited 0; the job succeeds when every node of the round did."""
        node_id, round_index = message.node_id, message.round
        with self._lock:
            node = self._node(node_id)
            node.last_heartbeat = self._clock()
            rnd = self.rdzv.latest
            if rnd is not None and round_index == rnd.index and round_index >= self.required_round:
                node.state = "succeeded"
                self._succeeded_nodes.add(node_id)
                self._note_node(node, succeeded=True, point="node_succeeded")
                log.info("node_succeeded", node_id=node_id, round=round_index)
                # (the size test first: the set test scans the round, once per node otherwise)
                needed = (rnd.node_ids if self.live is None or self.live.closed or self.live.round != rnd.index
                          else tuple(self.live.nodes()))
                if len(self._succeeded_nodes) >= len(needed) and self._succeeded_nodes.issuperset(needed):
                    problem = self.checkpoints.final_problem() if self.checkpoints is not None else None
                    lost = self.checkpoints.lost_steps() if self.checkpoints is not None else []
                    if problem is not None:  # never SUCCEEDED without the final checkpoint
                        self._finish(JobState.FAILED, problem)
                    elif lost:  # succeeded, but say what storage errors cost
                        error = self.checkpoints.last_persist_error  # type: ignore[union-attr]
                        self._finish(JobState.SUCCEEDED, (
                            f"final checkpoint committed (step {self.checkpoints.latest}); checkpoint steps "  # type: ignore[union-attr]
                            f"{lost} were not persisted (storage errors; last: {error}); see events.jsonl"))
                    else:
                        self._finish(JobState.SUCCEEDED)
            return ActionAnswer(action=self._action(round_index, node))

    def exited(self, message: Exited) -> ActionAnswer:
        """The agent of a node exited (the job ended for it, or it was stopped: scaled
        down, preempted). A member of the running round leaving makes the others restart
        into a round without it; too few nodes left fails the job at once."""
        node_id = message.node_id
        with self._batch():
            node = self._node(node_id)
            was = node.state
            if node.state != "excluded":
                node.state = "exited"
                self._gone_why[node_id] = "exited"
            self.rdzv.leave(node_id)
            self._note_node(node)
            rnd = self.rdzv.latest
            if (not self.state.is_terminal and rnd is not None and node_id in rnd and rnd.index >= self.required_round
                    and was in ("running", "waiting") and node_id not in self._succeeded_nodes):
                log.warning("node_exited_mid_round", node_id=node_id, round=rnd.index)
                live = self.live
                why = "not live"
                if live is not None and not live.closed and live.round == rnd.index:
                    live.node_died(node_id)
                    why = live.can_go_on()
                if why:
                    self._new_round(f"node {node_id} exited")
                else:  # the others go on without it (a membership change, not counted)
                    self._live_progress()
                    self._event("membership_changed", round=rnd.index, from_nodes=len(rnd.node_ids),
                                to_nodes=len(live.nodes()), reason=f"node {node_id} exited; the others go on live")
            self._check_below_min()
            return ActionAnswer(action=Action.STOP)

    def _new_round(self, why: str) -> None:
        """The running round cannot go on (a member left, its store is gone): every node
        restarts into a new round. A membership change, not counted as a failure."""
        rnd = self.rdzv.latest
        if self.state.is_terminal or rnd is None or rnd.index < self.required_round:
            return
        self.required_round = rnd.index + 1
        self.rdzv.open_round()
        self._close_live(why)
        log.info("membership_changed", round=self.required_round, reason=why)
        self._event("membership_changed", round=self.required_round, from_nodes=len(rnd.node_ids),
                    to_nodes=len(self.nodes.live()), reason=why)
        self._decided("membership_changed")

    def _coming(self) -> list[int]:
        """Gone nodes whose relaunch was ordered: they may come back."""
        return sorted(n for n in self._relaunching if n in self.nodes and self.nodes[n].state in ("dead", "exited"))

    def _check_below_min(self) -> None:
        """Fail the job at once when fewer than ``nodes.min`` nodes are live and no relaunch
        ordered can make up for it (before the first round, nodes may still be starting)."""
        rnd = self.rdzv.latest
        if self.state.is_terminal or rnd is None:
            return
        live = self.nodes.live()
        # members of the running round that finished need not come back for it to succeed
        done = (sum(1 for n in self._succeeded_nodes if self.nodes.is_gone(n))
                if rnd.index >= self.required_round else 0)
        if len(live) + len(self._coming()) + done >= self.job.nodes.min:
            return
        gone = [f"node {n} {why}" for n, why in sorted(self._gone_why.items()) if self.nodes.is_gone(n)]
        lost = any(self.nodes[n].state == "dead" for n in self._gone_why if n in self.nodes)
        cannot = "; the scheduler cannot relaunch nodes" if lost and self._relaunch is None else ""
        self._finish(JobState.FAILED, (
            f"{plural(len(live), 'live node')} < nodes.min={self.job.nodes.min} and none can come back: "
            f"{', '.join(gone) or 'no other node'}{cannot}; live: "
            f"{', '.join(f'node {n.node_id}' for n in sorted(live, key=lambda n: n.node_id)) or 'none'}"))

    def _waiting_message(self) -> str:
        """While a round must form with fewer live nodes than ``nodes.min``: what it waits
        for (empty otherwise)."""
        rnd = self.rdzv.latest
        if self.state.is_terminal or (rnd is not None and rnd.index >= self.required_round):
            return ""
        live = sorted(n.node_id for n in self.nodes.live())
        need = self.job.nodes.min - len(live)
        if need <= 0:
            return ""
        coming = self._coming()
        return (f"waiting for {plural(need, 'more node')}; live: "
                f"{', '.join(f'node {n}' for n in live) or 'none'} ({len(live)} < nodes.min={self.job.nodes.min})"
                + (f"; relaunching: {', '.join(f'node {n}' for n in coming)}" if coming else ""))

    def cancel(self, message: Cancel) -> ActionAnswer:
        """End the job CANCELLED with ``message.reason``."""
        with self._lock:
            self._finish(JobState.CANCELLED, message.reason or Cancel().reason)
            return ActionAnswer(action=Action.STOP)

    # ----- periodic work -----------------------------------------------------------------

    def _try_complete(self) -> Round | None:
        # a round forms only when one is required: the first, or after a restart order
        if self.state.is_terminal or self.rdzv.next_index > self.required_round or self.node_checks.run is not None:
            return None
        # the first round does not know who else will come: no early completion by "all
        # live nodes joined", only at max nodes or after the last call
        live = len(self.nodes.live()) if self.rdzv.latest is not None and self._need_live_count() else None
        if self.job.failure.node_check:
            chosen = self.rdzv.choose(live_nodes=live)
            if chosen is not None and self.node_checks.needed(chosen, self.required_round):
                self._start_check(chosen)
                return None
        rnd = self.rdzv.try_complete(live_nodes=live)
        if rnd is None:
            return None
        port, store = self._store_factory()
        self._stores[rnd.index] = (port, store)
        for old in [i for i in self._stores if i < rnd.index - 1]:
            del self._stores[old]  # drop the server of rounds long gone
        self._succeeded_nodes = set()
        self.required_round = rnd.index
        self._open_live(rnd, port, store)
        if self.state == JobState.PENDING:
            self.state = JobState.RUNNING
        self.goodput.round_completed(self._clock(), self.started)
        self.rate.round_started()
        log.info("rendezvous_completed", round=rnd.index, nodes=list(rnd.node_ids), world_size=rnd.world_size,
                 store_port=port)
        self._event("rendezvous_completed", round=rnd.index, node_ids=list(rnd.node_ids), world_size=rnd.world_size)
        self._decided("round_formed")
        return rnd

    # ----- recovery without stopping (DESIGN §5a) ------------------------------------------

    def _live_blocker(self) -> str:
        """Why this job's failures restart every worker (``""``: survivors can go on)."""
        if not self.job.failure.live_recovery:
            return "failure.live_recovery=False"
        if self.job.parallel is not None:
            for name, _ in self.job.parallel.strategies:
                if name not in _REPLICATED_STRATEGIES:
                    return (f"parallel strategy {name!r} shards the training state, so no live peer holds a "
                            "failed worker's part; every worker restarts from a checkpoint")
        return ""

    def _open_live(self, rnd: Round, port: int, store: Any) -> None:
        if self.live is not None:
            self.live.close(f"round {rnd.index} started")
        self.live, self._live_told = None, 0
        if self.live_why or store is None or not hasattr(store, "set"):
            return
        members = [(nid, lr) for nid, n in zip(rnd.node_ids, rnd.nproc, strict=True) for lr in range(n)]
        self.live = LiveWorld(round_index=rnd.index, members=members, store_host=self.store_host, store_port=port,
                              set_key=lambda key: store.set(key, "1"), clock=self._clock,
                              straggler_timeout_s=_LIVE_STRAGGLER_S)

    def _live_join(self, node: NodeRecord) -> RoundAssignment | None:
        """A node waiting to join while the live world runs without it (relaunched after it
        was lost, or a replacement of an excluded one) joins that world: its workers start as
        replacements. ``None``: the rendezvous decides as usual."""
        live, rnd = self.live, self.rdzv.latest
        if (live is None or live.closed or rnd is None or rnd.index != live.round or rnd.index < self.required_round
                or not self.rdzv.is_waiting(node.node_id) or live.has_node(node.node_id) or live.can_go_on()):
            return None  # (can_go_on: every member loops with train.steps(), or the rendezvous decides)
        nproc = self.job.nodes.nproc_per_node if isinstance(self.job.nodes.nproc_per_node, int) else rnd.nproc[0]
        if len(live.nodes()) >= self.job.nodes.max:
            return None
        store = self._stores.get(rnd.index)
        if store is None:
            return None
        self.rdzv.leave(node.node_id)
        node.state, node.round = "running", rnd.index
        self._note_node(node, point="node_placed")
        log.info("live_node_joining", node_id=node.node_id, round=rnd.index, nproc=nproc)
        self._event("live_node_joining", node_id=node.node_id, round=rnd.index)
        # the workers' RANK/WORLD_SIZE until train.steps() gives them their place: their
        # slots' at the round's start (a node new to the round: after every other)
        if node.node_id in rnd:
            node_rank, offset, world_size = rnd.node_rank(node.node_id), rnd.rank_offset(node.node_id), rnd.world_size
        else:
            node_rank, offset, world_size = len(rnd.node_ids), rnd.world_size, rnd.world_size + nproc
        return RoundAssignment(
            state=PollState.READY, round=rnd.index, node_rank=node_rank, num_nodes=len(rnd.node_ids),
            rank_offset=offset, nproc=nproc, world_size=world_size, store_host=self.store_host,
            store_port=store[0], restart_count=self.restarts, max_restarts=self.job.failure.max_restarts,
            live_join=True)

    def _close_live(self, why: str) -> None:
        if self.live is not None and not self.live.closed:
            self.live.close(why)

    def live_reform(self, message: LiveReform) -> LiveAssignment:
        """A worker asks for its place in the live world's next generation (or says it is
        ready to be re-formed): see :mod:`~dlrover_core.master.live`."""
        with self._batch():
            if self.state.is_terminal:
                return LiveAssignment(state="stop", reason=f"the job ended {self.state.value}")
            live = self.live
            if live is None or live.round != message.round or message.round < self.required_round:
                return LiveAssignment(state="restart", reason=self.live_why or "every worker restarts into a new round")
            answer = live.reform(message)
            self._live_progress()
            return answer

    def _live_progress(self) -> None:
        """Turn newly formed generations into events; a new generation's ranks save anew."""
        live = self.live
        if live is None:
            return
        for t in live.transitions[self._live_told:]:
            self._event("live_reformed", round=live.round, generation=t.generation, world_size=t.world_size,
                        reason=t.reason, wait_s=round(t.time - t.opened, 4))
        self._live_told = len(live.transitions)

    def _live_failure(self, node: NodeRecord, round_index: int, failures: Sequence[WorkerFailure]) -> str | None:
        """Replace the failed workers while the others go on, if the live world allows it;
        returns the action taken (``None``: restart every worker instead, and why is logged)."""
        live = self.live
        self._not_live_why = self.live_why
        if live is None or live.round != round_index:
            return None
        if self.restarts >= self.job.failure.max_restarts:
            return None
        if not all(f.replaceable for f in failures):
            why = "workers hang and their agent cannot tell which process the others wait on"
            live.close(why)
            self._not_live_why = why
            log.info("live_recovery_unavailable", round=round_index, reason=why)
            self._event("live_recovery_unavailable", round=round_index, reason=why)
            return None
        if any(f.local_rank is None for f in failures):  # the node itself: every worker on it
            live.node_died(node.node_id)
        else:
            for f in failures:
                live.worker_died((node.node_id, int(f.local_rank)))  # type: ignore[arg-type]
        why = live.can_go_on()
        if why:
            live.close(why)
            self._not_live_why = why
            log.info("live_recovery_unavailable", round=round_index, reason=why)
            self._event("live_recovery_unavailable", round=round_index, reason=why)
            return None
        self.restarts += 1
        node.failed(self._now())
        self._live_progress()
        survivors = len(live.survivors())
        what = (f"node {node.node_id} relaunched" if any(f.rank is None for f in failures)
                else f"rank {', '.join(str(f.rank) for f in failures)} replaced")
        return (f"live: {survivors} survivor(s) go on; {what}, rejoining with their state "
                f"(restart {self.restarts}/{self.job.failure.max_restarts})")

    def _need_live_count(self) -> bool:
        """Whether the round being formed could complete early because every live node
        waits: only then does it need the count of live nodes, a scan of the node table that
        every poll of a 10,000-node rendezvous would otherwise pay."""
        waiting = self.rdzv.waiting_count
        return (self.rdzv.min_nodes <= waiting < self.rdzv.max_nodes
                and self._clock() - self.rdzv.last_join < self.rdzv.last_call_s)

    # ----- node checks ---------------------------------------------------------------------

    def _start_check(self, nodes: list[int]) -> None:
        run = self.node_checks.start(nodes)
        log.info("node_check_started", nodes=run.nodes, groups=run.groups)
        self._event("node_check_started", nodes=run.nodes, groups=run.groups)

    def node_check(self, message: NodeCheckReport) -> ActionAnswer:
        """A node's result of a node-check round."""
        with self._lock:
            if self.node_checks.report(message):
                self._advance_check()
            return ActionAnswer()

    def _advance_check(self, *, timed_out: bool = False) -> None:
        """Go on with the node check; when it is over, exclude the faulty nodes (and the
        stragglers, if asked)."""
        verdict = self.node_checks.advance(self.required_round, timed_out=timed_out)
        if verdict is None:
            return
        best = {str(k): round(v, 3) for k, v in verdict.best_s.items()}
        log.info("node_check_finished", faulty=verdict.faulty, stragglers=verdict.stragglers, best_s=best)
        self._event("node_check_finished", faulty=verdict.faulty, stragglers=verdict.stragglers, best_s=best)
        for n in verdict.faulty:
            self._exclude(self._node(n), "it failed the node check twice")
        if self.job.failure.exclude_stragglers:
            for n in verdict.stragglers:
                self._exclude(self._node(n), f"it is a straggler (node check {verdict.best_s[n]:.2f} s, over twice "
                                             "the median)")

    def _lose(self, node: NodeRecord, silent_s: float, *, why: str = "") -> None:
        """``node`` is gone: silent for ``silent_s`` (or ``why``: its scheduler saw its agent exit)."""
        why = why or f"no heartbeat for {silent_s:.0f} s"
        node.state = "dead"
        self._gone_why[node.node_id] = f"lost ({why})"
        self.rdzv.leave(node.node_id)
        log.warning("node_lost", node_id=node.node_id, silent_s=round(silent_s, 1), reason=why)
        self._event("node_lost", node_id=node.node_id, reason=why)
        rnd = self.rdzv.latest
        member = rnd is not None and (node.node_id in rnd or (self.live is not None and self.live.has_node(node.node_id)))
        if rnd is not None and member and rnd.index >= self.required_round:
            self.failure(FailureReport(node_id=node.node_id, round=rnd.index, failures=(
                WorkerFailure(kind="node_lost", detail=why),)), lost=True)
        else:
            node.failed(self._now())
        self._note_node(node, point="node_lost")
        if self.state.is_terminal or node.state == "excluded":
            return
        if self._too_many_failures(node):
            self._exclude(node, self._failures_why(node, lost=True))
        elif self._relaunch is not None:
            self._start_relaunch(node.node_id, replaces=node.node_id, reason=f"node {node.node_id} was lost")
        else:
            self._check_below_min()

    def _maybe_scale_up(self, now: float) -> None:
        """Nodes wait while a smaller-than-max round runs: restart into a bigger round."""
        rnd = self.rdzv.latest
        if (self.state != JobState.RUNNING or rnd is None or rnd.index < self.required_round
                or not self.rdzv.waiting_count or len(rnd.node_ids) >= self.job.nodes.max
                or now - self.rdzv.last_join < self.job.nodes.last_call_s):
            return
        waiting = self.rdzv.waiting
        unit = self.job.nodes.node_unit
        bigger = min(self.job.nodes.max, len(rnd.node_ids) + len(waiting)) // unit * unit
        if bigger <= len(rnd.node_ids):
            return
        self.required_round = rnd.index + 1
        self.rdzv.open_round()
        self._close_live(f"the job grows to {bigger} nodes")
        log.info("membership_changed", round=self.required_round, nodes=len(rnd.node_ids), to=bigger, waiting=waiting)
        self._event("membership_changed", round=self.required_round, from_nodes=len(rnd.node_ids), to_nodes=bigger,
                    waiting=waiting)
        self._decided("membership_changed")

    def tick(self) -> None:
        """Complete a due round; declare silent nodes lost; scale up; time out a stuck
        rendezvous; order a restart held for the other ranks' reports once its wait is over."""
        with self._batch():
            if self.state.is_terminal:
                return
            self._try_complete()
            if self.live is not None:
                self.live.tick()
                self._live_progress()
            now = self._clock()
            if self._held is not None and now > self._held[1]:
                self._release_held()
            timeout = self.job.heartbeat_timeout_s
            for node in list(self.nodes.values()):
                silent = now - node.last_heartbeat
                if not node.gone and silent > timeout:
                    if node.node_id in self._relaunching:  # ordered, never registered: maybe never issued
                        log.warning("node_relaunch_unanswered", node_id=node.node_id, silent_s=round(silent, 1))
                        self._start_relaunch(node.node_id, replaces=node.node_id,
                                             reason=f"the relaunch of node {node.node_id} was not answered")
                    else:
                        self._lose(node, silent)
            if self.state.is_terminal:
                return
            self._maybe_scale_up(now)
            if self.node_checks.timed_out():
                self._advance_check(timed_out=True)
            since = self.rdzv.forming_since
            join_timeout = self.job.nodes.join_timeout_s
            if since is not None and now - since > join_timeout and self.rdzv.next_index <= self.required_round:
                self._finish(JobState.FAILED, f"rendezvous round {self.rdzv.next_index} timed out after {join_timeout:g} s "
                                              f"with {len(self.rdzv.waiting)} waiting nodes (nodes.min={self.job.nodes.min})")

    # ----- journal (master restarts) ------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The master's durable state as JSON-safe data (heartbeat times excluded), with
        ``version`` (increasing) and ``seq`` (the last node change logged it includes)."""
        with self._lock:
            rnd = self.rdzv.latest
            self._version += 1
            store = self._stores.get(rnd.index) if rnd is not None else None
            return {
                "format": 2, "version": self._version, "seq": self._seq,
                "job_id": self.job_id, "elapsed_s": self._now(), "state": self.state.value,
                "reason": self.reason, "restarts": self.restarts, "required_round": self.required_round,
                "round": None if rnd is None else {"index": rnd.index, "node_ids": list(rnd.node_ids),
                                                   "nproc": list(rnd.nproc),
                                                   "store_port": store[0] if store is not None else None},
                "relaunching": sorted(self._relaunching), "gone_why": {str(k): v for k, v in self._gone_why.items()},
                "succeeded": sorted(self._succeeded_nodes),
                "nodes": self.nodes.to_journal(),
                "failures": [{**encode(f), "counted": counted} for f, counted in self.failures],
                "metrics": self.metrics, "goodput": self.goodput.to_dict(), "rate": self.rate.to_dict(),
                "pending_shards": self.checkpoints.pending_shards() if self.checkpoints else [],
                "checkpoints": self.checkpoints.to_dict() if self.checkpoints else {},
            }

    def restore(self, snap: dict[str, Any], entries: Sequence[dict[str, Any]] = ()) -> None:
        """Resume from :meth:`snapshot` and the node changes logged after it (``entries``,
        from :meth:`Journal.load`) after a restart. Agents keep their workers; they get a
        heartbeat timeout plus ``_RESTORE_GRACE_S`` to find this master. The running
        round's store is reopened on its port (else, if a node still needs it, a new round
        is opened); a relaunch ordered but not answered is issued again if its node does
        not register within a heartbeat timeout."""
        with self._batch():
            now = self._clock()
            self.started = now - float(snap["elapsed_s"])
            self.state, self.reason = JobState(snap["state"]), snap["reason"]
            self.restarts, self.required_round = snap["restarts"], snap["required_round"]
            self._version = max(self._version, int(snap.get("version", 0)))
            self._seq = max([int(snap.get("seq", 0)), *(int(e["seq"]) for e in entries)])
            r = snap["round"]
            rnd = None if r is None else Round(index=r["index"], node_ids=tuple(r["node_ids"]), nproc=tuple(r["nproc"]))
            self.rdzv.restore(rnd)
            self._whole_rounds_from = rnd.index + 1 if rnd is not None else 0
            self._succeeded_nodes = set(snap["succeeded"])
            self.nodes = NodeTable.from_journal([*snap["nodes"], *(e["node"] for e in entries)])  # later lines win
            self._gone_why = {int(k): v for k, v in (snap.get("gone_why") or {}).items()}
            relaunching = {int(n) for n in snap.get("relaunching") or ()}
            for entry in entries:
                node_id = int(entry["node"]["node_id"])
                if entry.get("succeeded"):
                    self._succeeded_nodes.add(node_id)
                if "relaunching" in entry:
                    (relaunching.add if entry["relaunching"] else relaunching.discard)(node_id)
                if entry.get("gone_why"):
                    self._gone_why[node_id] = entry["gone_why"]
                elif "gone_why" in entry:
                    self._gone_why.pop(node_id, None)
            self._last_token = max((n.token for n in self.nodes.values()), default=0)
            current = rnd if rnd is not None and rnd.index >= self.required_round else None
            for node in self.nodes.values():
                node.last_heartbeat = now + _RESTORE_GRACE_S
                untold = current is not None and node.node_id in current and node.round < current.index
                if node.state == "waiting" and not untold:  # it will poll again and find no round: make it rejoin
                    node.state = "registered"
            for node_id in sorted(relaunching):
                node = self._node(node_id)
                if node.state in ("dead", "exited"):
                    node.state = "registered"  # expected: silent until it starts (or relaunched again)
                node.last_heartbeat = now + _RESTORE_GRACE_S
                self._relaunching[node.node_id] = now
            port = r.get("store_port") if r is not None else None
            if current is not None and port and self._reopen_store is not None:
                try:
                    self._stores[current.index] = (int(port), self._reopen_store(int(port)))
                    log.info("round_store_reopened", round=current.index, port=port)
                except Exception as exc:  # taken meanwhile: a node that needs it opens a new round
                    log.warning("round_store_lost", round=current.index, port=port, error=f"{type(exc).__name__}: {exc}")
            self.failures = [(decode(FailureRecord, f), bool(f.get("counted"))) for f in snap["failures"]]
            self.metrics = snap["metrics"]
            self.goodput = GoodputTracker.from_dict(snap["goodput"])
            self.rate = StepRate.from_dict(snap.get("rate") or {})  # (a journal from before it: none)
            if self.checkpoints is not None:
                self.checkpoints.load_dict(snap.get("checkpoints") or {"pending_shards": snap["pending_shards"]})
            log.info("master_recovered", round=r["index"] if r else None, nodes=len(self.nodes), restarts=self.restarts,
                     logged_changes=len(entries))
            self._event("master_recovered", round=r["index"] if r else None, nodes=len(self.nodes))
            self._decided("master_recovered")

    # ----- views -------------------------------------------------------------------------

    def drained(self) -> bool:
        """The job is over and every registered agent has exited (or was declared dead)."""
        with self._lock:
            return self.state.is_terminal and all(n.gone for n in self.nodes.values())

    def status(self) -> MasterStatus:
        """The job's live status, with the node table (``/v1/status``)."""
        with self._lock:
            rnd = self.rdzv.latest
            g = self.goodput
            return MasterStatus(
                job_id=self.job_id, state=self.state,
                message=self.reason or self._waiting_message() or self._warning(),
                step=g.last_step, metrics=dict(self.metrics),
                # the running round's members still alive (not its size: a node that left is not counted)
                nodes=sum(1 for n in rnd.node_ids if self.nodes.is_live(n)) if rnd else 0,
                max_nodes=self.job.nodes.max, restarts=self.restarts, round=rnd.index if rnd else -1,
                elapsed_s=round(self._now(), 3), node_table=self.nodes.rows(),
                goodput=self.goodput.timeline(self._wall_s()),
                total_steps=self.rate.total_steps, step_time_s=_rounded(self.rate.step_time_s),
                eta_s=_rounded(self.rate.eta_s), samples_per_s=_rounded(self.rate.samples_per_s),
                tokens_per_s=_rounded(self.rate.tokens_per_s),
                root_cause=next((f for f, _ in reversed(self.failures) if f.root_cause), None),
            )

    def _warning(self) -> str:
        """A running job's storage trouble, for the status line (empty when none)."""
        error = self.checkpoints.persist_error if self.checkpoints is not None else None
        if error is None:
            return ""
        return (f"checkpoint storage failing: step {error.step} rank {error.rank}: {error.error} "
                f"(last commit: step {self.checkpoints.latest})")  # type: ignore[union-attr]

    def _wall_s(self) -> float:
        """Seconds from the master's start to the job's end (or now), never 0."""
        end = self.ended if self.ended is not None else self._clock()
        return max(end - self.started, 1e-9)

    def result(self) -> JobResult:
        with self._lock:
            wall = self._wall_s()
            g = self.goodput
            return JobResult(
                job_id=self.job_id,
                state=self.state if self.state.is_terminal else JobState.UNKNOWN,
                reason=self.reason, final_step=g.last_step, restarts=self.restarts, wall_time_s=wall,
                productive_s=g.productive_s, goodput=min(1.0, g.productive_s / wall),
                checkpoint_stall_s=g.checkpoint_stall_s, restore_s=g.restore_s, recomputed_s=g.recomputed_s,
                detection_s=g.phases["detection_s"], restart_s=g.phases["restart_s"],
                rendezvous_s=g.phases["rendezvous_s"], startup_s=g.phases["startup_s"],
                reform_s=g.phases["reform_s"], failures=tuple(f for f, _ in self.failures),
                metrics=dict(self.metrics), log_dir=str(self.log_dir or ""),
                worker_exit_codes=self._worker_exit_codes(), total_steps=self.rate.total_steps,
            )

    def _worker_exit_codes(self) -> dict[int, int]:
        """The exit code of each global rank's last worker, as far as this master knows: the
        failures' codes, then 0 for every worker of a node that reported success in the
        newest round (ranks as that round assigned them)."""
        codes = {f.rank: f.exit_code for f, _ in self.failures if f.rank is not None and f.exit_code is not None}
        rnd = self.rdzv.latest
        if rnd is not None:
            for node_id in sorted(self._succeeded_nodes):
                if node_id in rnd:
                    offset = rnd.rank_offset(node_id)
                    codes.update(dict.fromkeys(range(offset, offset + rnd.nproc[rnd.node_rank(node_id)]), 0))
        return dict(sorted(codes.items()))


def _rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)
