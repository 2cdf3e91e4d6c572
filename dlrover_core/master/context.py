"""What the job master's rooms share: :class:`MasterContext`.

The :class:`~dlrover_core.master.job_master.JobMaster` is the one object that holds the job's
state; the rooms it delegates to — the fleet of nodes (:mod:`~dlrover_core.master.fleet`) and
the rendezvous rounds (:mod:`~dlrover_core.master.rounds`), a failure's fate
(:mod:`~dlrover_core.master.recovery`) — act on that state through this
protocol, always while the master holds its lock, so they see the state a restarted master
restored and never import the master itself.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from dlrover_core.master.book import JobBook
from dlrover_core.master.decisions import JobView
from dlrover_core.master.goodput import GoodputTracker, StepRate
from dlrover_core.master.journal import WriteAhead
from dlrover_core.master.live import LiveRecovery
from dlrover_core.master.node_check import NodeChecks
from dlrover_core.master.nodes import NodeRecord, NodeTable
from dlrover_core.master.rendezvous import RendezvousManager
from dlrover_core.master.replicas import ReplicaIndex
from dlrover_core.protocol.messages import Action
from dlrover_core.protocol.state import JobState
from dlrover_core.spec import JobSpec

__all__ = ["MasterContext"]


class MasterContext(Protocol):
    """The master's state and effects, as its rooms use them."""

    job: JobSpec
    store_host: str
    book: JobBook
    nodes: NodeTable
    rdzv: RendezvousManager
    livework: LiveRecovery
    node_checks: NodeChecks
    goodput: GoodputTracker
    rate: StepRate
    wal: WriteAhead
    replicas: ReplicaIndex
    started: float
    clock: Callable[[], float]

    @property
    def state(self) -> JobState: ...

    @property
    def required_round(self) -> int: ...

    def now_s(self) -> float:
        """Seconds since the job started."""

    def event(self, kind: str, /, *, level: str = "info", log_fields: dict[str, Any] | None = None, **data: Any) -> None:
        """One fact: a log line and a :class:`~dlrover_core.protocol.events.JobEvent`
        (events.jsonl, plugin observers)."""

    def finish(self, state: JobState, reason: str = "") -> None:
        """End the job (once): its state, reason, event and journal point."""

    def view(self) -> JobView:
        """What the decisions need to know of the job now (:mod:`~dlrover_core.master.decisions`)."""

    def action(self, round_index: int, node: NodeRecord | None = None) -> Action:
        """What an agent running ``round_index`` (on ``node``) is told to do: stop (the job
        ended, or its node was excluded), restart (a newer round is required) or nothing."""

    def node(self, node_id: int) -> NodeRecord:
        """The node's record (a new one if unknown)."""

    def note_node(self, node: NodeRecord, *, succeeded: bool = False, point: str | None = None) -> None:
        """Journal one node's change (a log line) before what follows it."""
