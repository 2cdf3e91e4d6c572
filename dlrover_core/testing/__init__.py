"""Helpers for tests of dlrover-core and of plugins.

* In-memory backends: :class:`InMemoryStorage` (storage ``"memory"``) and
  :class:`RecordingScheduler` (scheduler ``"recording"``, records plans, starts nothing).
* :class:`StorageContract`: the tests every checkpoint storage must pass; subclass it.
* :func:`register_plugin` (a plugin for the length of a ``with`` block) and
  :func:`fresh_host` (a new process-wide plugin host).
* pytest fixtures ``dlrover_host``, ``make_job``, ``log_events`` in
  :mod:`dlrover_core.testing.pytest_plugin` (loaded automatically by pytest).
* Fault injection against live jobs: :func:`kill_worker_at_step`.
"""

from dlrover_core.testing.chaos import Kill, kill_worker_at_step
from dlrover_core.testing.contract import StorageContract
from dlrover_core.testing.plugins import TESTING_PLUGIN, fresh_host, register_plugin
from dlrover_core.testing.scheduler import RecordingScheduler
from dlrover_core.testing.storage import InMemoryStorage

__all__ = [
    "TESTING_PLUGIN",
    "InMemoryStorage",
    "Kill",
    "RecordingScheduler",
    "StorageContract",
    "fresh_host",
    "kill_worker_at_step",
    "register_plugin",
]
