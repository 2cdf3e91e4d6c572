"""The checkpoint storage interface: atomic files plus a commit marker."""

from __future__ import annotations

import abc
import contextlib
import os
from collections.abc import Iterator
from typing import BinaryIO, ClassVar

__all__ = ["CheckpointStorage", "LATEST_MARKER"]

#: Name of the commit marker: a small file holding the last committed step as decimal text.
LATEST_MARKER = "latest"


class CheckpointStorage(abc.ABC):
    """Where checkpoints are persisted, registered through ``dlrover_register_storages``.

    Paths are ``/``-separated and relative to the storage root given at construction
    (``cls(url)``). Implementations must make :meth:`open_write` atomic: readers never see a
    partial file under its final name, and after the context manager exits without error
    the data is durable (fsynced on a local filesystem).
    """

    name: ClassVar[str]

    def __init__(self, url: str) -> None:
        self.url = url

    @abc.abstractmethod
    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        """Yield a binary file; on clean exit publish it at ``path`` durably and atomically.

        On an exception the staged data is discarded and nothing appears at ``path``.
        """

    @abc.abstractmethod
    def read(self, path: str) -> bytes:
        """Return the whole file. Raises FileNotFoundError if absent."""

    @abc.abstractmethod
    def exists(self, path: str) -> bool:
        """Whether a published file exists at ``path``."""

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[str]:
        """Published paths under ``prefix`` (a directory-like prefix), sorted."""

    @abc.abstractmethod
    def delete(self, path: str) -> None:
        """Delete ``path``, or every path under it when it names a directory. Idempotent."""

    # ----- commit marker -------------------------------------------------------------

    def write_bytes(self, path: str, data: bytes) -> None:
        """Atomically and durably write ``data`` at ``path``."""
        with self.open_write(path) as f:
            f.write(data)

    def commit(self, step: int) -> None:
        """Mark ``step`` as the latest committed checkpoint (atomic replace of the marker)."""
        self.write_bytes(LATEST_MARKER, f"{int(step)}\n".encode())

    def check_writable(self) -> None:
        """Write and delete a small probe file, so that a storage the job cannot write is
        refused before anything starts. Raises ``OSError`` naming the problem."""
        probe = f".dlrover-write-probe-{os.getpid()}"
        self.write_bytes(probe, b"probe")
        self.delete(probe)

    def latest_step(self) -> int | None:
        """The last committed step, or ``None`` when nothing was ever committed."""
        if not self.exists(LATEST_MARKER):
            return None
        text = self.read(LATEST_MARKER).decode().strip()
        return int(text) if text else None
