"""A job's state as the master reports it and as the runner shows it.

:class:`MasterStatus` is the master's ``GET /v1/status`` answer; :meth:`MasterStatus.to_job_status`
is the one mapping to the runner's :class:`JobStatus` every scheduler backend uses.
"""

from __future__ import annotations

from typing import Any

import attrs

from dlrover_core.protocol.codec import decode
from dlrover_core.protocol.result import FailureRecord
from dlrover_core.protocol.state import JobState

__all__ = ["JobState", "JobStatus", "MasterStatus", "NodeRow"]


@attrs.frozen(kw_only=True)
class JobStatus:
    """A job's live status.

    Attributes:
        state: lifecycle state.
        step: the newest step reported by rank 0 (``-1`` before the first report).
        metrics: the newest metrics reported by rank 0.
        nodes: nodes in the current rendezvous round.
        max_nodes: the Job's ``nodes.max``.
        restarts: restarts used from the job-wide budget.
        round: current rendezvous round (0-based).
        message: a human-readable note (the failure reason, when failed).
        worker_pids: pid of every live worker by global rank (as the agents last reported).
        goodput: the goodput timeline so far (``goodput``, ``wall_time_s``, ``productive_s``,
            ``checkpoint_stall_s``, ``restore_s``, ``recomputed_s``, ``detection_s``,
            ``restart_s``, ``rendezvous_s``, ``startup_s``, ``other_s``).
        total_steps: the run's length in steps, as rank 0 passed it to
            ``train.report(..., total_steps=N)`` (``None``: never given).
        step_time_s: median seconds per step over rank 0's recent reports, wall clock
            (checkpoint saves and evaluation between reports included; ``None``: no step yet).
        eta_s: seconds until step ``total_steps - 1`` at ``step_time_s`` (``None`` without
            ``total_steps`` or a step time).
        samples_per_s: samples the whole job processes per second, over rank 0's recent
            reports of ``samples`` (``None``: the script reports none).
        tokens_per_s: the same for ``tokens``.
        elapsed_s: seconds since the job master started (``None``: unknown, e.g. a finished
            job's status read from its result).
        root_cause: the first failure of the newest failing incident (torchrun's root cause:
            see ``FailureRecord.root_cause``), with its traceback; ``None``: no failure yet.
    """

    state: JobState
    step: int = -1
    metrics: dict[str, float] = attrs.field(factory=dict)
    nodes: int = 0
    max_nodes: int = 0
    restarts: int = 0
    round: int = -1
    message: str = ""
    worker_pids: dict[int, int] = attrs.field(factory=dict)
    goodput: dict[str, float] = attrs.field(factory=dict)
    total_steps: int | None = None
    step_time_s: float | None = None
    eta_s: float | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    elapsed_s: float | None = None
    root_cause: FailureRecord | None = None


@attrs.frozen(kw_only=True)
class NodeRow:
    """One node of the master's node table, as ``/v1/status`` shows it.

    Attributes:
        node_id: the node's id (``--node-id`` of its agent).
        host: the agent's host name.
        pid: the agent's process id on that host (0: not registered).
        state: ``"joining"``, ``"running"``, ``"failed"``, ``"excluded"``, ``"lost"``...
        round: the rendezvous round the node last joined (-1: none).
        workers: pid of each live worker by global rank.
        steps: newest step each worker reported, by global rank.
        failures: worker failures counted against this node.
        relaunches: times the node was replaced.
        token: fencing token of the node's current agent (0: none registered yet).
    """

    node_id: int
    host: str = ""
    pid: int = 0
    state: str = ""
    round: int = -1
    workers: dict[int, int] = attrs.field(factory=dict)
    steps: dict[int, int] = attrs.field(factory=dict)
    failures: int = 0
    relaunches: int = 0
    token: int = 0


@attrs.frozen(kw_only=True)
class MasterStatus:
    """The master's live status (``GET /v1/status``).

    Attributes:
        job_id: the run's id.
        state: lifecycle state.
        message: the failure reason, what the job waits for, or a storage warning ("" when none).
        step: newest step reported by rank 0 (-1 before the first report).
        metrics: newest metrics reported by rank 0.
        nodes: live members of the running round.
        max_nodes: the Job's ``nodes.max``.
        restarts: restarts used from the job-wide budget.
        round: current rendezvous round (-1 before the first).
        elapsed_s: seconds since the master started.
        node_table: every node the master knows.
        goodput: the goodput timeline so far (see :class:`JobStatus`).
        total_steps, step_time_s, eta_s, samples_per_s, tokens_per_s: rank 0's progress rate
            (see :class:`JobStatus`; ``None`` when unknown, and from a master that predates them).
        root_cause: see :class:`JobStatus`.
    """

    job_id: str = ""
    state: JobState
    message: str = ""
    step: int = -1
    metrics: dict[str, float] = attrs.field(factory=dict)
    nodes: int = 0
    max_nodes: int = 0
    restarts: int = 0
    round: int = -1
    elapsed_s: float = 0.0
    node_table: tuple[NodeRow, ...] = ()
    goodput: dict[str, float] = attrs.field(factory=dict)
    total_steps: int | None = None
    step_time_s: float | None = None
    eta_s: float | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None
    root_cause: FailureRecord | None = None

    def to_job_status(self, worker_pids: dict[int, int] | None = None) -> JobStatus:
        """The runner's view. ``worker_pids`` replaces the pids the agents reported (a
        backend whose workers live in another pid namespace maps them to the host's)."""
        pids = {rank: pid for n in self.node_table for rank, pid in n.workers.items()}
        return JobStatus(
            state=self.state, step=self.step, metrics=dict(self.metrics), nodes=self.nodes,
            max_nodes=self.max_nodes, restarts=self.restarts, round=self.round, message=self.message,
            worker_pids=pids if worker_pids is None else worker_pids, goodput=dict(self.goodput),
            total_steps=self.total_steps, step_time_s=self.step_time_s, eta_s=self.eta_s,
            samples_per_s=self.samples_per_s, tokens_per_s=self.tokens_per_s, elapsed_s=self.elapsed_s,
            root_cause=self.root_cause,
        )

    @classmethod
    def from_wire(cls, data: Any) -> MasterStatus:
        """Decode a ``/v1/status`` answer (raises ProtocolError when malformed)."""
        return decode(cls, data)
