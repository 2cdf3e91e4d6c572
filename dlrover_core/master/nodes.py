"""The master's node table: one :class:`NodeRecord` per node (agent) it knows.

A node's ``state`` moves through ``registered`` → ``waiting`` (joined a round) → ``running``
(told its place) → ``succeeded``; it is *gone* when ``dead`` (lost: silent past the
heartbeat timeout), ``exited`` (its agent left) or ``excluded`` (for good: too many
failures, a failed node check). The table is not thread-safe: the master holds its lock.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import attrs

from dlrover_core.protocol.status import NodeRow

__all__ = ["GONE", "NodeRecord", "NodeTable", "plural"]

#: The states of a node that is no longer part of the job (it may come back if relaunched).
GONE = ("dead", "exited", "excluded")


def plural(n: int, word: str) -> str:
    """``"1 node"``, ``"2 nodes"``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


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
    failed_at: list[float] = attrs.field(factory=list)  # when each was (seconds since the job started)
    relaunches: int = 0
    token: int = 0  # fencing token of the node's current agent (0: none registered yet)
    replica_addr: str = ""  # its agent's replica server (host:port; empty: none)

    def failed(self, now_s: float) -> None:
        """Count a failure of this node at ``now_s`` (seconds since the job started)."""
        self.failures += 1
        self.failed_at.append(now_s)

    def recent_failures(self, now_s: float, window_s: float) -> int:
        """Failures in the last ``window_s`` seconds."""
        return sum(1 for t in self.failed_at if now_s - t <= window_s)

    @property
    def gone(self) -> bool:
        """Dead, exited or excluded."""
        return self.state in GONE

    def to_row(self) -> NodeRow:
        """The node as ``/v1/status`` shows it."""
        return NodeRow(node_id=self.node_id, host=self.host, pid=self.pid, state=self.state, round=self.round,
                       workers=dict(self.workers), steps=dict(self.steps), failures=self.failures,
                       relaunches=self.relaunches, token=self.token)

    def to_journal(self) -> dict[str, Any]:
        """The record as the journal keeps it: ``attrs.asdict`` less ``last_heartbeat`` (a
        time of this process only), several times faster — it counts with 10,000 nodes
        journalled every 0.5 s under the master's lock."""
        return {name: (dict(v) if isinstance(v := getattr(self, name), dict) else v) for name in _JOURNAL_FIELDS}

    @classmethod
    def from_journal(cls, data: dict[str, Any]) -> NodeRecord:
        """Inverse of :meth:`to_journal` (after JSON: rank keys are strings)."""
        return cls(**{**data, "failed_at": list(data.get("failed_at", ())),
                      "workers": {int(k): v for k, v in data["workers"].items()},
                      "steps": {int(k): v for k, v in data["steps"].items()}})


#: The fields of a NodeRecord the journal keeps: all but ``last_heartbeat``.
_JOURNAL_FIELDS = tuple(a.name for a in attrs.fields(NodeRecord) if a.name != "last_heartbeat")


class NodeTable(dict[int, NodeRecord]):
    """Every node the master knows, by node id."""

    def get_or_add(self, node_id: int, now: float) -> NodeRecord:
        """The node's record; a new one (``registered``, last heard of ``now``) if unknown."""
        node = self.get(node_id)
        if node is None:
            node = self[node_id] = NodeRecord(node_id=node_id, last_heartbeat=now)
        return node

    def live(self) -> list[NodeRecord]:
        """The nodes not gone."""
        return [n for n in self.values() if not n.gone]

    def is_live(self, node_id: int) -> bool:
        """Whether ``node_id`` is known and not gone."""
        node = self.get(node_id)
        return node is not None and not node.gone

    def is_gone(self, node_id: int) -> bool:
        """Whether ``node_id`` is known and gone."""
        node = self.get(node_id)
        return node is not None and node.gone

    def relaunches(self) -> int:
        """Relaunches ordered for every node together."""
        return sum(n.relaunches for n in self.values())

    def blame(self) -> str:
        """``"3 failures: node 0 (2), node 1 (1)"``: the failures each node was blamed for."""
        blamed = sorted((n for n in self.values() if n.failures), key=lambda n: n.node_id)
        total = sum(n.failures for n in blamed)
        return f"{plural(total, 'failure')}: " + ", ".join(f"node {n.node_id} ({n.failures})" for n in blamed)

    def rows(self) -> tuple[NodeRow, ...]:
        """The table as ``/v1/status`` shows it."""
        return tuple(n.to_row() for n in self.values())

    def to_journal(self) -> list[dict[str, Any]]:
        return [n.to_journal() for n in self.values()]

    @classmethod
    def from_journal(cls, records: Iterable[dict[str, Any]]) -> NodeTable:
        """The table of journalled records (a later record of a node replaces an earlier one)."""
        table = cls()
        for data in records:
            node = NodeRecord.from_journal(data)
            table[node.node_id] = node
        return table
