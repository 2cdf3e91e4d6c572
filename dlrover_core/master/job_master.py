"""The JobMaster: node table, rendezvous rounds, restart budget, goodput and the job's fate.

All methods are thread-safe (one lock); the HTTP server calls them from its threads and a
ticker thread calls :meth:`JobMaster.tick` to complete rounds and notice silent nodes.

Agents learn what to do from the ``action`` in every answer:

* ``"none"``: carry on;
* ``"restart"``: stop your workers and join the next rendezvous round;
* ``"stop"``: the job is over; stop your workers and exit.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from dlrover_core.events import JobEvent
from dlrover_core.logging import get_logger
from dlrover_core.master.checkpoints import CheckpointCoordinator
from dlrover_core.master.goodput import GoodputTracker
from dlrover_core.master.rendezvous import RendezvousManager, Round
from dlrover_core.result import FailureRecord, JobResult
from dlrover_core.schedulers.base import JobState
from dlrover_core.spec import Job
from dlrover_core.storage.base import CheckpointStorage

__all__ = ["JobMaster", "NodeRecord"]

log = get_logger()

#: Returns ``(port, store)`` of a fresh TCPStore server for a new round.
StoreFactory = Callable[[], tuple[int, Any]]


def signal_name(exit_code: int | None) -> str | None:
    """``-9`` → ``"SIGKILL"``; codes ``128 + n`` from a shell count too; otherwise ``None``."""
    if exit_code is None:
        return None
    n = -exit_code if exit_code < 0 else (exit_code - 128 if 128 < exit_code < 160 else 0)
    try:
        return signal.Signals(n).name if n else None
    except ValueError:
        return None


@attrs.define(kw_only=True)
class NodeRecord:
    """The master's view of one node (agent)."""

    node_id: int
    host: str = ""
    pid: int = 0
    state: str = "registered"  # registered | waiting | running | succeeded | exited | dead
    last_heartbeat: float = 0.0
    round: int = -1
    workers: dict[int, int] = attrs.field(factory=dict)  # rank -> pid
    steps: dict[int, int] = attrs.field(factory=dict)  # rank -> newest step
    failures: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id, "host": self.host, "pid": self.pid, "state": self.state,
            "round": self.round, "workers": {str(k): v for k, v in self.workers.items()},
            "steps": {str(k): v for k, v in self.steps.items()}, "failures": self.failures,
        }


