"""What every side of the checkpoint benchmark shares: this process, our worker under a
dlrover job, and DLRover 0.6.1's worker in its own venv (so: only stdlib, numpy and torch).

- :func:`summary` / :func:`add_stats`: a figure as ``{"median", "min", "max", "n"}``;
- :class:`DiskFloor`: the raw write + fsync of the same bytes, the floor every durable
  save is held against. Each side keeps one next to its own saves (same disk, same
  pre-warming, samples interleaved with its saves); ``checkpoint.py`` pools them into the
  run's one disk floor;
- :func:`digest`: a CRC32 per tensor, to check a restore is bit-exact without holding a
  second copy of the state.
"""

from __future__ import annotations

import os
import statistics
import time
import zlib
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

#: Bytes written (then deleted) to pre-warm a side's directory before its first timed write;
#: see :func:`prewarm_copies`.
PREWARM_BUDGET_BYTES = 12 << 30


def summary(samples: Iterable[float] | None) -> dict | None:
    """``{"median", "min", "max", "n"}`` of ``samples`` (seconds), ``None`` when empty."""
    xs = [float(x) for x in samples or [] if x is not None]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def add_stats(d: dict) -> dict:
    """For every ``X_samples`` list of numbers in ``d`` (nested dicts and lists of dicts
    too), add ``X_stats`` = :func:`summary` of it; returns ``d``."""
    for key, value in list(d.items()):
        if isinstance(value, dict):
            add_stats(value)
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for v in value:
                add_stats(v)
        elif (key.endswith("_samples") and isinstance(value, list) and value
              and all(isinstance(v, (int, float)) for v in value)):
            d[key[: -len("_samples")] + "_stats"] = summary(value)
    return d


def byte_views(state: Mapping[str, torch.Tensor]) -> list:
    """The state's tensors as flat uint8 numpy arrays (views, no copy)."""
    return [t.detach().contiguous().view(-1).view(torch.uint8).numpy() for t in state.values()]


def digest(state: Mapping[str, torch.Tensor]) -> dict[str, int]:
    """CRC32 of each tensor's bytes, by key."""
    return {k: zlib.crc32(v) for k, v in zip(state, byte_views(state), strict=True)}


def prewarm_copies(nbytes: int, reps: int) -> int:
    """How many copies of the state a side writes (and deletes) before its first timed
    write: as many as it will write while timed (``2 * reps + 6``: the saves, the floor
    samples, warm-ups), at most :data:`PREWARM_BUDGET_BYTES` in all, at least 2. Every side
    uses this, so each meets the disk after the same pre-warming."""
    return max(2, min(2 * reps + 6, PREWARM_BUDGET_BYTES // max(1, nbytes)))


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DiskFloor:
    """The raw write + fsync floor, kept next to one side's saves.

    :meth:`sample` writes the state's bytes with ``os.write`` into a new file in
    ``directory``, fsyncs the file and the directory, and records the seconds in
    ``samples``; the last ``keep`` files stay on disk, as checkpoints do under retention
    (on a thin-provisioned VM disk, writing blocks never written before is several times
    slower than rewriting freed ones, so deleting each file before the next write would
    flatter the floor). :meth:`prewarm` writes and deletes copies first, so the side's
    saves and its floor both meet blocks the disk has held before.
    """

    def __init__(self, directory: Path, keep: int = 2) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.samples: list[float] = []
        self._kept: list[Path] = []

    def _write(self, arrays: list) -> float:
        path = self.directory / f"raw{time.monotonic_ns()}.bin"
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            for a in arrays:
                view = memoryview(a)
                while view:
                    view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(self.directory)
        elapsed = time.perf_counter() - t0
        self._kept.append(path)
        while len(self._kept) > self.keep:
            self._kept.pop(0).unlink(missing_ok=True)
        return elapsed

    def prewarm(self, arrays: list, copies: int) -> None:
        """Write ``copies`` times the bytes, delete them, ``sync``, let the disk settle."""
        keep, self.keep = self.keep, copies
        try:
            for _ in range(copies):
                self._write(arrays)
        finally:
            self.keep = keep
            self.clear()
        os.sync()
        time.sleep(1.0)

    def sample(self, arrays: list) -> float:
        """One timed write + fsync; recorded in ``samples``."""
        elapsed = self._write(arrays)
        self.samples.append(elapsed)
        return elapsed

    def clear(self) -> None:
        """Delete the files kept so far."""
        while self._kept:
            self._kept.pop().unlink(missing_ok=True)
