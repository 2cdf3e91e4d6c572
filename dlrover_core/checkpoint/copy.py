"""Copying many large buffers quickly: numpy's memcpy, big ones split across a few threads.

numpy releases the GIL while it copies, so threads copy in parallel. torch's own
multi-threaded ``copy_`` was measured here to be often several times slower than one
thread when other processes share the cores (its OpenMP threads wait for each other); these
threads just take the next chunk.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["copy_all"]

_CHUNK = 16 * 2**20
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _threads() -> int:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(4, cores))


def _get_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_threads(), thread_name_prefix="dlrover-copy")
        return _pool


def copy_all(pairs: list[tuple[Any, Any]]) -> None:
    """Copy each ``(dst, src)`` pair of same-size 1-D uint8 numpy arrays."""
    import numpy as np  # heavy: numpy

    total = sum(src.nbytes for _, src in pairs)
    if total < 2 * _CHUNK or _threads() == 1:
        for dst, src in pairs:
            np.copyto(dst, src)
        return
    chunks = []
    for dst, src in pairs:
        for begin in range(0, src.nbytes, _CHUNK):
            chunks.append((dst[begin : begin + _CHUNK], src[begin : begin + _CHUNK]))
    for future in [_get_pool().submit(np.copyto, d, s) for d, s in chunks]:
        future.result()
