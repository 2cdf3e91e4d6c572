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

__all__ = ["copy_all", "prestart"]

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


def prestart() -> None:
    """Start the copy threads now (a checkpointer's construction), so that the first
    restore of a restarted process does not wait for them to spawn (measured ~6 ms)."""
    n = _threads()
    if n > 1:
        pool = _get_pool()
        barrier = threading.Barrier(n)  # each task holds its thread until all n run: n threads
        for future in [pool.submit(barrier.wait, 5.0) for _ in range(n)]:
            future.result()


def copy_all(pairs: list[tuple[Any, Any]]) -> None:
    """Copy each ``(dst, src)`` pair of numpy arrays of the same shape and dtype.

    Below ``2 * _CHUNK`` bytes in all, in this thread; else in tasks of about ``_CHUNK``
    bytes across the pool: a large contiguous pair is split, small pairs are grouped (a task
    per small tensor cost more than its copy)."""
    import numpy as np  # heavy: numpy

    total = sum(src.nbytes for _, src in pairs)
    if total < 2 * _CHUNK or _threads() == 1:
        _copy_group(pairs)
        return
    tasks: list[list[tuple[Any, Any]]] = []
    group: list[tuple[Any, Any]] = []
    group_bytes = 0
    for dst, src in pairs:
        if src.nbytes > _CHUNK and dst.flags.c_contiguous and src.flags.c_contiguous:
            d, s = dst.reshape(-1).view(np.uint8), src.reshape(-1).view(np.uint8)  # views, no copy
            tasks.extend([(d[begin : begin + _CHUNK], s[begin : begin + _CHUNK])]
                         for begin in range(0, s.nbytes, _CHUNK))
            continue
        group.append((dst, src))
        group_bytes += src.nbytes
        if group_bytes >= _CHUNK:
            tasks.append(group)
            group, group_bytes = [], 0
    if group:
        tasks.append(group)
    for future in [_get_pool().submit(_copy_group, task) for task in tasks]:
        future.result()


def _copy_group(pairs: list[tuple[Any, Any]]) -> None:
    import numpy as np  # heavy: numpy

    for dst, src in pairs:
        np.copyto(dst, src)
