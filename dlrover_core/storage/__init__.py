"""Checkpoint storage: the base class storage plugins subclass, and the built-in ``posix``."""

from dlrover_core.storage.base import LATEST_MARKER, CheckpointStorage
from dlrover_core.storage.posix import PosixStorage

__all__ = ["LATEST_MARKER", "CheckpointStorage", "PosixStorage"]

