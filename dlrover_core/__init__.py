"""dlrover-core: self-healing distributed PyTorch training.

Describe a job with :class:`Job` and call ``.run()``; inside the training script use
:mod:`dlrover_core.train`. Plugins extend the core through the hooks in
:mod:`dlrover_core.hookspecs`, marked with :data:`hookimpl`.
"""

# first, before anything heavy: in a `dlrover run` process this keeps its stop signals (SIGINT,
# SIGTERM, ...) for the launcher from here on (dlrover_core.stoplatch); elsewhere it does nothing
from dlrover_core import stoplatch  # noqa: F401

# isort: split

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the names below, for type checkers and IDEs; at run time they load on first use
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

#: public name -> the module that defines it. Loaded on first use (PEP 562): a process that
#: imports one part of the package (a worker's ``dlrover_core.train``, an agent, a standby)
#: does not pay for the rest (the job runner, the schedulers, the agent's supervision):
#: about 0.1 s of every process's start.
_EXPORTS = {
    **dict.fromkeys(("CheckpointError", "DLRoverError", "DeviceError", "JobSpecError", "MasterUnavailableError",
                     "PluginError", "PluginNotFoundError", "ProtocolError", "RendezvousError", "SchedulerError",
                     "TransientError"), "dlrover_core.errors"),
    "Job": "dlrover_core.job",
    "hookimpl": "dlrover_core.markers",
    **dict.fromkeys(("FailureRecord", "JobEvent", "JobResult", "JobState"), "dlrover_core.protocol"),
    **dict.fromkeys(("Checkpoint", "Failure", "JobSpec", "Nodes", "Optimizer", "Parallel"), "dlrover_core.spec"),
}


def _version() -> str:
    try:
        return version("dlrover-core")
    except PackageNotFoundError:  # pragma: no cover - running from a source tree
        return "0+unknown"


def __getattr__(name: str):
    if name == "__version__":
        value = _version()
    elif name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name]), name)
    else:
        raise AttributeError(f"module 'dlrover_core' has no attribute {name!r}")
    globals()[name] = value  # later uses skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


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
