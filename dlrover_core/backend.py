"""The API for backend authors: everything a plugin that adds an accelerator, a scheduler
backend, a checkpoint storage, an optimizer or a parallel strategy may import from the core.

Plugins import from here, from :mod:`dlrover_core` (the user API: ``Job``, ``hookimpl``,
the errors) and from :mod:`dlrover_core.testing` (fixtures and contract tests); every other
module of the core is an implementation detail that may change without notice. An
import-linter contract (``.importlinter``, run by ``make test``) holds the project's own
plugins to this.

What is here, by kind of backend:

- **accelerators**: :class:`Accelerator`, :class:`DeviceReport`, :class:`NodeCheckResult`,
  :func:`run_tool` / :func:`try_import` / :func:`cpu_only_torch` / :data:`TOOL_TIMEOUT_S` (probing a vendor tool),
  :func:`pci_numa_node` (a PCI device's NUMA node, for ``Accelerator.numa_nodes``);
- **schedulers**: :class:`SchedulerBackend` (a template: a backend implements
  ``build_plan`` and ``execute``), :class:`Capabilities`, :class:`SchedulerOption` (options as
  data) and :class:`OptionValue`, :class:`Plan`, :class:`ProcessSpec`, :class:`JobHandle`,
  :class:`Submission` (what ``submit`` persisted: ``SchedulerBackend.submission(handle)``);
  :func:`resolve_options`, :func:`fetch_master_status`, :func:`read_result`,
  :func:`status_of_result` (what every backend shares); the job's data (:class:`JobSpec`) and the
  messages a backend sees (:class:`MasterStatus`, :class:`JobStatus`, :class:`JobState`,
  :class:`JobResult`, :class:`NodeRelaunch`) and sends (:class:`FailureReport` of
  :class:`WorkerFailure`, answered by an :class:`Action`); :class:`MasterClient` to ask a running master;
  :mod:`control_plane` (the master's and agents' command lines, environment, ``DLROVER_JOB_SPEC``
  and ``OMP_NUM_THREADS``: a backend only places them),
  :func:`preview_workers` (the first round's worker processes, for a dry run),
  :func:`tail_logs`, :func:`remove_segments` / :data:`SHM_DIR` (a node's shared memory);
- **storages**: :class:`CheckpointStorage` (and :class:`PosixStorage` to build on);
- **all**: :data:`hookimpl`, :func:`get_host` (the process's plugin host: other registered backends) and :class:`PluginHost` (a host of its own, e.g. one that loads only your plugin in a test),
  :func:`get_logger` / :func:`configure_logging`, :mod:`env` (the environment variables the
  core sets and reads), :mod:`rundir` (the files of a run directory, by name), the retry presets (:func:`api_retrying`, :func:`rpc_retrying`,
  :func:`master_retrying`, :func:`storage_retrying`), :func:`write_atomic`.
"""

from __future__ import annotations

from dlrover_core import control_plane, env, rundir
from dlrover_core.accelerators.base import Accelerator, DeviceReport, NodeCheckResult
from dlrover_core.accelerators.numa import pci_numa_node
from dlrover_core.accelerators.tools import TOOL_TIMEOUT_S, ToolOutput, cpu_only_torch, run_tool, try_import
from dlrover_core.agent.launch import preview_workers
from dlrover_core.checkpoint.shm import SHM_DIR, remove_segments
from dlrover_core.fileio import write_atomic
from dlrover_core.logging import configure as configure_logging
from dlrover_core.logging import get_logger
from dlrover_core.markers import hookimpl
from dlrover_core.plugins import PluginHost, get_host
from dlrover_core.protocol import (
    Action,
    FailureReport,
    JobResult,
    JobState,
    JobStatus,
    MasterStatus,
    NodeRelaunch,
    WorkerFailure,
)
from dlrover_core.protocol.client import MasterClient, fetch_master_status
from dlrover_core.retry import api_retrying, master_retrying, rpc_retrying, storage_retrying
from dlrover_core.scheduler_backend import (
    Capabilities,
    JobHandle,
    OptionValue,
    Plan,
    ProcessSpec,
    SchedulerBackend,
    SchedulerOption,
    Submission,
    read_result,
    resolve_options,
    status_of_result,
)
from dlrover_core.schedulers.logtail import tail_logs
from dlrover_core.spec import JobSpec
from dlrover_core.storage.base import CheckpointStorage
from dlrover_core.storage.posix import PosixStorage

__all__ = [
    "SHM_DIR",
    "TOOL_TIMEOUT_S",
    "Accelerator",
    "Action",
    "Capabilities",
    "CheckpointStorage",
    "DeviceReport",
    "FailureReport",
    "JobHandle",
    "JobResult",
    "JobSpec",
    "JobState",
    "JobStatus",
    "MasterClient",
    "MasterStatus",
    "NodeCheckResult",
    "NodeRelaunch",
    "OptionValue",
    "Plan",
    "PluginHost",
    "PosixStorage",
    "ProcessSpec",
    "SchedulerBackend",
    "SchedulerOption",
    "Submission",
    "ToolOutput",
    "WorkerFailure",
    "api_retrying",
    "configure_logging",
    "control_plane",
    "env",
    "fetch_master_status",
    "get_host",
    "get_logger",
    "hookimpl",
    "master_retrying",
    "pci_numa_node",
    "preview_workers",
    "read_result",
    "remove_segments",
    "resolve_options",
    "rpc_retrying",
    "rundir",
    "run_tool",
    "status_of_result",
    "storage_retrying",
    "tail_logs",
    "try_import",
    "cpu_only_torch",
    "write_atomic",
]
