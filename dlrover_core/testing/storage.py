"""An in-memory :class:`~dlrover_core.storage.CheckpointStorage` for tests."""

from __future__ import annotations

import contextlib
import io
import posixpath
import threading
from collections.abc import Iterator
from typing import BinaryIO, ClassVar

from dlrover_core.storage.base import CheckpointStorage

__all__ = ["InMemoryStorage"]


class InMemoryStorage(CheckpointStorage):
    """Checkpoint files held in this process's memory, registered as ``"memory"`` by the
    test kit (``Checkpoint(storage="memory", dir="any-name")``).

    It meets the contract the ``posix`` storage meets (see
    :class:`~dlrover_core.testing.StorageContract`): a file written with :meth:`open_write`
    appears under its final name only when the ``with`` block exits cleanly, all at once;
    an exception inside the block publishes nothing and leaves an older file untouched; so
    the ``latest`` commit marker is never torn. Instances built from the same ``url`` share
    their files, as two ``posix`` storages on one directory do: the Checkpointer and the
    commit coordinator each build their own instance. Nothing crosses a process boundary,
    so jobs whose master or agents run in other processes cannot use it.

    :meth:`reset` forgets every file (the ``dlrover_host`` fixture calls it).
    """

    name = "memory"

    _volumes: ClassVar[dict[str, dict[str, bytes]]] = {}
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, url: str) -> None:
        super().__init__(url)
        with self._lock:
            self._files = self._volumes.setdefault(url, {})

    @classmethod
    def reset(cls) -> None:
        """Forget the files of every instance."""
        with cls._lock:
            for files in cls._volumes.values():
                files.clear()
            cls._volumes.clear()

    @staticmethod
    def _norm(path: str) -> str:
        if path.startswith("/") or ".." in path.split("/"):
            raise ValueError(f"path {path!r} escapes the storage root")
        norm = posixpath.normpath(path) if path else ""
        return "" if norm == "." else norm

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        key = self._norm(path)
        if not key:
            raise ValueError("cannot write the storage root itself")
        staging = io.BytesIO()
        yield staging  # an exception here propagates and nothing is published
        data = staging.getvalue()
        with self._lock:
            self._files[key] = data

    def read(self, path: str) -> bytes:
        key = self._norm(path)
        with self._lock:
            try:
                return self._files[key]
            except KeyError:
                raise FileNotFoundError(f"{self.url}: {path}") from None

    def exists(self, path: str) -> bool:
        key = self._norm(path)
        with self._lock:
            return key in self._files or any(k.startswith(key + "/") for k in self._files) or not key

    def list(self, prefix: str = "") -> list[str]:
        key = self._norm(prefix)
        with self._lock:
            return sorted(k for k in self._files if not key or k.startswith(key + "/"))

    def delete(self, path: str) -> None:
        key = self._norm(path)
        with self._lock:
            for k in [k for k in self._files if k == key or not key or k.startswith(key + "/")]:
                del self._files[k]
