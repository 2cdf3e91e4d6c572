"""``FsspecStorage``: the CheckpointStorage contract on an fsspec filesystem."""

from __future__ import annotations

import contextlib
import os
import posixpath
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any, BinaryIO, ClassVar

import fsspec

from dlrover_core.backend import CheckpointStorage

__all__ = ["FsspecStorage"]

STAGING_SUFFIX = ".staging"


class FsspecStorage(CheckpointStorage):
    """Checkpoint files under an fsspec URL: ``FsspecStorage("s3://bucket/run1")``.

    The URL is the Job's ``Checkpoint(dir=...)``; the filesystem comes from
    :func:`fsspec.core.url_to_fs`, so credentials and options are fsspec's own (its config
    files, ``FSSPEC_<PROTOCOL>_<OPTION>`` environment variables, or the backend's default
    credential chain) and must be set on every node.

    How a file is published atomically depends on the filesystem:

    * where rename is atomic (:attr:`RENAME_PROTOCOLS`: local files and fsspec's in-memory
      filesystem), data goes to a hidden staging file next to the final name and is then
      moved over it; on a local disk the file and its directory are fsynced;
    * elsewhere (object stores: s3, gcs, az...), where an object becomes visible only when
      its upload completes, data is spooled to a local temporary file and uploaded in one
      ``put_file`` once the ``with`` block exits cleanly.

    Either way an exception inside ``open_write`` publishes nothing, so the ``latest``
    commit marker (written last by the core) never points at a torn checkpoint.
    """

    name = "fsspec"

    #: Protocols whose ``mv`` replaces the target atomically.
    RENAME_PROTOCOLS: ClassVar[frozenset[str]] = frozenset({"file", "local", "memory"})

    def __init__(self, url: str, **storage_options: Any) -> None:
        super().__init__(url)
        self.fs, root = fsspec.core.url_to_fs(url, **storage_options)
        self.root = root.rstrip("/") or "/"
        self._prefix = root.rstrip("/")  # "" for the filesystem's root
        protocols = {self.fs.protocol} if isinstance(self.fs.protocol, str) else set(self.fs.protocol)
        self.atomic_rename = bool(protocols & self.RENAME_PROTOCOLS)
        self._local = bool(protocols & {"file", "local"})

    def __repr__(self) -> str:
        return f"FsspecStorage({self.url!r})"

    def _path(self, path: str) -> str:
        if path.startswith("/") or ".." in path.split("/"):
            raise ValueError(f"path {path!r} escapes the storage root {self.url!r}")
        norm = posixpath.normpath(path) if path else "."
        return self.root if norm == "." else f"{self._prefix}/{norm}"

    @contextlib.contextmanager
    def open_write(self, path: str) -> Iterator[BinaryIO]:
        final = self._path(path)
        if final == self.root:
            raise ValueError("cannot write the storage root itself")
        if self.atomic_rename:
            with self._write_and_rename(final) as f:
                yield f
        else:
            with self._spool_and_upload(final) as f:
                yield f

    @contextlib.contextmanager
    def _write_and_rename(self, final: str) -> Iterator[BinaryIO]:
        parent, base = posixpath.split(final)
        staging = f"{parent}/.{base}.{uuid.uuid4().hex}{STAGING_SUFFIX}"
        self.fs.makedirs(parent, exist_ok=True)
        try:
            with self.fs.open(staging, "wb") as f:
                yield f
                if self._local:
                    f.flush()
                    os.fsync(f.fileno())
            self.fs.mv(staging, final)
            if self._local:
                _fsync_dir(parent)
        except BaseException:
            with contextlib.suppress(OSError):
                self.fs.rm(staging)
            raise

    @contextlib.contextmanager
    def _spool_and_upload(self, final: str) -> Iterator[BinaryIO]:
        with tempfile.NamedTemporaryFile(prefix="dlrover-fsspec-", suffix=STAGING_SUFFIX) as spool:
            yield spool  # an exception here skips the upload: nothing is published
            spool.flush()
            self.fs.put_file(spool.name, final)

    def read(self, path: str) -> bytes:
        return self.fs.cat_file(self._path(path))

    def exists(self, path: str) -> bool:
        return self.fs.exists(self._path(path))

    def list(self, prefix: str = "") -> list[str]:
        base = self._path(prefix)
        under = base.rstrip("/") + "/"
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        out = []
        for p in found:
            p = p.split("://", 1)[-1] if "://" in p else p
            if p.startswith(under) and not p.endswith(STAGING_SUFFIX):
                out.append(p[len(self._prefix) + 1:])
        return sorted(out)

    def delete(self, path: str) -> None:
        target = self._path(path)
        with contextlib.suppress(FileNotFoundError):
            if self.fs.isdir(target):
                self.fs.rm(target, recursive=True)
            elif self.fs.exists(target):
                self.fs.rm(target)
        self.fs.invalidate_cache(target)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

