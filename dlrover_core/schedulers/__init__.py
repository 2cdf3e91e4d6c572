"""Scheduler backends: the base class and the plain data it exchanges; built-in ``local``."""

from dlrover_core.protocol import JobState, JobStatus
from dlrover_core.schedulers.base import Capabilities, JobHandle, Plan, ProcessSpec, SchedulerBackend

__all__ = ["Capabilities", "JobHandle", "JobState", "JobStatus", "Plan", "ProcessSpec", "SchedulerBackend"]
