"""Checkpoint storage: the base class storage plugins subclass, and the built-in ``posix``."""

from typing import Any

from dlrover_core.storage.base import LATEST_MARKER, CheckpointStorage

__all__ = ["LATEST_MARKER", "CheckpointStorage", "PosixStorage"]


def __getattr__(name: str) -> Any:
    # PosixStorage is a built-in plugin module (it imports the plugin host): loaded on use,
    # so that the registry can import this package's base class first.
    if name == "PosixStorage":
        from dlrover_core.storage.posix import PosixStorage

        return PosixStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
