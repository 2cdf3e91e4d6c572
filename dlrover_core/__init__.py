"""dlrover-core: self-healing distributed PyTorch training.

Describe a job with :class:`Job` and call ``.run()``; inside the training script use
:mod:`dlrover_core.train`. Plugins extend the core through the hooks in
:mod:`dlrover_core.hookspecs`, marked with :data:`hookimpl`.
"""

from importlib.metadata import PackageNotFoundError, version

from dlrover_core.errors import (
    CheckpointError,
    DeviceError,
    DLRoverError,
    JobSpecError,
    MasterUnavailableError,
    PluginError,
    PluginNotFoundError,
    RendezvousError,
    SchedulerError,
    TransientError,
)
from dlrover_core.events import JobEvent
from dlrover_core.plugins import hookimpl
from dlrover_core.result import FailureRecord, JobResult
from dlrover_core.schedulers.base import JobState
from dlrover_core.spec import Checkpoint, Failure, Job, Nodes, Optimizer, Parallel

try:
    __version__ = version("dlrover-core")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0+unknown"

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "DLRoverError",
    "DeviceError",
    "Failure",
    "FailureRecord",
    "Job",
    "JobEvent",
    "JobResult",
    "JobSpecError",
    "JobState",
    "MasterUnavailableError",
    "Nodes",
    "Optimizer",
    "Parallel",
    "PluginError",
    "PluginNotFoundError",
    "RendezvousError",
    "SchedulerError",
    "TransientError",
    "__version__",
    "hookimpl",
]
