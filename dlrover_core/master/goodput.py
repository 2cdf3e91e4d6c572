"""Goodput accounting from rank 0's progress records.

Goodput = productive step time / wall time, where productive time counts each step that the
final model builds on exactly once. Time spent on steps that are later recomputed (lost
when a restart resumes from an older checkpoint) is ``recomputed_s``; checkpoint stalls and
restores are timed separately (they are excluded from step time by ``report()``).
"""

from __future__ import annotations

from typing import Any

__all__ = ["GoodputTracker"]


class GoodputTracker:
    """Folds progress records (``{"type": "step"|"checkpoint"|"restore", ...}``) into totals."""

    def __init__(self) -> None:
        self._pending: dict[int, float] = {}  # step -> seconds, for steps after the last commit
        self._committed_s = 0.0
        self.recomputed_s = 0.0
        self.checkpoint_stall_s = 0.0
        self.restore_s = 0.0
        self.last_step = -1
        self.last_committed_step: int | None = None

    @property
    def productive_s(self) -> float:
        return self._committed_s + sum(self._pending.values())

    def _discard_after(self, step: int) -> None:
        """Steps after ``step`` were lost: their time becomes recomputed time."""
        lost = [s for s in self._pending if s > step]
        for s in lost:
            self.recomputed_s += self._pending.pop(s)

    def add(self, record: dict[str, Any]) -> None:
        kind = record.get("type")
        if kind == "step":
            step, dt = int(record["step"]), float(record["dt"])
            if step <= self.last_step:
                self._discard_after(step - 1)
            self._pending[step] = dt
            self.last_step = step
        elif kind == "checkpoint":
            self.checkpoint_stall_s += float(record.get("stall_s", 0.0))
            if record.get("committed"):
                step = int(record["step"])
                for s in [s for s in self._pending if s <= step]:
                    self._committed_s += self._pending.pop(s)
                self.last_committed_step = step
        elif kind == "restore":
            self.restore_s += float(record.get("load_s", 0.0))
            step = int(record["step"])
            self._discard_after(step)
            self.last_step = step
