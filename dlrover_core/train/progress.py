"""``report(step, *, total_steps, samples, tokens, **metrics)``: the worker's progress, read by its agent.

Each call appends one record (a :class:`~dlrover_core.protocol.progress.StepRecord`, one JSON
object a line) to the file named by ``DLROVER_PROGRESS_FILE``; the agent tails it and
forwards rank 0's records to the master (goodput, live progress) and every rank's newest step
(hang detection). Checkpoint saves and restores, ``train.steps()`` and the excepthook write
their records through the same :class:`ProgressWriter`
(:mod:`dlrover_core.protocol.progress` has every kind). Outside dlrover the records go nowhere.

Step time is measured between marks: the end of the previous ``report()``, or of a
checkpoint save or restore, whichever is newest, so checkpoint stalls and restores are not
counted as productive time.
"""

from __future__ import annotations

import collections
import math
import operator
import os
import statistics
import sys
import threading
import time
import traceback
from typing import Any

from dlrover_core.errors import CheckpointError
from dlrover_core.protocol.progress import (
    ExceptionRecord,
    ProgressRecord,
    RestoreRecord,
    StepRecord,
    WorkerException,
    record_line,
)

__all__ = ["ProgressWriter", "get_writer", "install_excepthook", "report"]


def _to_float(name: str, value: Any) -> float:
    if hasattr(value, "item"):
        value = value.item()
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"report(): metric {name}={value!r} is not a number") from None
    return value


def _positive_int(name: str, value: Any) -> int:
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)  # int, numpy ints, 0-d integer tensors
    except TypeError:
        raise TypeError(f"train.report(): {name}={value!r} is not an int; pass the number of steps the run "
                        "trains in all (range(total_steps))") from None
    if number < 1:
        raise ValueError(f"train.report(): {name}={number} must be at least 1: the number of steps the run "
                         "trains in all (range(total_steps)); leave it out when the run has no fixed length")
    return number


def _count(name: str, value: Any) -> float:
    try:
        number = _to_float(name, value)
    except TypeError:
        raise TypeError(f"train.report(): {name}={value!r} is not a number: pass how many {name} the whole job "
                        "processed since the previous report (the global batch, all ranks together)") from None
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"train.report(): {name}={value!r} must be a finite number >= 0: how many {name} the "
                         "whole job processed since the previous report (the global batch, all ranks together)")
    return int(number) if number.is_integer() else number


class ProgressWriter:
    """Appends progress records to a file (or drops them when ``path`` is None)."""

    def __init__(self, path: str | None) -> None:
        #: the rank this process holds now (the live world changes it)
        self.rank = int(os.environ.get("RANK", "0"))
        #: the live world's generation this process trains in (0: the round's own group)
        self.generation = 0
        self.path = path
        self._file = open(path, "a", buffering=1) if path else None  # line-buffered
        self._lock = threading.Lock()
        self._mark = time.monotonic()
        self._recent_dts: collections.deque[float] = collections.deque(maxlen=self.TYPICAL_OF)

    def mark(self) -> None:
        """Start timing the next step now (after a save, restore or initialisation)."""
        self._mark = time.monotonic()

    #: the step a checkpoint restore went back to (``report`` of it or an earlier step is a replay)
    restored_step: int | None = None

    def write(self, record: ProgressRecord) -> None:
        """Append ``record`` (one line); a restore also moves :attr:`last_step` back."""
        if isinstance(record, RestoreRecord):
            self.last_step = record.step  # the step training goes on from
            self.restored_step = record.step
        if self._file is None:
            return
        line = record_line(record)
        with self._lock:
            self._file.write(line + "\n")

    last_step = -1
    #: steps this process reported (0: an exception now is raised before its first step)
    steps_reported = 0
    #: how many of the latest step times :attr:`typical_dt_s` looks at
    TYPICAL_OF = 9

    @property
    def typical_dt_s(self) -> float:
        """The median of the latest :attr:`TYPICAL_OF` reported step times (seconds; 0 before
        the first report): a step time one stall cannot inflate (a host frozen or cut off
        between a step's end and its report makes that one report's time as long as the
        stall). Read by the live world's watch thread while the training thread reports."""
        with self._lock:
            recent = tuple(self._recent_dts)
        return statistics.median(recent) if recent else 0.0

    @property
    def last_dt(self) -> float:
        """The last reported step's time (seconds; 0 before the first)."""
        with self._lock:
            return self._recent_dts[-1] if self._recent_dts else 0.0

    #: the run's length in steps, once a report gave it (repeated in every later record, so a
    #: restarted master or a late record still has it)
    total_steps: int | None = None

    def step(self, step: int, metrics: dict[str, Any], *, total_steps: int | None = None,
             samples: float | None = None, tokens: float | None = None) -> float:
        if total_steps is not None:
            self.total_steps = _positive_int("total_steps", total_steps)
        counts = {name: _count(name, value) for name, value in (("samples", samples), ("tokens", tokens))
                  if value is not None}
        if self.restored_step is not None and int(step) <= self.restored_step:
            raise CheckpointError(
                f"train.report(step={step}) after Checkpointer.load() restored step {self.restored_step}: steps up "
                f"to {self.restored_step} are already trained; resume the loop at restored.step + 1 (for step in "
                "range(restored.step + 1, steps)), or these steps are trained and counted twice")
        self.last_step = int(step)
        self.steps_reported += 1
        now = time.monotonic()
        dt = now - self._mark
        self._mark = now
        with self._lock:
            self._recent_dts.append(dt)
        clean = {k: _to_float(k, v) for k, v in metrics.items()}
        # (the generation: the master orders records of ranks on different nodes by it)
        self.write(StepRecord(step=int(step), rank=self.rank, dt_s=round(dt, 6), unix_time_s=time.time(),
                              metrics=clean, generation=self.generation, total_steps=self.total_steps, **counts))
        return dt


