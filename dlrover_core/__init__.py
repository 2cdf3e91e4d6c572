"""dlrover-core: self-healing distributed PyTorch training.

Describe a job with :class:`Job` and call ``.run()``; inside the training script use
:mod:`dlrover_core.train`. Plugins extend the core through the hooks in
:mod:`dlrover_core.hookspecs`, marked with :data:`hookimpl`.
"""

# first, before anything heavy: in a `dlrover run` process this keeps its stop signals (SIGINT,
# SIGTERM, ...) for the launcher from here on (dlrover_core.stoplatch); elsewhere it does nothing
from dlrover_core import stoplatch  # noqa: F401

# isort: split

from importlib.metadata import PackageNotFoundError, version

from dlrover_core.errors import (
    CheckpointError,
    DeviceError,
    DLRoverError,
    JobSpecError,
    MasterUnavailableError,
    PluginError,
    PluginNotFoundError,
    ProtocolError,
    RendezvousError,
    SchedulerError,
    TransientError,
)
from dlrover_core.job import Job
from dlrover_core.markers import hookimpl
from dlrover_core.protocol import FailureRecord, JobEvent, JobResult, JobState
from dlrover_core.spec import Checkpoint, Failure, JobSpec, Nodes, Optimizer, Parallel

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
    "JobSpec",
    "JobSpecError",
    "JobState",
    "MasterUnavailableError",
    "Nodes",
    "Optimizer",
    "Parallel",
    "PluginError",
    "PluginNotFoundError",
    "ProtocolError",
    "RendezvousError",
    "SchedulerError",
    "TransientError",
    "__version__",
    "hookimpl",
]
