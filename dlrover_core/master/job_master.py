"""The JobMaster: node table, rendezvous rounds, restart budget, goodput and the job's fate.

All methods are thread-safe (one lock); the HTTP server calls them from its threads and a
ticker thread calls :meth:`JobMaster.tick` to complete rounds, notice silent nodes and
decide scale-ups.

Agents learn what to do from the ``action`` in every answer:

* ``"none"``: carry on;
* ``"restart"``: stop your workers and join the next rendezvous round;
* ``"stop"``: the job is over for you (it ended, or your node was excluded); stop and exit.

Decisions (DESIGN §5):

* the first failure of a round restarts every worker into the next round while the job-wide
  budget (``Failure.max_restarts``) lasts; later failures of the same round are its
  consequences and cost nothing;
* the same exception on every rank at the same step in two failing rounds in a row stops the
  job with the traceback (:class:`~dlrover_core.master.failures.DeterministicErrorDetector`);
* a node silent for ``Failure.heartbeat_timeout_s`` is lost: its workers' failure is
  counted, and the scheduler backend relaunches it; a node that failed
  ``Failure.max_node_failures`` times is excluded and replaced by a new node;
* with ``Failure(node_check=True)``, the nodes of a round about to form first run the
  accelerator's check in pairs (:mod:`~dlrover_core.master.node_check`); a faulty node is
  excluded and replaced, stragglers are reported (and excluded if asked);
* a round forms only when one is required; with ``Nodes(min < max)`` survivors go on without
  a lost node, and when nodes wait to join a running round that has fewer than ``max``, the
  job restarts into a bigger round (a membership change, not counted as a failure).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import attrs

from dlrover_core.events import JobEvent
from dlrover_core.logging import get_logger
from dlrover_core.master.checkpoints import CheckpointCoordinator
from dlrover_core.master.failures import DeterministicErrorDetector, describe, signal_name
from dlrover_core.master.goodput import GoodputTracker
from dlrover_core.master.node_check import NodeCheckRun
from dlrover_core.master.rendezvous import RendezvousManager, Round
from dlrover_core.result import FailureRecord, JobResult
from dlrover_core.schedulers.base import JobState
from dlrover_core.spec import Job
from dlrover_core.storage.base import CheckpointStorage

__all__ = ["JobMaster", "NodeRecord"]

log = get_logger()

#: Returns ``(port, store)`` of a fresh TCPStore server for a new round.
StoreFactory = Callable[[], tuple[int, Any]]

_GONE = ("dead", "exited", "excluded")


@attrs.define(kw_only=True)
class NodeRecord:
    """The master's view of one node (agent)."""

    node_id: int
    host: str = ""
    pid: int = 0
    state: str = "registered"  # registered | waiting | running | succeeded | exited | dead | excluded
    last_heartbeat: float = 0.0
    round: int = -1
    workers: dict[int, int] = attrs.field(factory=dict)  # rank -> pid
    steps: dict[int, int] = attrs.field(factory=dict)  # rank -> newest step
    failures: int = 0  # failures attributed to this node (its workers failed first, or it was lost)
    relaunches: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id, "host": self.host, "pid": self.pid, "state": self.state,
            "round": self.round, "workers": {str(k): v for k, v in self.workers.items()},
            "steps": {str(k): v for k, v in self.steps.items()}, "failures": self.failures,
            "relaunches": self.relaunches,
        }


#: The fields of a NodeRecord the journal keeps: all but ``last_heartbeat`` (a time of this process only).
_JOURNAL_FIELDS = tuple(a.name for a in attrs.fields(NodeRecord) if a.name != "last_heartbeat")