_writer: ProgressWriter | None = None
_writer_lock = threading.Lock()


def get_writer() -> ProgressWriter:
    """The process's writer, opened on first use from ``DLROVER_PROGRESS_FILE``."""
    global _writer
    with _writer_lock:
        if _writer is None:
            _writer = ProgressWriter(os.environ.get("DLROVER_PROGRESS_FILE"))
        return _writer


def report(step: int, *, total_steps: int | None = None, samples: float | None = None,
           tokens: float | None = None, **metrics: Any) -> None:
    """Report that ``step`` finished, with scalar ``metrics`` (floats, ints or 0-d tensors).

    Call it once per optimizer step on every rank. Rank 0's values are what the console,
    ``dlrover status``, ``JobResult.metrics`` and goodput use; every rank's step feeds hang
    detection.

    Args:
        step: the step that finished, counted from 0 (``for step in range(total_steps)``).
        total_steps: how many steps the run trains in all; with it the console shows
            ``step/total``, the percentage and the ETA. Give it once or on every call (it is
            remembered).
        samples: how many samples the **whole job** processed since the previous
            ``report`` (all ranks together: the global batch, ``per-rank batch x world size``,
            when you report every step). The console's ``samples/s`` is job-wide: the sum of
            rank 0's ``samples`` over its recent reports divided by their wall-clock time.
        tokens: the same count in tokens (``samples x sequence length``), for ``tokens/s``.
        metrics: any other scalars (``loss=...``, ``lr=...``); ``loss`` and ``val_loss`` are
            shown on the progress line.

    Raises:
        TypeError: a metric, ``samples`` or ``tokens`` is not convertible to float, or
            ``total_steps`` is not an int.
        ValueError: ``total_steps`` is below 1, or ``samples``/``tokens`` is negative or not finite.
        CheckpointError: ``step`` is at or below the step a checkpoint restore went back to
            (the loop ignored what ``Checkpointer.load()`` returned).
    """
    get_writer().step(step, metrics, total_steps=total_steps, samples=samples, tokens=tokens)


_hook_installed = False


def install_excepthook() -> None:
    """Record an uncaught exception (type, message, traceback, the last step reported or
    restored, and whether this process had reported a step yet) as a progress record
    before the process dies, so the master can tell a bug in the program (the same
    exception on every rank before the first step, or at the same step twice) from a
    transient failure. Installed once per process (later calls do nothing); warm workers
    install it before the entrypoint runs, so an exception at import is recorded too."""
    global _hook_installed
    if _hook_installed:
        return
    _hook_installed = True
    previous = sys.excepthook

    def hook(exc_type: type[BaseException], exc: BaseException, tb: Any) -> None:
        try:
            writer = get_writer()
            record = WorkerException(
                exc_type=exc_type.__qualname__ if exc_type.__module__ == "builtins"
                else f"{exc_type.__module__}.{exc_type.__qualname__}",
                message=str(exc)[:1000], step=writer.last_step, before_first_step=writer.steps_reported == 0,
                traceback="".join(traceback.format_exception(exc_type, exc, tb)[-40:]), unix_time_s=time.time())
            writer.write(ExceptionRecord(exception=record))
        finally:
            previous(exc_type, exc, tb)

    sys.excepthook = hook
