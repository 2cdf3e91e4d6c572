"""Checkpointing: the worker-side Checkpointer and its on-disk format."""

from dlrover_core.checkpoint.checkpointer import Checkpointer, Restored

__all__ = ["Checkpointer", "Restored"]
