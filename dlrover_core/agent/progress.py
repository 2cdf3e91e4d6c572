"""Reading workers' progress files (the records of :mod:`dlrover_core.protocol.progress`, one
JSON object a line, appended by ``train.report()``, checkpoint saves and ``train.steps()``)."""

from __future__ import annotations

import contextlib
import json
import re
import time
from pathlib import Path

from dlrover_core.errors import ProtocolError
from dlrover_core.protocol.progress import (
    DoneRecord,
    ExceptionRecord,
    LiveReadyRecord,
    LiveRecord,
    ProgressRecord,
    StepRecord,
    WorkerException,
    read_line,
)

__all__ = ["ProgressTail", "exception_from_error_file", "exception_from_output"]

#: How much of the end of a worker's output is searched for its traceback (bytes).
_OUTPUT_TAIL_BYTES = 64 * 1024
_EXCEPTION_LINE = re.compile(r"^([A-Za-z_][\w.]*)(?::\s?(.*))?$")


def exception_from_output(log_file: Path, *, step: int) -> WorkerException | None:
    """The uncaught exception a worker died of, read from the traceback at the end of its
    output (``log_file``): for a worker that died before it recorded one itself (an error
    at import, before ``dlrover_core.train`` installed its hook, as any torchrun script).
    ``None`` when the output ends without a traceback. ``step``: the last step it reported."""
    try:
        with open(log_file, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - _OUTPUT_TAIL_BYTES))
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    start = text.rfind("Traceback (most recent call last):")
    if start < 0:
        return None
    lines = text[start:].splitlines()
    for i in range(len(lines) - 1, 0, -1):  # the last unindented line of the block names the exception
        line = lines[i].rstrip()
        if not line or line.startswith((" ", "\t")):
            continue
        match = _EXCEPTION_LINE.match(line)
        if match is None or not any(ch.isalpha() for ch in match.group(1)):
            continue
        return WorkerException(exc_type=match.group(1), message=(match.group(2) or "")[:1000], step=step,
                               before_first_step=step < 0, traceback="\n".join(lines[max(0, i - 20):i + 1])[-4000:])
    return None


def exception_from_error_file(error_file: Path, *, step: int) -> WorkerException | None:
    """The exception a worker wrote into its ``TORCHELASTIC_ERROR_FILE`` with torch's
    ``@record`` (``torch.distributed.elastic.multiprocessing.errors``): ``{"message":
    {"message": "ValueError: boom", "extraInfo": {"py_callstack": <traceback>, "timestamp":
    "<unix seconds>"}}}``, or the older form with a string message and a top-level
    ``timestamp`` (torch's ``ProcessFailure._get_error_data`` reads both). Its time is the
    file's modification time where that falls in the timestamp's second (finer: two ranks
    that failed in the same second are told apart). ``None`` when the file is missing or
    unreadable. ``step``: the last step the worker reported."""
    try:
        data = json.loads(error_file.read_text())
        message = data["message"]
        if isinstance(message, dict):
            text, extra = str(message.get("message", "")), message.get("extraInfo") or {}
            traceback, stamp = str(extra.get("py_callstack", "")), extra.get("timestamp")
        else:
            text, traceback, stamp = str(message), "", data.get("timestamp")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    exc_type, _, msg = text.partition(": ")
    if not exc_type or " " in exc_type:  # not "Type: message"
        exc_type, msg = "Exception", text
    try:
        when = float(stamp) if stamp is not None else None
    except (TypeError, ValueError):
        when = None
    with contextlib.suppress(OSError):  # the file was written as the exception passed: finer than whole seconds
        written = error_file.stat().st_mtime
        if when is None or int(written) == int(when):
            when = written
    return WorkerException(exc_type=exc_type, message=msg[:1000], step=step, before_first_step=step < 0,
                           traceback=traceback[-4000:], unix_time_s=when)


class ProgressTail:
    """Yields complete new records of one progress file on each :meth:`read`, and keeps
    what hang detection and failure reports need: the newest step, when progress was last
    seen (monotonic seconds), recent step times, and an uncaught exception if one was
    recorded."""

    def __init__(self, path: Path, started: float, *, joiner: bool = False,
                 step_times: tuple[float, ...] | list[float] = (), error_file: Path | None = None) -> None:
        self.path = path
        #: the worker's ``TORCHELASTIC_ERROR_FILE`` (torch's ``@record`` writes its exception there)
        self.error_file = error_file
        #: a replacement that joins the live world (its wait to join counts as progress time)
        self.joiner = joiner
        self._offset = 0
        self._partial = b""
        self.last_step = -1
        self.done = False  # the worker left train.steps() after its last step (it is exiting, not hung)
        self.live = False  # the worker loops with train.steps() in a live world (it can be replaced alone)
        self.last_progress = started
        self.step_times: list[float] = list(step_times)
        self.exception: WorkerException | None = None
        #: records read but not yet forwarded to the master (see :meth:`take_unsent`)
        self.unsent: list[ProgressRecord] = []

    def take_unsent(self) -> list[ProgressRecord]:
        """Every record read so far and not taken yet — whoever read it (a heartbeat, a
        failure report looking for an exception record) — in file order."""
        taken, self.unsent = self.unsent, []
        return taken

    def put_back(self, records: list[ProgressRecord]) -> None:
        """Records taken but not delivered (the master did not answer): send them next time."""
        self.unsent[:0] = records

    def read(self) -> list[ProgressRecord]:
        """The records appended since the last read. A line that is no well-formed record is
        skipped; a record of a type this version does not know (a newer worker's) counts as
        progress but is not returned."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()  # an incomplete last line waits for the next read
        records: list[ProgressRecord] = []
        seen = False
        for line in lines:
            if not line.strip():
                continue
            try:
                record = read_line(line)
            except ProtocolError:  # not a record (an unreadable exception: the exit code alone tells)
                continue
            seen = True
            if isinstance(record, StepRecord):
                self.last_step = record.step
                self.step_times = [*self.step_times[-19:], record.dt_s]
            elif isinstance(record, DoneRecord):
                self.done = True
            elif isinstance(record, (LiveReadyRecord, LiveRecord)):
                self.live = True
            elif isinstance(record, ExceptionRecord):
                self.exception = record.exception
            if record is not None:
                records.append(record)
        if seen:
            self.last_progress = time.monotonic()
            self.unsent.extend(records)
        return records
