"""Checkpoint storage: the base class storage plugins subclass, and the built-in ``posix``."""

from dlrover_core.storage.base import LATEST_MARKER, CheckpointStorage

__all__ = ["LATEST_MARKER", "CheckpointStorage"]
