"""The job's own record, as the job master keeps it: :class:`JobBook`.

What the master has decided about the job as a whole — its state and reason, the restart
budget taken, the round every node must run, the failures and what was done about each, the
nodes that succeeded, left or are being relaunched — is the part of its state a restarted
master must find again. :meth:`JobBook.to_journal` is that part of the master's snapshot;
:meth:`JobBook.from_journal` reads it back with the node changes logged after the snapshot
(see :mod:`~dlrover_core.master.journal`). The master's collaborators (node table, rendezvous,
goodput, checkpoints) keep and journal their own state. Not thread-safe: the master holds
its lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from dlrover_core.protocol.codec import decode, encode
from dlrover_core.protocol.result import FailureRecord
from dlrover_core.protocol.state import JobState

__all__ = ["JobBook"]


@attrs.define(kw_only=True)
class JobBook:
    """The job's record.

    Attributes:
        state, reason: the job's state, and why it failed or was cancelled.
        restarts: restarts taken from the job-wide budget.
        required_round: the round every node must run (a restart raises it).
        failures: every failure reported, and whether it counted (took a restart: a
            restore after it is its recovery).
        metrics: the newest value of every metric rank 0 reported.
        succeeded: nodes that reported success in the running round.
        relaunching: node id → when its relaunch was ordered (master clock), until it registers.
        gone_why: node id → why it left the job (for a below-min reason).
        held: ``(round, until, node_id)``: a restart held for the other ranks' reports (not
            journaled: a restarted master orders it at once).
    """

    state: JobState = JobState.PENDING
    reason: str = ""
    restarts: int = 0
    required_round: int = 0
    failures: list[tuple[FailureRecord, bool]] = attrs.field(factory=list)
    metrics: dict[str, float] = attrs.field(factory=dict)
    succeeded: set[int] = attrs.field(factory=set)
    relaunching: dict[int, float] = attrs.field(factory=dict)
    gone_why: dict[int, str] = attrs.field(factory=dict)
    held: tuple[int, float, int] | None = None

    def node_entry(self, node_id: int) -> dict[str, Any]:
        """What a node's journal line carries of the book: whether its relaunch is on, and
        why it left (``None``: it did not)."""
        return {"relaunching": node_id in self.relaunching, "gone_why": self.gone_why.get(node_id)}

    def to_journal(self) -> dict[str, Any]:
        return {
            "state": self.state.value, "reason": self.reason, "restarts": self.restarts,
            "required_round": self.required_round, "relaunching": sorted(self.relaunching),
            "gone_why": {str(k): v for k, v in self.gone_why.items()}, "succeeded": sorted(self.succeeded),
            "failures": [{**encode(f), "counted": counted} for f, counted in self.failures], "metrics": self.metrics,
        }

    @classmethod
    def from_journal(cls, snap: dict[str, Any], entries: Sequence[dict[str, Any]], *, now: float) -> JobBook:
        """The book of a snapshot, with the node lines logged after it (later lines win);
        relaunches still on count from ``now``."""
        book = cls(state=JobState(snap["state"]), reason=snap["reason"], restarts=snap["restarts"],
                   required_round=snap["required_round"], metrics=snap["metrics"],
                   succeeded=set(snap["succeeded"]),
                   gone_why={int(k): v for k, v in (snap.get("gone_why") or {}).items()},
                   failures=[(decode(FailureRecord, f), bool(f.get("counted"))) for f in snap["failures"]])
        relaunching = {int(n) for n in snap.get("relaunching") or ()}
        for entry in entries:
            if "node" not in entry:  # (a launcher's id: Fleet's)
                continue
            node_id = int(entry["node"]["node_id"])
            if entry.get("succeeded"):
                book.succeeded.add(node_id)
            if "relaunching" in entry:
                (relaunching.add if entry["relaunching"] else relaunching.discard)(node_id)
            if entry.get("gone_why"):
                book.gone_why[node_id] = entry["gone_why"]
            elif "gone_why" in entry:
                book.gone_why.pop(node_id, None)
        book.relaunching = dict.fromkeys(sorted(relaunching), now)
        return book
