"""Reading workers' progress files (JSON lines appended by ``train.report()``)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from dlrover_core.errors import ProtocolError
from dlrover_core.protocol.codec import decode
from dlrover_core.protocol.messages import WorkerException

__all__ = ["ProgressTail"]


class ProgressTail:
    """Yields complete new records of one progress file on each :meth:`read`, and keeps
    what hang detection and failure reports need: the newest step, when progress was last
    seen (monotonic seconds), recent step times, and an uncaught exception if one was
    recorded."""

    def __init__(self, path: Path, started: float) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""
        self.last_step = -1
        self.done = False  # the worker left train.steps() after its last step (it is exiting, not hung)
        self.live = False  # the worker loops with train.steps() in a live world (it can be replaced alone)
        self.last_progress = started
        self.step_times: list[float] = []
        self.exception: WorkerException | None = None
        #: records read but not yet forwarded to the master (see :meth:`take_unsent`)
        self.unsent: list[dict[str, Any]] = []

    def take_unsent(self) -> list[dict[str, Any]]:
        """Every record read so far and not taken yet — whoever read it (a heartbeat, a
        failure report looking for an exception record) — in file order."""
        taken, self.unsent = self.unsent, []
        return taken

    def put_back(self, records: list[dict[str, Any]]) -> None:
        """Records taken but not delivered (the master did not answer): send them next time."""
        self.unsent[:0] = records

    def read(self) -> list[dict[str, Any]]:
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
        records = []
        for line in lines:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            kind = record.get("type")
            if kind == "step":
                self.last_step = int(record["step"])
                self.step_times = [*self.step_times[-19:], float(record.get("dt", 0.0))]
            elif kind == "done":
                self.done = True
            elif kind in ("live_ready", "live"):
                self.live = True
            elif kind == "exception":
                try:
                    self.exception = decode(WorkerException, record)
                except ProtocolError:  # unreadable: the failure is reported by its exit code alone
                    pass
            records.append(record)
        if records:
            self.last_progress = time.monotonic()
            self.unsent.extend(records)
        return records
