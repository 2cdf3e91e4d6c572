"""Pieces the CPU and GPU checkpoint benchmarks share (no torch import at module level)."""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path
from typing import Any

__all__ = ["shm_tensor", "wait_async_save"]


def wait_async_save(response: Any, called_at: float, timeout_s: float = 600) -> tuple[float, float]:
    """Wait for a DCP ``async_save`` to finish; returns (staged, done) ``perf_counter`` times.

    ``response`` is a plain future, or an ``AsyncSaveResponse`` (``use_async_staging``) whose
    ``staging_completion`` says when the state may change again. ``called_at``: when the call
    returned (a plain future is staged by then)."""
    if hasattr(response, "staging_completion"):
        response.staging_completion.result(timeout=timeout_s)
        staged = time.perf_counter()
        response.upload_completion.result(timeout=timeout_s)
    else:
        staged = called_at
        response.result(timeout=timeout_s)
    return staged, time.perf_counter()


def shm_tensor(nbytes: int, directory: str | Path, prefix: str) -> Any:
    """A zeroed (pre-touched) uint8 tensor of ``nbytes`` over a mapping of a file in
    ``directory`` (a tmpfs such as /dev/shm), unlinked at once: nothing can be left behind,
    and the memory goes with the tensor."""
    import torch  # heavy: torch

    path = Path(directory) / f"{prefix}-{os.getpid()}-{time.monotonic_ns()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.unlink(path)
        os.ftruncate(fd, nbytes)
        buf = torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)
    finally:
        os.close(fd)
    return buf.zero_()
