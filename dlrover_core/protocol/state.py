"""A job's lifecycle state: :class:`JobState` (the results and the statuses share it)."""

from __future__ import annotations

import enum

__all__ = ["JobState"]


class JobState(str, enum.Enum):
    """Lifecycle of a job as the runner sees it."""

    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    UNKNOWN = "UNKNOWN"

    @property
    def is_terminal(self) -> bool:
        return self in (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)
