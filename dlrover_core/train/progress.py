"""``report(step, **metrics)``: the worker's progress, read by its agent.

Each call appends one JSON record to the file named by ``DLROVER_PROGRESS_FILE``; the agent
tails it and forwards rank 0's records to the master (goodput, live progress) and every
rank's newest step (hang detection). Outside dlrover the records go nowhere.

Step time is measured between marks: the end of the previous ``report()``, or of a
checkpoint save or restore, whichever is newest, so checkpoint stalls and restores are not
counted as productive time.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
import traceback
from typing import Any

from dlrover_core.errors import CheckpointError
from dlrover_core.protocol.codec import encode
from dlrover_core.protocol.messages import WorkerException

__all__ = ["ProgressWriter", "get_writer", "install_excepthook", "report"]


def _to_float(name: str, value: Any) -> float:
    if hasattr(value, "item"):
        value = value.item()
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"report(): metric {name}={value!r} is not a number") from None
    return value


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

    def mark(self) -> None:
        """Start timing the next step now (after a save, restore or initialisation)."""
        self._mark = time.monotonic()

    #: the step a checkpoint restore went back to (``report`` of it or an earlier step is a replay)
    restored_step: int | None = None

    def write(self, record: dict[str, Any]) -> None:
        if record.get("type") == "restore":
            self.last_step = int(record["step"])  # the step training goes on from
            self.restored_step = int(record["step"])
        if self._file is None:
            return
        line = json.dumps(record, allow_nan=True, separators=(",", ":"))
        with self._lock:
            self._file.write(line + "\n")

    last_step = -1
    #: steps this process reported (0: an exception now is raised before its first step)
    steps_reported = 0
    #: the last reported step's time (seconds; 0 before the first)
    last_dt = 0.0

    def step(self, step: int, metrics: dict[str, Any]) -> float:
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
        self.last_dt = dt
        clean = {k: _to_float(k, v) for k, v in metrics.items()}
        record = {"type": "step", "step": int(step), "rank": self.rank, "dt": round(dt, 6), "t": time.time(),
                  "metrics": {k: (v if math.isfinite(v) else str(v)) for k, v in clean.items()}}
        if self.generation:  # the master orders records of ranks on different nodes by it
            record["gen"] = self.generation
        self.write(record)
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


def report(step: int, **metrics: Any) -> None:
    """Report that ``step`` finished, with scalar ``metrics`` (floats, ints or 0-d tensors).

    Call it once per optimizer step on every rank. Rank 0's values are what the console,
    ``JobResult.metrics`` and goodput use; every rank's step feeds hang detection.

    Raises:
        TypeError: a metric is not convertible to float.
        CheckpointError: ``step`` is at or below the step a checkpoint restore went back to
            (the loop ignored what ``Checkpointer.load()`` returned).
    """
    get_writer().step(step, metrics)


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
                traceback="".join(traceback.format_exception(exc_type, exc, tb)[-40:]))
            writer.write({"type": "exception", **encode(record), "t": time.time()})
        finally:
            previous(exc_type, exc, tb)

    sys.excepthook = hook
