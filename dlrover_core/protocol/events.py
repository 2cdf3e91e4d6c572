"""Job events: what happened, when, as plain JSON-safe data (observers and ``events.jsonl``)."""

from __future__ import annotations

from typing import Any

import attrs

__all__ = ["JobEvent"]


@attrs.frozen(kw_only=True)
class JobEvent:
    """One event of a job, seen by ``dlrover_on_job_event`` observers.

    Attributes:
        kind: snake_case event name (``worker_failed``, ``workers_restarted``,
            ``rendezvous_completed``, ``checkpoint_committed``, ``checkpoint_restored``,
            ``job_finished``).
        job_id: the job run's id.
        time_s: seconds since the job master started.
        data: JSON-safe details (rank, exit_code, step...).
        unix_time_s: when it happened, as seconds since the Unix epoch (``time.time()`` on the
            master's host; ``None`` when unknown), to line events up with other hosts' logs.
    """

    kind: str
    job_id: str
    time_s: float
    data: dict[str, Any] = attrs.field(factory=dict)
    unix_time_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"kind": self.kind, "job_id": self.job_id, "time_s": round(self.time_s, 3), **self.data}
        if self.unix_time_s is not None:
            out["unix_time_s"] = round(self.unix_time_s, 3)
        return out
