"""The built-in ``posix`` storage: a local or mounted directory."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

from dlrover_core.markers import hookimpl
from dlrover_core.storage.base import CheckpointStorage

__all__ = ["PosixStorage"]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class PosixStorage(CheckpointStorage):
    """Files under a directory. Writes go to a hidden staging file in the same directory,
    are fsynced, renamed over the final name, and the directory is fsynced (POSIX
    ``rename(2)`` is atomic within a filesystem)."""

    name = "posix"

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.root = Path(url.removeprefix("file://")).expanduser()

    def _path(self, path: str) -> Path:
        p = (self.root / path).resolve()
        root = self.root.resolve()
        if p != root and root not in p.parents:
            raise ValueError(f"path {path!r} escapes the storage root {str(self.root)!r}")
        return p

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        final = self._path(path)
        final.parent.mkdir(parents=True, exist_ok=True)
        fd, staging = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".staging", dir=final.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                yield f
                f.flush()
                os.fsync(f.fileno())
            os.replace(staging, final)
            _fsync_dir(final.parent)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staging)
            raise

    def read(self, path: str) -> bytes:
        return self._path(path).read_bytes()

    def exists(self, path: str) -> bool:
        return self._path(path).exists()

    def list(self, prefix: str = "") -> list[str]:
        base = self._path(prefix) if prefix else self.root
        if not base.exists():
            return []
        out = []
        for p in base.rglob("*"):
            if p.is_file() and not p.name.endswith(".staging"):
                out.append(p.relative_to(self.root).as_posix())
        return sorted(out)

    def delete(self, path: str) -> None:
        p = self._path(path)
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            with contextlib.suppress(FileNotFoundError):
                p.unlink()


@hookimpl
def dlrover_register_storages(register):
    register(PosixStorage)
