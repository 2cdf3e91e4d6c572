"""Reading workers' progress files (JSON lines appended by ``train.report()``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["ProgressTail"]


class ProgressTail:
    """Yields complete new records of one progress file on each :meth:`read`."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""
        self.last_step = -1

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
            if record.get("type") == "step":
                self.last_step = int(record["step"])
            records.append(record)
        return records
