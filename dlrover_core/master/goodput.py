"""Goodput accounting: where the wall time of a job went.

Goodput = productive step time / wall time, where productive time counts each step that the
final model builds on exactly once (from rank 0's progress records,
:mod:`dlrover_core.protocol.progress`, that its agent forwards). The rest is broken down by
phase, on the master's clock:

* ``checkpoint_stall_s``: training waited on checkpoint saves (worker-measured);
* ``restore_s``: workers restoring a checkpoint (worker-measured);
* ``recomputed_s``: step time lost to failures and computed again;
* ``detection_s``: from the last progress before a failure to its report (a hang's timeout);
* ``restart_s``: from a failure's report to the first node joining the next round (stopping
  workers, saving at the breakpoint);
* ``rendezvous_s``: from a round's first join to its completion (the first round too);
* ``startup_s``: from a round's completion to its first step (process start, imports,
  process group; restore time excluded);
* ``reform_s``: the survivors re-forming the live world after a failure or for a joiner
  (worker-measured; docs/design.md §5a).

:class:`StepRate` measures how fast the job goes now, from the same records: seconds per step,
job-wide samples and tokens per second (``train.report(..., samples=, tokens=)``) and the ETA
to ``total_steps``, for ``/v1/status`` and the progress line.
"""

from __future__ import annotations

import statistics
from collections import deque
from typing import Any

from dlrover_core.protocol.progress import CheckpointRecord, LiveRecord, ProgressRecord, RestoreRecord, StepRecord

__all__ = ["GoodputTracker", "StepRate"]

#: How many of the newest counted steps are remembered to tell a late record from a step
#: trained twice (late records come a heartbeat or two after the newer generation's).
_COUNTED_KEPT = 4096

PHASES = ("detection_s", "restart_s", "rendezvous_s", "startup_s", "reform_s")


