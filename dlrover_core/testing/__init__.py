"""Helpers for tests of dlrover-core and of plugins: fault injection against live jobs."""

from dlrover_core.testing.chaos import Kill, kill_worker_at_step

__all__ = ["Kill", "kill_worker_at_step"]
