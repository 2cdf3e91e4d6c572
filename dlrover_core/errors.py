"""The error tree of dlrover-core.

Every error the project raises on purpose derives from :class:`DLRoverError`, and each
also subclasses the matching builtin so callers can catch either::

    DLRoverError(Exception)
    ├── JobSpecError(ValueError)          a Job field is invalid: names field, value, fix
    ├── PluginError                       a plugin failed to load or misbehaved
    │   └── PluginNotFoundError(LookupError)   unknown backend name; lists the known ones
    ├── DeviceError                       an accelerator is missing or unhealthy
    ├── SchedulerError                    a scheduler backend refused or failed a request
    ├── CheckpointError                   a checkpoint could not be written or read
    ├── RendezvousError                   a rendezvous round could not complete
    ├── MasterUnavailableError            the job master could not be reached (after retries)
    ├── ProtocolError                     a malformed message between the job's processes
    └── TransientError                    a failure worth retrying (retries catch this)

Raised elsewhere, on the same root: ``torchrun.TorchrunArgumentError(DLRoverError, ValueError)``
(an argument ``dlrover run`` refuses; the command turns it into click's usage error) and
``train.LiveRecoveryError`` (see :mod:`dlrover_core.train.live`).
"""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "DLRoverError",
    "DeviceError",
    "JobSpecError",
    "MasterUnavailableError",
    "PluginError",
    "PluginNotFoundError",
    "ProtocolError",
    "RendezvousError",
    "SchedulerError",
    "TransientError",
]


class DLRoverError(Exception):
    """Root of every error raised by dlrover-core and its plugins."""


class JobSpecError(DLRoverError, ValueError):
    """A field of a :class:`~dlrover_core.Job` (or one of its parts) is invalid.

    Attributes:
        field: dotted name of the field, e.g. ``"nodes.min"``.
        value: the value that was rejected.
        allowed: what would have been accepted, in words.
    """

    def __init__(self, field: str, value: object, allowed: str) -> None:
        self.field = field
        self.value = value
        self.allowed = allowed
        super().__init__(f"invalid {field}={value!r}: {allowed}")


class PluginError(DLRoverError):
    """A plugin failed to import, or registered something malformed."""


class PluginNotFoundError(PluginError, LookupError):
    """No backend of the asked kind has that name.

    Attributes:
        kind: the registry kind ("accelerator", "scheduler", ...).
        name: the name that was asked for.
        known: the names that are registered.
    """

    def __init__(self, kind: str, name: str, known: list[str]) -> None:
        self.kind = kind
        self.name = name
        self.known = sorted(known)
        hint = ", ".join(self.known) or "none"
        package = KNOWN_PLUGIN_PACKAGES.get((kind, name))
        fix = (f"it is provided by the plugin package {package}: pip install {package}" if package else
               "install the plugin that provides it (pip install dlrover-plugin-<name>)")
        super().__init__(f"unknown {kind} {name!r}; known {kind}s: {hint}. {fix}, then check `dlrover plugins list`.")


#: Backends provided by this project's own plugin packages, by ``(kind, name)``: the package
#: an error names when one is asked for but not installed.
KNOWN_PLUGIN_PACKAGES: dict[tuple[str, str], str] = {
    ("accelerator", "cuda"): "dlrover-plugin-cuda",
    ("accelerator", "ascend"): "dlrover-plugin-ascend",
    ("accelerator", "ppu"): "dlrover-plugin-ppu",
    ("scheduler", "slurm"): "dlrover-plugin-slurm",
    ("scheduler", "k8s"): "dlrover-plugin-k8s",
    ("optimizer", "agd"): "dlrover-plugin-optim-agd",
}


class DeviceError(DLRoverError):
    """An accelerator is missing, misconfigured or unhealthy."""


class SchedulerError(DLRoverError):
    """A scheduler backend could not do what was asked (the engine's message is kept)."""


class CheckpointError(DLRoverError):
    """A checkpoint could not be written, committed or read."""


class RendezvousError(DLRoverError):
    """A rendezvous round could not complete (timeout, job stopped, too few nodes)."""


class MasterUnavailableError(DLRoverError, ConnectionError):
    """The job master did not answer within the retry policy."""


class ProtocolError(DLRoverError, ValueError):
    """A message between the job's processes is malformed (a field missing or mistyped)."""


class TransientError(DLRoverError):
    """A failure that is expected to go away; retry policies retry on it."""