class GoodputTracker:
    """Folds progress records and lifecycle marks into totals."""

    def __init__(self) -> None:
        self._pending: dict[int, float] = {}  # step -> seconds, for steps after the last commit
        self._committed_s = 0.0
        self.recomputed_s = 0.0
        self.checkpoint_stall_s = 0.0
        self.restore_s = 0.0
        self.last_step = -1
        self.last_committed_step: int | None = None
        self.phases = dict.fromkeys(PHASES, 0.0)
        self.last_progress_t: float | None = None
        self._restart_begin: float | None = None
        self._rendezvous_begin: float | None = None
        self._round_complete: float | None = None
        self._restore_in_round = 0.0
        self._generation = 0  # the newest live generation rank 0's step records came from
        self._counted: dict[int, tuple[int, float]] = {}  # newest counted steps -> (generation, dt)

    @property
    def productive_s(self) -> float:
        return self._committed_s + sum(self._pending.values())

    # ----- records from rank 0 -------------------------------------------------------------

    def _discard_after(self, step: int) -> None:
        """Steps after ``step`` were lost: their time becomes recomputed time."""
        for s in [s for s in self._pending if s > step]:
            self.recomputed_s += self._pending.pop(s)
            self._counted.pop(s, None)

    def _count(self, step: int, dt: float, generation: int) -> None:
        self._pending[step] = dt
        self._counted[step] = (generation, dt)
        if len(self._counted) > _COUNTED_KEPT:
            del self._counted[next(iter(self._counted))]

    def add(self, record: ProgressRecord, now: float | None = None) -> None:
        """Fold one of rank 0's progress records in (``now``: when the master received it,
        on its clock; kinds other than steps, checkpoints, restores and re-forms are ignored)."""
        if isinstance(record, StepRecord):
            step, dt, generation = record.step, record.dt_s, record.generation
            if generation < self._generation:
                self._add_late(step, dt, generation)
                return
            self._generation = generation
            if step <= self.last_step:
                self._discard_after(step - 1)
            self._count(step, dt, generation)
            self.last_step = step
            if now is not None:
                self.last_progress_t = now
                if self._round_complete is not None:  # the first step of a round
                    self.phases["startup_s"] += max(0.0, now - self._round_complete - dt - self._restore_in_round)
                    self._round_complete = None
        elif isinstance(record, CheckpointRecord):
            self.checkpoint_stall_s += record.stall_s
        elif isinstance(record, LiveRecord):
            if record.reason != "join":  # rank 0 re-formed; a replacement's wait to join is not the survivors' time
                self.phases["reform_s"] += record.reform_s
        elif isinstance(record, RestoreRecord):
            self.restore_s += record.load_s
            self._restore_in_round += record.load_s
            self._discard_after(record.step)
            self.last_step = record.step
            self._generation = 0

    def committed(self, step: int) -> None:
        """Checkpoint ``step`` was committed (durable): the pending steps up to it are
        productive for good."""
        for s in [s for s in self._pending if s <= step]:
            self._committed_s += self._pending.pop(s)
        self.last_committed_step = step

    def _add_late(self, step: int, dt: float, generation: int) -> None:
        """A step record of an older live generation, arriving after the newer one's: rank 0
        moved to another node when the world re-formed, and that node's agent forwarded its
        records first. The survivors built on the step unless a newer generation trained it
        again (then the older generation's time was lost)."""
        counted = self._counted.get(step)
        if counted is None:
            if self.last_committed_step is not None and step <= self.last_committed_step:
                self._committed_s += dt  # committed before its record came
                self._counted[step] = (generation, dt)
            else:
                self._count(step, dt, generation)
            return
        kept_generation, kept_dt = counted
        if generation <= kept_generation:
            self.recomputed_s += dt
            return
        # an older generation's record of this step came first: the newer one is kept
        self.recomputed_s += kept_dt
        self._counted[step] = (generation, dt)
        if step in self._pending:
            self._pending[step] = dt
        else:
            self._committed_s += dt - kept_dt

    # ----- lifecycle marks (master clock) --------------------------------------------------

    def failed(self, now: float, *, silent_s: float = 0.0) -> None:
        """A failure was reported at ``now`` (the first one of its round). ``silent_s``: how
        long the agent saw no progress (a hang), which the master's clock underestimates by
        the heartbeat that carried the last progress."""
        if self.last_progress_t is not None:
            self.phases["detection_s"] += max(0.0, now - self.last_progress_t, silent_s)
        self._restart_begin = now
        self._round_complete = None

    def joined(self, now: float) -> None:
        """A node joined the round being formed."""
        if self._rendezvous_begin is None:
            self._rendezvous_begin = now
            if self._restart_begin is not None:
                self.phases["restart_s"] += max(0.0, now - self._restart_begin)
                self._restart_begin = None

    def round_completed(self, now: float, started: float) -> None:
        begin = self._rendezvous_begin if self._rendezvous_begin is not None else started
        self.phases["rendezvous_s"] += max(0.0, now - begin)
        self._rendezvous_begin = None
        self._round_complete = now
        self._restore_in_round = 0.0
        self._generation = 0

    # ----- the timeline --------------------------------------------------------------------------

    def timeline(self, wall_s: float) -> dict[str, float]:
        """Where ``wall_s`` seconds went (``/v1/status``'s ``goodput``, ``goodput.json``):
        ``wall_time_s``, ``goodput``, the productive time, each phase above, and
        ``other_s`` (the rest)."""
        parts = {"productive_s": self.productive_s, "checkpoint_stall_s": self.checkpoint_stall_s,
                 "restore_s": self.restore_s, "recomputed_s": self.recomputed_s, **self.phases}
        parts["other_s"] = max(0.0, wall_s - sum(parts.values()))
        return {"wall_time_s": round(wall_s, 3), "goodput": round(min(1.0, self.productive_s / wall_s), 4),
                **{k: round(v, 3) for k, v in parts.items()}}

    # ----- persistence (master restarts) ------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {"pending": {str(k): v for k, v in self._pending.items()}, "committed_s": self._committed_s,
                "recomputed_s": self.recomputed_s, "checkpoint_stall_s": self.checkpoint_stall_s,
                "restore_s": self.restore_s, "last_step": self.last_step,
                "last_committed_step": self.last_committed_step, "phases": dict(self.phases),
                "generation": self._generation}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GoodputTracker:
        g = cls()
        g._pending = {int(k): float(v) for k, v in data["pending"].items()}
        g._committed_s = data["committed_s"]
        g.recomputed_s, g.checkpoint_stall_s, g.restore_s = data["recomputed_s"], data["checkpoint_stall_s"], data["restore_s"]
        g.last_step, g.last_committed_step = data["last_step"], data["last_committed_step"]
        g.phases.update(data["phases"])  # (a journal from before reform_s lacks it: 0)
        g._generation = int(data.get("generation", 0))
        return g