class JobMaster:
    """Decides, for the whole job, when rounds start, when workers restart and when it ends.

    Args:
        job: the Job (resolved: no ``"auto"`` left).
        job_id: this run's id.
        store_host: address workers use to reach the round stores.
        store_factory: makes a fresh TCPStore server per round.
        storage: the job's checkpoint storage (commits and restore decisions); ``None``
            when the master does not coordinate checkpoints.
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
        log_dir: Path | None = None,
        emit: Callable[[JobEvent], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.job = job
        self.job_id = job_id
        self.store_host = store_host
        self._store_factory = store_factory
        self._stores: dict[int, tuple[int, Any]] = {}
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

    def _event(self, kind: str, **data: Any) -> None:
        event = JobEvent(kind=kind, job_id=self.job_id, time_s=self._now(), data=data)
        if self._events_file is not None:
            self._events_file.write(json.dumps(event.to_dict()) + "\n")
        if self._emit_hook is not None:
            self._emit_hook(event)

    def _checkpoint_event(self, kind: str, **data: Any) -> None:
        if kind == "checkpoint_committed":
            self.goodput.add({"type": "checkpoint", "step": data["step"], "stall_s": 0.0, "committed": True})
        self._event(kind, **data)

    def _node(self, node_id: int) -> NodeRecord:
        node = self.nodes.get(node_id)
        if node is None:
            node = self.nodes[node_id] = NodeRecord(node_id=node_id, last_heartbeat=self._clock())
        return node

    def _action(self, round_index: int) -> str:
        if self.state.is_terminal:
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
        return [n for n in self.nodes.values() if n.state not in ("dead", "exited")]

    # ----- agent calls -----------------------------------------------------------------

    def register(self, node_id: int, host: str, pid: int) -> dict[str, Any]:
        with self._lock:
            node = self._node(node_id)
            node.host, node.pid, node.state = host, pid, "registered"
            node.last_heartbeat = self._clock()
            log.info("node_registered", node_id=node_id, host=host, pid=pid)
            return {"action": "stop" if self.state.is_terminal else "none", "job_id": self.job_id}

    def join(self, node_id: int, nproc: int) -> dict[str, Any]:
        with self._lock:
            node = self._node(node_id)
            node.last_heartbeat = self._clock()
            if self.state.is_terminal:
                return {"action": "stop"}
            node.state = "waiting"
            index = self.rdzv.join(node_id, nproc)
            log.info("rendezvous_joined", node_id=node_id, round=index, waiting=len(self.rdzv.waiting))
            self._try_complete()
            return {"action": "none", "round": index}

    def poll(self, node_id: int) -> dict[str, Any]:
        """Whether the round ``node_id`` waits for is complete; if so, its place in it."""
        with self._lock:
            node = self._node(node_id)
            node.last_heartbeat = self._clock()
            if self.state.is_terminal:
                return {"state": "stop", "action": "stop"}
            self._try_complete()
            rnd = self.rdzv.latest
            if rnd is None or node_id not in rnd.node_ids or rnd.index < self.required_round or node.state != "waiting":
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
    ) -> dict[str, Any]:
        with self._lock:
            node = self._node(node_id)
            node.last_heartbeat = self._clock()
            if node.state == "dead":  # came back: it must rejoin through rendezvous
                node.state = "registered"
            if workers is not None:
                node.workers = dict(workers)
            if steps:
                node.steps.update(steps)
            for record in records or ():
                self._record(record)
            return {"action": self._action(round_index)}

    def _record(self, record: dict[str, Any]) -> None:
        self.goodput.add(record)
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

    def failure(self, node_id: int, round_index: int, failures: list[dict[str, Any]]) -> dict[str, Any]:
        """Workers of ``node_id`` failed in round ``round_index``; decide restart or stop."""
        with self._lock:
            node = self._node(node_id)
            node.last_heartbeat = self._clock()
            node.failures += len(failures)
            current = self.rdzv.latest.index if self.rdzv.latest else -1
            consequence = self.state.is_terminal or round_index < self.required_round or round_index != current
            if consequence:
                action = f"none: round {round_index} was already being restarted"
            elif self.restarts < self.job.failure.max_restarts:
                self.restarts += 1
                self.required_round = round_index + 1
                action = f"restarted all workers (round {self.required_round}, restart {self.restarts}/{self.job.failure.max_restarts})"
            else:
                last = failures[-1]
                how = signal_name(last.get("exit_code")) or f"exit code {last.get('exit_code')}"
                reason = (f"restart budget exhausted (failure.max_restarts={self.job.failure.max_restarts}); "
                          f"last failure: rank {last.get('rank')} on node {node_id}, {how} (exit code {last.get('exit_code')})")
                action = "stopped the job: restart budget exhausted"
                self._finish(JobState.FAILED, reason)
            for f in failures:
                rec = {
                    "time_s": self._now(), "round": round_index, "node_id": node_id,
                    "rank": f.get("rank"), "local_rank": f.get("local_rank"), "exit_code": f.get("exit_code"),
                    "signal": signal_name(f.get("exit_code")), "step": self.goodput.last_step,
                    "last_committed_step": self.goodput.last_committed_step, "action": action,
                    "restored_step": None, "restored_from": None, "counted": not consequence,
                }
                self.failures.append(rec)
                log.warning("worker_failed", node_id=node_id, rank=rec["rank"], exit_code=rec["exit_code"],
                            signal=rec["signal"], step=rec["step"], action=action)
                self._event("worker_failed", **{k: v for k, v in rec.items() if k != "counted"})
            if not consequence and not self.state.is_terminal:
                self._event("workers_restarted", round=self.required_round, restarts=self.restarts)
            return {"action": self._action(round_index)}

    def succeeded(self, node_id: int, round_index: int) -> dict[str, Any]:
        with self._lock:
            node = self._node(node_id)
            node.last_heartbeat = self._clock()
            rnd = self.rdzv.latest
            if rnd is not None and round_index == rnd.index and round_index >= self.required_round:
                node.state = "succeeded"
                self._succeeded_nodes.add(node_id)
                log.info("node_succeeded", node_id=node_id, round=round_index)
                if self._succeeded_nodes >= set(rnd.node_ids):
                    self._finish(JobState.SUCCEEDED)
            return {"action": self._action(round_index)}

    def exited(self, node_id: int) -> dict[str, Any]:
        with self._lock:
            node = self._node(node_id)
            node.state = "exited"
            self.rdzv.leave(node_id)
            return {"action": "stop"}

    def cancel(self, reason: str = "cancelled by the user") -> dict[str, Any]:
        with self._lock:
            self._finish(JobState.CANCELLED, reason)
            return {"action": "stop"}

    # ----- periodic work -----------------------------------------------------------------

    def _try_complete(self) -> Round | None:
        if self.state.is_terminal:
            return None
        rnd = self.rdzv.try_complete(live_nodes=len(self._live_nodes()))
        if rnd is None:
            return None
        port, store = self._store_factory()
        self._stores[rnd.index] = (port, store)
        for old in [i for i in self._stores if i < rnd.index - 1]:
            del self._stores[old]  # drop the server of rounds long gone
        self._succeeded_nodes = set()
        if self.state == JobState.PENDING:
            self.state = JobState.RUNNING
        log.info("rendezvous_completed", round=rnd.index, nodes=list(rnd.node_ids), world_size=rnd.world_size,
                 store_port=port)
        self._event("rendezvous_completed", round=rnd.index, node_ids=list(rnd.node_ids), world_size=rnd.world_size)
        return rnd

    def tick(self) -> None:
        """Complete a due round; declare silent nodes dead; time out a stuck rendezvous."""
        with self._lock:
            if self.state.is_terminal:
                return
            self._try_complete()
            now = self._clock()
            timeout = self.job.failure.heartbeat_timeout_s
            for node in list(self.nodes.values()):
                if node.state in ("dead", "exited") or now - node.last_heartbeat <= timeout:
                    continue
                node.state = "dead"
                self.rdzv.leave(node.node_id)
                log.warning("node_lost", node_id=node.node_id, silent_s=round(now - node.last_heartbeat, 1))
                rnd = self.rdzv.latest
                if rnd is not None and node.node_id in rnd.node_ids and rnd.index >= self.required_round:
                    self.failure(node.node_id, rnd.index, [{"rank": None, "local_rank": None, "exit_code": None}])
                live = len(self._live_nodes())
                if live < self.job.nodes.min and not self.state.is_terminal:
                    self._finish(JobState.FAILED, f"node {node.node_id} lost (no heartbeat for {timeout:g} s); "
                                                  f"{live} live nodes < nodes.min={self.job.nodes.min}")
            since = self.rdzv.forming_since
            join_timeout = self.job.nodes.join_timeout_s
            if since is not None and now - since > join_timeout and not self.state.is_terminal:
                self._finish(JobState.FAILED, f"rendezvous round {self.rdzv.next_index} timed out after {join_timeout:g} s "
                                              f"with {len(self.rdzv.waiting)} waiting nodes (nodes.min={self.job.nodes.min})")

    # ----- views -------------------------------------------------------------------------

    def drained(self) -> bool:
        """The job is over and every registered agent has exited (or was declared dead)."""
        with self._lock:
            return self.state.is_terminal and all(n.state in ("exited", "dead") for n in self.nodes.values())

    def status(self) -> dict[str, Any]:
        with self._lock:
            rnd = self.rdzv.latest
            return {
                "job_id": self.job_id, "state": self.state.value, "message": self.reason,
                "step": self.goodput.last_step, "metrics": dict(self.metrics),
                "nodes": len(rnd.node_ids) if rnd else 0, "max_nodes": self.job.nodes.max,
                "restarts": self.restarts, "round": rnd.index if rnd else -1,
                "elapsed_s": round(self._now(), 3), "node_table": [n.to_dict() for n in self.nodes.values()],
            }

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
                failures=tuple(FailureRecord(**{k: v for k, v in f.items() if k != "counted"}) for f in self.failures),
                metrics=dict(self.metrics), log_dir=str(self.log_dir or ""),
            )
