"""Scheduler backends: the base class and the plain data it exchanges; built-in ``local``."""

from dlrover_core.schedulers.base import (
    Capabilities,
    JobHandle,
    JobState,
    JobStatus,
    Plan,
    ProcessSpec,
    SchedulerBackend,
)

__all__ = ["Capabilities", "JobHandle", "JobState", "JobStatus", "Plan", "ProcessSpec", "SchedulerBackend"]