#: How many of rank 0's newest step reports the rate is measured over.
RATE_WINDOW = 20


class StepRate:
    """How fast the job goes now, from rank 0's step records: seconds per step, samples and
    tokens per second (job-wide: ``train.report`` counts them for the whole job), and the
    ETA to ``total_steps``.

    Each record covers the wall-clock time since rank 0's previous record (its ``t``, the
    worker's clock, so checkpoint saves and evaluation between reports count), or its own
    ``dt`` when it is the first of a run of records. A record that does not continue the
    previous one (a restart went back to an older step, a live world re-formed, a restore)
    starts the window again: time across a failure is not step time.
    """

    def __init__(self, window: int = RATE_WINDOW) -> None:
        self.total_steps: int | None = None
        self.last_step = -1
        self._generation = 0
        self._last_t: float | None = None
        # (steps covered, seconds, samples or None, tokens or None), newest last
        self._spans: deque[tuple[int, float, float | None, float | None]] = deque(maxlen=window)

    def add(self, record: ProgressRecord) -> None:
        """Fold one of rank 0's progress records in (kinds other than steps and restores
        are ignored)."""
        if isinstance(record, RestoreRecord):
            self._restart(record.step)
            return
        if not isinstance(record, StepRecord):
            return
        step, generation = record.step, record.generation
        if generation < self._generation:
            return  # a late record of an older live generation (see GoodputTracker._add_late)
        if record.total_steps is not None:
            self.total_steps = record.total_steps
        t = record.unix_time_s
        if generation != self._generation or step <= self.last_step or self._last_t is None or t is None:
            if generation != self._generation or step <= self.last_step:
                self._spans.clear()
            steps, seconds = 1, record.dt_s
        else:
            steps, seconds = step - self.last_step, max(0.0, t - self._last_t)
        self._generation = generation
        self.last_step = step
        self._last_t = t
        samples, tokens = record.samples, record.tokens
        self._spans.append((steps, seconds, None if samples is None else float(samples),
                            None if tokens is None else float(tokens)))

    def _restart(self, step: int) -> None:
        self._spans.clear()
        self.last_step = step
        self._last_t = None
        self._generation = 0

    def round_started(self) -> None:
        """A new rendezvous round formed: its first record starts the window again."""
        self._last_t = None
        self._generation = 0

    @property
    def step_time_s(self) -> float | None:
        """Median seconds per step over the window (``None``: no step yet)."""
        per_step = [seconds / steps for steps, seconds, _, _ in self._spans if seconds > 0]
        return statistics.median(per_step) if per_step else None

    @property
    def eta_s(self) -> float | None:
        """Seconds until step ``total_steps - 1`` (``None`` without both a total and a step time)."""
        step_time = self.step_time_s
        if self.total_steps is None or step_time is None:
            return None
        return max(0, self.total_steps - 1 - self.last_step) * step_time

    def _per_s(self, index: int) -> float | None:
        spans = [(span[1], span[index]) for span in self._spans if span[index] is not None]
        seconds = sum(s for s, _ in spans)
        if not spans or seconds <= 0:
            return None
        return sum(count for _, count in spans) / seconds  # type: ignore[misc]

    @property
    def samples_per_s(self) -> float | None:
        """Job-wide samples per second over the window's reports that gave ``samples``."""
        return self._per_s(2)

    @property
    def tokens_per_s(self) -> float | None:
        """Job-wide tokens per second over the window's reports that gave ``tokens``."""
        return self._per_s(3)

    def to_dict(self) -> dict[str, Any]:
        """What a restarted master needs (the window refills from the next records)."""
        return {"total_steps": self.total_steps, "last_step": self.last_step}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepRate:
        rate = cls()
        rate.total_steps = data.get("total_steps")
        rate.last_step = int(data.get("last_step", -1))
        return rate
