"""What a failure was, and whether restarting can help.

* :func:`describe` names a failure in words (``SIGKILL``, ``exit code 3``, ``ValueError: ...
  at step 17``, ``hang: ...``, ``node lost``); :func:`failure_record` turns a reported
  failure into the :class:`~dlrover_core.protocol.FailureRecord` of the job's result;
  :func:`mark_root_causes` finds each incident's first failure (torchrun's root cause).
* :class:`DeterministicErrorDetector`: the same Python exception (type, message, step) on
  every rank of a round, in two failing rounds in a row, is a bug in the program, not bad
  luck — restarting again would only burn the budget. The same exception on every rank
  *before the first step* (at import or start-up) is the script's at its first occurrence.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence

import attrs

from dlrover_core.protocol.messages import WorkerException, WorkerFailure
from dlrover_core.protocol.result import FailureRecord

__all__ = ["DeterministicErrorDetector", "before_first_step", "describe", "failure_record", "mark_root_causes",
           "signal_name"]


def signal_name(exit_code: int | None) -> str | None:
    """``-9`` → ``"SIGKILL"``; codes ``128 + n`` from a shell count too; otherwise ``None``."""
    if exit_code is None:
        return None
    n = -exit_code if exit_code < 0 else (exit_code - 128 if 128 < exit_code < 160 else 0)
    try:
        return signal.Signals(n).name if n else None
    except ValueError:
        return None


def describe(failure: WorkerFailure) -> str:
    """One line for a reported failure."""
    kind = failure.kind
    if kind == "node_lost":
        return f"node lost ({failure.detail or 'no heartbeat'})"
    if kind == "hang":
        return f"hang ({failure.detail or 'no progress'})"
    exc = failure.exception
    if exc is not None:
        message = exc.message if len(exc.message) <= 160 else exc.message[:157] + "..."
        where = "before the first step" if before_first_step(exc) else f"at step {exc.step}"
        return f"{exc.exc_type}: {message} {where}"
    if kind not in ("", "signal", "exit") and failure.detail:  # e.g. a scheduler's "evicted"
        return f"{kind.replace('_', ' ')} ({failure.detail})"
    code = failure.exit_code
    return signal_name(code) or f"exit code {code}"


def failure_record(failure: WorkerFailure, *, time_s: float, round_index: int, node_id: int, step: int,
                   last_committed_step: int | None, action: str, reported_at: float) -> FailureRecord:
    """The job result's record of a reported failure: its signal, kind and description
    derived here, the job's progress and the master's decision given. ``reported_at``: the
    report's time (unix seconds), for a failure that does not say when it happened."""
    sig = signal_name(failure.exit_code)
    exc = failure.exception
    return FailureRecord(
        time_s=time_s, round=round_index, node_id=node_id, rank=failure.rank, local_rank=failure.local_rank,
        exit_code=failure.exit_code, signal=sig, step=step, last_committed_step=last_committed_step,
        action=action, kind=failure.kind or ("signal" if sig else "exit"), detail=describe(failure),
        unix_time_s=failure.unix_time_s if failure.unix_time_s is not None else reported_at,
        traceback=exc.traceback if exc is not None else "", error_file=failure.error_file,
    )


def mark_root_causes(records: Sequence[FailureRecord]) -> list[FailureRecord]:
    """``records`` with ``root_cause`` set on the first failure of each incident (torchrun's
    "first observed failure", ``torch.distributed.elastic.multiprocessing.errors.ChildFailedError.get_first_failure``:
    the earliest by the time it happened, not by the order the reports came in). An incident:
    a round's failures that were not recovered live — the one that restarted every worker
    (or ended the job) and those that followed from it (peers whose collectives failed
    because it died) — or a single failure recovered live (its peers went on)."""
    marked = [attrs.evolve(r, root_cause=r.recovery == "live") for r in records]
    rounds: dict[int, list[int]] = {}
    for i, r in enumerate(marked):
        if r.recovery != "live":
            rounds.setdefault(r.round, []).append(i)
    for indices in rounds.values():
        first = min(indices, key=lambda i: (marked[i].unix_time_s if marked[i].unix_time_s is not None
                                            else float("inf"), i))
        marked[first] = attrs.evolve(marked[first], root_cause=True)
    return marked


def _signature(exception: WorkerException) -> tuple[str, str, int]:
    return (exception.exc_type, exception.message, exception.step)


def before_first_step(exception: WorkerException | None) -> bool:
    """Whether a worker's exception record was raised before its first step: the record
    says so (``before_first_step``), or, from older workers, its step is -1 (nothing
    reported, nothing restored). ``False`` without a record."""
    return exception is not None and exception.raised_before_first_step()


class DeterministicErrorDetector:
    """Finds rounds in which every rank died of the same exception at the same step: the
    script's error when it came before the first step, or when the previous failing round
    died of the same."""

    def __init__(self) -> None:
        self._signatures: dict[int, dict[int, tuple[str, str, int] | None]] = {}
        self._early: dict[int, dict[int, bool]] = {}
        self._world: dict[int, int] = {}
        self._failing_rounds: list[int] = []

    def record(self, round_index: int, world_size: int, rank: int | None,
               exception: WorkerException | None) -> str | None:
        """Record a failed rank. Returns the verdict this completes, if any:
        ``"repeated"`` (every rank raised the same as in the previous failing round) or
        ``"script"`` (every rank raised the same before its first step); else ``None``."""
        if round_index not in self._signatures:
            self._signatures[round_index] = {}
            self._early[round_index] = {}
            self._world[round_index] = world_size
            self._failing_rounds.append(round_index)
        if rank is None:
            return None
        self._signatures[round_index][rank] = _signature(exception) if exception is not None else None
        self._early[round_index][rank] = before_first_step(exception)
        mine = self.uniform(round_index)
        if mine is None:
            return None
        earlier = [r for r in self._failing_rounds if r < round_index]
        if earlier and self.uniform(earlier[-1]) == mine:
            return "repeated"
        if all(self._early[round_index].values()):
            return "script"
        return None

    def uniform(self, round_index: int) -> tuple[str, str, int] | None:
        """The signature every rank of the round died with, if they all did."""
        sigs = self._signatures.get(round_index, {})
        values = set(sigs.values())
        if len(sigs) == self._world.get(round_index) and len(values) == 1 and None not in values:
            return values.pop()
        return None