def _journal_dict(node: NodeRecord) -> dict[str, Any]:
    """``attrs.asdict(node)`` less ``last_heartbeat``, several times faster: it counts with
    10,000 nodes journalled every 0.5 s under the master's lock."""
    return {name: (dict(v) if isinstance(v := getattr(node, name), dict) else v) for name in _JOURNAL_FIELDS}


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
    """

    def __init__(
        self,
        job: Job,
        job_id: str,
        *,
        store_host: str,
        store_factory: StoreFactory,
        storage: CheckpointStorage | None = None,
        relaunch: Callable[[int], None] | None = None,
        log_dir: Path | None = None,
        emit: Callable[[JobEvent], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
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
        self.nodes: dict[int, NodeRecord] = {}
        self.required_round = 0
        self._succeeded_nodes: set[int] = set()
        self.state = JobState.PENDING
        self.reason = ""
        self.restarts = 0
        self.failures: list[dict[str, Any]] = []
        self.metrics: dict[str, float] = {}
        self.goodput = GoodputTracker()
        self._errors = DeterministicErrorDetector()
        self._check: NodeCheckRun | None = None
        self._check_store: tuple[int, Any] | None = None
        self._checked: dict[int, int] = {}  # node id -> the required round it passed the check for
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
        event = JobEvent(kind=kind, job_id=self.job_id, time_s=self._now(), data=data)
        if self._events_file is not None:
            self._events_file.write(json.dumps(event.to_dict()) + "\n")
        if self._emit_hook is not None:
            self._emit_hook(event)

    def _checkpoint_event(self, kind: str, /, **data: Any) -> None:
        if kind == "checkpoint_committed":
            self.goodput.add({"type": "checkpoint", "step": data["step"], "stall_s": 0.0, "committed": True})
        self._event(kind, **data)

    def _node(self, node_id: int) -> NodeRecord:
        node = self.nodes.get(node_id)
        if node is None:
            node = self.nodes[node_id] = NodeRecord(node_id=node_id, last_heartbeat=self._clock())
        return node

    def _action(self, round_index: int, node: NodeRecord | None = None) -> str:
        if self.state.is_terminal or (node is not None and node.state == "excluded"):
            return "stop"
        if round_index < self.required_round:
            return "restart"
        return "none"

    def _finish(self, state: JobState, reason: str = "") -> None:
        if self.state.is_terminal:
            return
        self.state = state
        self.reason = reason
        self.ended = self._clock()
        log.info("job_finished", state=state.value, reason=reason or None, restarts=self.restarts)
        self._event("job_finished", state=state.value, reason=reason, restarts=self.restarts)

    def _live_nodes(self) -> list[NodeRecord]:
        return [n for n in self.nodes.values() if n.state not in _GONE]

    # ----- agent calls -----------------------------------------------------------------

    def register(self, node_id: int, host: str, pid: int) -> dict[str, Any]:
        with self._lock:
            node = self._node(node_id)
            if node.state != "excluded":
                node.state = "registered"
            node.host, node.pid = host, pid
            node.last_heartbeat = self._clock()
            log.info("node_registered", node_id=node_id, host=host, pid=pid)
            return {"action": self._action(self.required_round, node), "job_id": self.job_id}

    def join(self, node_id: int, nproc: int) -> dict[str, Any]:
        with self._lock:
            node = self._node(node_id)
            node.last_heartbeat = self._clock()
            if self._action(self.required_round, node) == "stop":
                return {"action": "stop"}
            node.state = "waiting"
            index = self.rdzv.join(node_id, nproc)
            self.goodput.joined(self._clock())
            log.info("rendezvous_joined", node_id=node_id, round=index, waiting=self.rdzv.waiting_count)
            self._try_complete()
            return {"action": "none", "round": index}

    def poll(self, node_id: int) -> dict[str, Any]:
        """Whether the round ``node_id`` waits for is complete; if so, its place in it."""
        with self._lock:
            node = self._node(node_id)
            node.last_heartbeat = self._clock()
            if self._action(self.required_round, node) == "stop":
                return {"state": "stop", "action": "stop"}
            self._try_complete()
            order = self._check_order(node_id)
            if order is not None:
                return order
            rnd = self.rdzv.latest
            if rnd is None or node_id not in rnd or rnd.index < self.required_round or node.state != "waiting":
                if not self.rdzv.is_waiting(node_id):  # e.g. the master restarted meanwhile
                    return {"state": "rejoin", "action": "none"}
                return {"state": "waiting", "action": "none"}
            node.state, node.round = "running", rnd.index
            port, _ = self._stores[rnd.index]
            return {
                "state": "ready", "action": "none", "round": rnd.index,
                "node_rank": rnd.node_rank(node_id), "num_nodes": len(rnd.node_ids),
                "rank_offset": rnd.rank_offset(node_id), "nproc": rnd.nproc[rnd.node_rank(node_id)],
                "world_size": rnd.world_size, "store_host": self.store_host, "store_port": port,
                "restart_count": self.restarts, "max_restarts": self.job.failure.max_restarts,
            }

    def heartbeat(
        self,
        node_id: int,
        round_index: int,
        *,
        workers: dict[int, int] | None = None,
        steps: dict[int, int] | None = None,
        records: list[dict[str, Any]] | None = None,
        pid: int | None = None,
    ) -> dict[str, Any]:
        with self._lock:
            node = self._node(node_id)
            if pid is not None and node.pid and pid != node.pid:
                return {"action": "stop"}  # a stale agent of a node that was relaunched
            node.last_heartbeat = self._clock()
            if node.state == "dead":  # came back: it must rejoin through rendezvous
                node.state = "registered"
            if workers is not None:
                node.workers = dict(workers)
            if steps:
                node.steps.update(steps)
            for record in records or ():
                self._record(record)
            return {"action": self._action(round_index, node)}

    def _record(self, record: dict[str, Any]) -> None:
        self.goodput.add(record, now=self._clock())
        kind = record.get("type")
        if kind == "step":
            for k, v in (record.get("metrics") or {}).items():
                try:
                    self.metrics[k] = float(v)
                except (TypeError, ValueError):
                    pass
        elif kind == "restore":
            self._event("checkpoint_restored", step=record["step"], source=record.get("source"),
                        load_s=record.get("load_s"))
            for f in self.failures:
                if f["restored_step"] is None and f["counted"]:
                    f["restored_step"], f["restored_from"] = int(record["step"]), record.get("source")

    # ----- checkpoints -------------------------------------------------------------------

    def _coordinator(self) -> CheckpointCoordinator:
        if self.checkpoints is None:
            raise ValueError("this master does not coordinate checkpoints (no storage)")
        return self.checkpoints

    def checkpoint_shard(self, body: dict[str, Any]) -> dict[str, Any]:
        """A rank's shard of a step is durable in storage."""
        with self._lock:
            return self._coordinator().shard_done(step=int(body["step"]), rank=int(body["rank"]),
                                                  world_size=int(body["world_size"]), info=body)

    def checkpoint_error(self, body: dict[str, Any]) -> dict[str, Any]:
        """Persisting a shard failed (disk full, permission...): record it; training goes on."""
        with self._lock:
            self._event("checkpoint_persist_failed", **{k: body.get(k) for k in ("node_id", "rank", "step", "error")})
            return {"action": "none"}

    def restore_plan(self, body: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            return self._coordinator().restore_plan(
                round_index=int(body["round"]), rank=int(body["rank"]), world_size=int(body["world_size"]),
                memory_steps=[int(s) for s in body.get("memory_steps") or []])

    # ----- failures ----------------------------------------------------------------------

    def failure(self, node_id: int, round_index: int, failures: list[dict[str, Any]]) -> dict[str, Any]:
        """Workers of ``node_id`` failed (or the node was lost) in round ``round_index``;
        decide restart or stop."""
        with self._lock:
            node = self._node(node_id)
            if node.state not in _GONE:
                node.last_heartbeat = self._clock()
            current = self.rdzv.latest
            consequence = (self.state.is_terminal or current is None or round_index < self.required_round
                           or round_index != current.index)
            if consequence:
                action = f"none: round {round_index} was already being restarted"
            else:
                node.failures += 1
                self.goodput.failed(self._clock())
                if self.restarts < self.job.failure.max_restarts:
                    self.restarts += 1
                    self.required_round = round_index + 1
                    self.rdzv.open_round()
                    action = (f"restarted all workers (round {self.required_round}, "
                              f"restart {self.restarts}/{self.job.failure.max_restarts})")
                else:
                    last = failures[-1]
                    reason = (f"restart budget exhausted (failure.max_restarts={self.job.failure.max_restarts}); "
                              f"last failure: rank {last.get('rank')} on node {node_id}, {describe(last)}"
                              + (f" (exit code {last.get('exit_code')})" if last.get("exit_code") is not None else ""))
                    action = "stopped the job: restart budget exhausted"
                    self._finish(JobState.FAILED, reason)
            world = current.world_size if current is not None else 0
            deterministic = None
            for f in failures:
                rec = {
                    "time_s": self._now(), "round": round_index, "node_id": node_id,
                    "rank": f.get("rank"), "local_rank": f.get("local_rank"), "exit_code": f.get("exit_code"),
                    "signal": signal_name(f.get("exit_code")), "step": self.goodput.last_step,
                    "last_committed_step": self.goodput.last_committed_step, "action": action,
                    "restored_step": None, "restored_from": None, "counted": not consequence,
                    "kind": f.get("kind") or ("signal" if signal_name(f.get("exit_code")) else "exit"),
                    "detail": describe(f),
                }
                self.failures.append(rec)
                log.warning("worker_failed", node_id=node_id, rank=rec["rank"], kind=rec["kind"], detail=rec["detail"],
                            step=rec["step"], action=action)
                self._event("worker_failed", **{("failure_kind" if k == "kind" else k): v
                                                for k, v in rec.items() if k != "counted"})
                if self._errors.record(round_index, world, f.get("rank"), f.get("exception")):
                    deterministic = f["exception"]
            if not consequence and not self.state.is_terminal:
                self._event("workers_restarted", round=self.required_round, restarts=self.restarts)
            if deterministic is not None and not self.state.is_terminal:
                self._finish(JobState.FAILED, (
                    f"not retryable: every rank raised {deterministic['exc_type']}: {deterministic['message']} "
                    f"at step {deterministic['step']}, in two failing rounds in a row; restarting cannot help.\n"
                    f"{deterministic.get('traceback', '')}").rstrip())
            elif not consequence and not self.state.is_terminal and node.failures >= self.job.failure.max_node_failures:
                self._exclude(node, f"it failed {node.failures} times (failure.max_node_failures="
                                    f"{self.job.failure.max_node_failures})")
            return {"action": self._action(round_index, node)}

    def _exclude(self, node: NodeRecord, why: str) -> None:
        """Take a node out of the job for good and ask for a replacement."""
        node.state = "excluded"
        self.rdzv.leave(node.node_id)
        log.warning("node_excluded", node_id=node.node_id, reason=why)
        self._event("node_excluded", node_id=node.node_id, reason=why)
        replacement = max(self.nodes) + 1
        self._node(replacement).state = "registered"  # expected; silent until it starts
        self._start_relaunch(replacement, replaces=node.node_id)

    def _start_relaunch(self, node_id: int, *, replaces: int | None = None) -> None:
        if self._relauncher is None or self._relaunch is None:
            return
        cap = self.job.failure.max_restarts + self.job.nodes.max
        if sum(n.relaunches for n in self.nodes.values()) >= cap:
            self._finish(JobState.FAILED, f"gave up relaunching nodes after {cap} relaunches "
                                          "(failure.max_restarts + nodes.max)")
            return
        node = self._node(node_id)
        node.relaunches += 1
        node.last_heartbeat = self._clock()  # give the new agent a full timeout to start
        log.info("node_relaunch", node_id=node_id, replaces=replaces)
        self._event("node_relaunched", node_id=node_id, replaces=replaces)
        relaunch = self._relaunch

        def run() -> None:
            try:
                relaunch(node_id)
            except Exception as exc:  # the backend refused: the node stays missing
                log.error("node_relaunch_failed", node_id=node_id, error=f"{type(exc).__name__}: {exc}")
                self._event("node_relaunch_failed", node_id=node_id, error=str(exc))

        self._relauncher.submit(run)

    def succeeded(self, node_id: int, round_index: int) -> dict[str, Any]:
        with self._lock:
            node = self._node(node_id)
            node.last_heartbeat = self._clock()
            rnd = self.rdzv.latest
            if rnd is not None and round_index == rnd.index and round_index >= self.required_round:
                node.state = "succeeded"
                self._succeeded_nodes.add(node_id)
                log.info("node_succeeded", node_id=node_id, round=round_index)
                # (the size test first: the set test scans the round, once per node otherwise)
                if len(self._succeeded_nodes) >= len(rnd.node_ids) and self._succeeded_nodes.issuperset(rnd.node_ids):
                    self._finish(JobState.SUCCEEDED)
            return {"action": self._action(round_index, node)}

    def exited(self, node_id: int) -> dict[str, Any]:
        with self._lock:
            node = self._node(node_id)
            if node.state != "excluded":
                node.state = "exited"
            self.rdzv.leave(node_id)
            return {"action": "stop"}

    def cancel(self, reason: str = "cancelled by the user") -> dict[str, Any]:
        with self._lock:
            self._finish(JobState.CANCELLED, reason)
            return {"action": "stop"}

    # ----- periodic work -----------------------------------------------------------------

    def _try_complete(self) -> Round | None:
        # a round forms only when one is required: the first, or after a restart order
        if self.state.is_terminal or self.rdzv.next_index > self.required_round or self._check is not None:
            return None
        # the first round does not know who else will come: no early completion by "all
        # live nodes joined", only at max nodes or after the last call
        live = len(self._live_nodes()) if self.rdzv.latest is not None and self._need_live_count() else None
        if self.job.failure.node_check:
            chosen = self.rdzv.choose(live_nodes=live)
            if chosen is not None and any(self._checked.get(n) != self.required_round for n in chosen):
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
        if self.state == JobState.PENDING:
            self.state = JobState.RUNNING
        self.goodput.round_completed(self._clock(), self.started)
        log.info("rendezvous_completed", round=rnd.index, nodes=list(rnd.node_ids), world_size=rnd.world_size,
                 store_port=port)
        self._event("rendezvous_completed", round=rnd.index, node_ids=list(rnd.node_ids), world_size=rnd.world_size)
        return rnd

    def _need_live_count(self) -> bool:
        """Whether the round being formed could complete early because every live node
        waits: only then does it need the count of live nodes, a scan of the node table that
        every poll of a 10,000-node rendezvous would otherwise pay."""
        waiting = self.rdzv.waiting_count
        return (self.rdzv.min_nodes <= waiting < self.rdzv.max_nodes
                and self._clock() - self.rdzv.last_join < self.rdzv.last_call_s)

    # ----- node checks ---------------------------------------------------------------------

    #: seconds a node-check round may take (a cold process start included)
    CHECK_TIMEOUT_S = 120.0

    def _start_check(self, nodes: list[int]) -> None:
        port, store = self._store_factory()
        self._check_store = (port, store)
        self._check = NodeCheckRun(nodes=sorted(nodes), store_port=port, started=self._clock())
        log.info("node_check_started", nodes=self._check.nodes, groups=self._check.groups)
        self._event("node_check_started", nodes=self._check.nodes, groups=self._check.groups)

    def _check_order(self, node_id: int) -> dict[str, Any] | None:
        run = self._check
        if run is None or node_id in run.results[run.round]:
            return None
        found = run.group_of(node_id)
        if found is None:
            return None
        index, group = found
        return {"state": "check", "action": "none", "check_round": run.round, "group": group,
                "group_rank": group.index(node_id), "group_size": len(group), "store_host": self.store_host,
                "store_port": run.store_port, "prefix": f"check{run.round}/group{index}",
                "timeout_s": self.CHECK_TIMEOUT_S}

    def node_check(self, node_id: int, check_round: int, result: dict[str, Any]) -> dict[str, Any]:
        """A node's result of a node-check round."""
        with self._lock:
            run = self._check
            if run is None or check_round != run.round or node_id not in run.nodes:
                return {"action": "none"}
            run.report(node_id, {**result, "elapsed_s": result.get("elapsed_s") if result.get("ok") else float("inf")})
            self._advance_check()
            return {"action": "none"}

    def _advance_check(self, *, timed_out: bool = False) -> None:
        run = self._check
        if run is None:
            return
        if timed_out:
            run.fail_missing()
        if not run.round_done:
            return
        if run.next_round():
            port, store = self._store_factory()
            self._check_store = (port, store)
            run.store_port, run.started = port, self._clock()
            log.info("node_check_round", round=run.round, groups=run.groups)
            return
        faulty, stragglers, best = run.verdict()
        self._check, self._check_store = None, None
        log.info("node_check_finished", faulty=faulty, stragglers=stragglers, best_s={str(k): round(v, 3) for k, v in best.items()})
        self._event("node_check_finished", faulty=faulty, stragglers=stragglers,
                    best_s={str(k): round(v, 3) for k, v in best.items()})
        for n in run.nodes:
            self._checked[n] = self.required_round
        for n in faulty:
            self._exclude(self._node(n), "it failed the node check twice")
        if self.job.failure.exclude_stragglers:
            for n in stragglers:
                self._exclude(self._node(n), f"it is a straggler (node check {best[n]:.2f} s, over twice the median)")

    def _lose(self, node: NodeRecord, silent_s: float) -> None:
        node.state = "dead"
        self.rdzv.leave(node.node_id)
        log.warning("node_lost", node_id=node.node_id, silent_s=round(silent_s, 1))
        rnd = self.rdzv.latest
        if rnd is not None and node.node_id in rnd and rnd.index >= self.required_round:
            self.failure(node.node_id, rnd.index, [{
                "rank": None, "local_rank": None, "exit_code": None, "kind": "node_lost",
                "detail": f"no heartbeat for {silent_s:.0f} s"}])
        else:
            node.failures += 1
        if self.state.is_terminal or node.state == "excluded":
            return
        if node.failures >= self.job.failure.max_node_failures:
            self._exclude(node, f"lost {node.failures} times (failure.max_node_failures={self.job.failure.max_node_failures})")
        elif self._relaunch is not None:
            self._start_relaunch(node.node_id)
        elif len(self._live_nodes()) < self.job.nodes.min:
            self._finish(JobState.FAILED, f"node {node.node_id} lost (no heartbeat for "
                                          f"{self.job.failure.heartbeat_timeout_s:g} s); {len(self._live_nodes())} live "
                                          f"nodes < nodes.min={self.job.nodes.min} and the scheduler cannot relaunch nodes")

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
        log.info("membership_changed", round=self.required_round, nodes=len(rnd.node_ids), to=bigger, waiting=waiting)
        self._event("membership_changed", round=self.required_round, from_nodes=len(rnd.node_ids), to_nodes=bigger,
                    waiting=waiting)

    def tick(self) -> None:
        """Complete a due round; declare silent nodes lost; scale up; time out a stuck
        rendezvous."""
        with self._lock:
            if self.state.is_terminal:
                return
            self._try_complete()
            now = self._clock()
            timeout = self.job.failure.heartbeat_timeout_s
            for node in list(self.nodes.values()):
                silent = now - node.last_heartbeat
                if node.state not in _GONE and silent > timeout:
                    self._lose(node, silent)
            if self.state.is_terminal:
                return
            self._maybe_scale_up(now)
            if self._check is not None and now - self._check.started > self.CHECK_TIMEOUT_S:
                self._advance_check(timed_out=True)
            since = self.rdzv.forming_since
            join_timeout = self.job.nodes.join_timeout_s
            if since is not None and now - since > join_timeout and self.rdzv.next_index <= self.required_round:
                self._finish(JobState.FAILED, f"rendezvous round {self.rdzv.next_index} timed out after {join_timeout:g} s "
                                              f"with {len(self.rdzv.waiting)} waiting nodes (nodes.min={self.job.nodes.min})")

    # ----- journal (master restarts) ------------------------------------------------------

    def snapshot(self) -> dict[str, Any]:
        """The master's durable state as JSON-safe data (heartbeat times excluded)."""
        with self._lock:
            rnd = self.rdzv.latest
            return {
                "version": 1, "job_id": self.job_id, "elapsed_s": self._now(), "state": self.state.value,
                "reason": self.reason, "restarts": self.restarts, "required_round": self.required_round,
                "round": None if rnd is None else {"index": rnd.index, "node_ids": list(rnd.node_ids),
                                                   "nproc": list(rnd.nproc)},
                "succeeded": sorted(self._succeeded_nodes),
                "nodes": [_journal_dict(n) for n in self.nodes.values()],
                "failures": self.failures, "metrics": self.metrics, "goodput": self.goodput.to_dict(),
                "pending_shards": self.checkpoints.pending_shards() if self.checkpoints else [],
            }

    def restore(self, snap: dict[str, Any]) -> None:
        """Resume from :meth:`snapshot` after a restart. Agents keep their workers; they get
        a full heartbeat timeout to reconnect."""
        with self._lock:
            now = self._clock()
            self.started = now - float(snap["elapsed_s"])
            self.state, self.reason = JobState(snap["state"]), snap["reason"]
            self.restarts, self.required_round = snap["restarts"], snap["required_round"]
            r = snap["round"]
            self.rdzv.restore(None if r is None else Round(index=r["index"], node_ids=tuple(r["node_ids"]),
                                                           nproc=tuple(r["nproc"])))
            self._succeeded_nodes = set(snap["succeeded"])
            self.nodes = {}
            for n in snap["nodes"]:
                node = NodeRecord(**{**n, "workers": {int(k): v for k, v in n["workers"].items()},
                                     "steps": {int(k): v for k, v in n["steps"].items()}})
                node.last_heartbeat = now
                if node.state == "waiting":  # it will poll again and find no round: make it rejoin
                    node.state = "registered"
                self.nodes[node.node_id] = node
            self.failures, self.metrics = snap["failures"], snap["metrics"]
            self.goodput = GoodputTracker.from_dict(snap["goodput"])
            for shard in snap["pending_shards"]:
                if self.checkpoints is not None:
                    self.checkpoints.shard_done(step=shard["step"], rank=shard["rank"],
                                                world_size=shard["world_size"], info=shard["info"])
            log.info("master_recovered", round=r["index"] if r else None, nodes=len(self.nodes), restarts=self.restarts)
            self._event("master_recovered", round=r["index"] if r else None, nodes=len(self.nodes))

    # ----- views -------------------------------------------------------------------------

    def drained(self) -> bool:
        """The job is over and every registered agent has exited (or was declared dead)."""
        with self._lock:
            return self.state.is_terminal and all(n.state in _GONE for n in self.nodes.values())

    def status(self) -> dict[str, Any]:
        with self._lock:
            rnd = self.rdzv.latest
            g = self.goodput
            return {
                "job_id": self.job_id, "state": self.state.value, "message": self.reason,
                "step": g.last_step, "metrics": dict(self.metrics),
                "nodes": len(rnd.node_ids) if rnd else 0, "max_nodes": self.job.nodes.max,
                "restarts": self.restarts, "round": rnd.index if rnd else -1,
                "elapsed_s": round(self._now(), 3), "node_table": [n.to_dict() for n in self.nodes.values()],
                "goodput": self._timeline(),
            }

    def _timeline(self) -> dict[str, float]:
        g = self.goodput
        end = self.ended if self.ended is not None else self._clock()
        wall = max(end - self.started, 1e-9)
        parts = {"productive_s": g.productive_s, "checkpoint_stall_s": g.checkpoint_stall_s, "restore_s": g.restore_s,
                 "recomputed_s": g.recomputed_s, **g.phases}
        parts["other_s"] = max(0.0, wall - sum(parts.values()))
        return {"wall_time_s": round(wall, 3), "goodput": round(min(1.0, g.productive_s / wall), 4),
                **{k: round(v, 3) for k, v in parts.items()}}

    def result(self) -> JobResult:
        with self._lock:
            end = self.ended if self.ended is not None else self._clock()
            wall = max(end - self.started, 1e-9)
            g = self.goodput
            return JobResult(
                job_id=self.job_id,
                state=self.state if self.state.is_terminal else JobState.UNKNOWN,
                reason=self.reason, final_step=g.last_step, restarts=self.restarts, wall_time_s=wall,
                productive_s=g.productive_s, goodput=min(1.0, g.productive_s / wall),
                checkpoint_stall_s=g.checkpoint_stall_s, restore_s=g.restore_s, recomputed_s=g.recomputed_s,
                detection_s=g.phases["detection_s"], restart_s=g.phases["restart_s"],
                rendezvous_s=g.phases["rendezvous_s"], startup_s=g.phases["startup_s"],
                failures=tuple(FailureRecord(**{k: v for k, v in f.items() if k != "counted"}) for f in self.failures),
                metrics=dict(self.metrics), log_dir=str(self.log_dir or ""),
            )
