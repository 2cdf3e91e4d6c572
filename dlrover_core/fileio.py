"""One way to replace a small local file atomically (handles, journals, results).

Checkpoint data goes through the storage hook (:mod:`dlrover_core.storage`), not here.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["write_atomic"]


def write_atomic(path: str | os.PathLike[str], data: str | bytes, *, fsync: bool = False) -> None:
    """Replace ``path`` with ``data``: write a temp file beside it (named with this process's
    id, so concurrent writers never share one), optionally fsync it, rename it over
    ``path`` (POSIX ``rename(2)`` is atomic within a filesystem): a reader sees the old or
    the new file whole, never a torn one.

    Args:
        path: the file to replace; its directory must exist.
        data: text (written as UTF-8) or bytes.
        fsync: make the new content durable before the rename (a journal); without it a
            machine crash may lose the newest version, never tear it.

    Raises:
        OSError: the write or the rename failed (the old file is then untouched).
    """
    path = Path(path)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
