"""The job master's journal: what a restarted master needs to go on where the dead one stopped.

Two files in the run's log directory:

* ``master_journal.json`` — a full snapshot of the master (:meth:`JobMaster.snapshot`),
  written atomically (temp file, fsync, rename) *before* every decision the job must
  survive takes effect: a round formed (with its store's port), a restart ordered, a node
  relaunched or excluded, a step committed, the job finished. The answer that carries a
  decision to an agent, and a relaunch through the scheduler, only happen after the write.
  The master also writes one for soft state (progress, metrics, goodput) every half second,
  or every ``nodes / 500`` seconds in a job of more than 250 nodes (``soft_state_journal_s``).
* ``master_journal.log`` — one JSON line per change of a single node since that snapshot
  (registered with its pid, told its place in a round, succeeded, exited). A line costs one
  ``write``; a snapshot of 10,000 nodes costs tens of milliseconds, too much for each of
  10,000 agents. Lines are flushed to the kernel, so they survive the master's process
  (a machine crash can lose the newest ones; snapshots are fsynced).

Journal points (the names the test hook takes): snapshots at ``round_formed``,
``restart_decided``, ``membership_changed``, ``step_committed``, ``restore_decided``, ``job_finished`` and
``master_recovered``; lines at ``node_placed`` (told its place in a round),
``node_succeeded``, ``node_lost``, ``node_excluded``, ``relaunch_issued`` and ``node_assigned``
(a host's launcher given its node id).

Every snapshot carries ``version`` (increasing: an older snapshot never replaces a newer one,
whatever the order the threads that took them write in) and ``seq``, the last log line it
already includes; :meth:`Journal.load` returns the snapshot and the lines after it.

:class:`WriteAhead` is how the master uses it: decisions taken inside one batch (a tick that
loses 1,000 nodes) are written once, when the batch ends, and the effects that must follow
the write (a relaunch) run after it.

Test hook: ``DLROVER_TEST_CRASH_AT=<point>:<n>`` makes the master exit at once
(``os._exit``, as a SIGKILL would) right after the ``n``-th journal write for ``point``
(e.g. ``round_formed:2``) of one master's life; it fires once per log directory (a marker
file records it), so the restarted master does not crash there again. Several points,
comma-separated, crash one job's master once at each (the restarted master counts afresh).
It exists for fault-injection tests only.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from dlrover_core.errors import DLRoverError
from dlrover_core.fileio import write_atomic as _write_atomic
from dlrover_core.logging import get_logger

__all__ = ["CRASH_AT_ENV", "Journal", "WriteAhead", "write_atomic"]

log = get_logger()

#: The fault-injection test hook's variable (see the module docstring).
CRASH_AT_ENV = "DLROVER_TEST_CRASH_AT"
#: Exit code of a master that crashed on purpose (the test hook).
CRASH_EXIT_CODE = 75


def write_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` durably (:func:`dlrover_core.fileio.write_atomic`
    with fsync)."""
    _write_atomic(path, text, fsync=True)


def _parse_crash_at(value: str | None) -> list[tuple[str, int]]:
    points = []
    for item in (value or "").split(","):
        if not item.strip():
            continue
        point, _, count = item.strip().partition(":")
        try:
            n = int(count or "1")
        except ValueError:
            n = 0
        if not point or n < 1:
            raise DLRoverError(f"{CRASH_AT_ENV}={value!r} is not <journal point>:<n>[,<journal point>:<n>...] "
                               "(e.g. round_formed:2); it is a fault-injection hook for tests: unset it")
        points.append((point, n))
    return points


class Journal:
    """Writes and reads a master's journal. Thread-safe (its own lock, taken after the
    master's lock when both are held).

    Args:
        path: the snapshot file (``master_journal.json``, ``rundir.JOURNAL``).
        log_path: the log of node changes (``rundir.JOURNAL_LOG``); default: ``path`` with
            the suffix ``.log``.
        crash_at: the test hook's ``point:n`` (default: ``$DLROVER_TEST_CRASH_AT``).
    """

    def __init__(self, path: Path, *, log_path: Path | None = None, crash_at: str | None = None) -> None:
        self.path = Path(path)
        self.log_path = Path(log_path) if log_path is not None else self.path.with_suffix(".log")
        self._lock = threading.Lock()
        self._version = -1
        self._last_body = ""
        self._lines: list[tuple[int, str]] = []  # (seq, line) appended since the last snapshot
        self._log = None
        self._crash = _parse_crash_at(crash_at if crash_at is not None else os.environ.get(CRASH_AT_ENV))
        self._counts: dict[str, int] = {}

    # ----- reading -----------------------------------------------------------------------

    def exists(self) -> bool:
        """Whether a journal was left by a master of this run."""
        return self.path.exists()

    def load(self) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """The newest snapshot (``None``: none) and the log entries written after it, in order.
        A torn last line (the master died while writing it) is skipped."""
        snapshot = json.loads(self.path.read_text()) if self.path.exists() else None
        after = int(snapshot.get("seq", 0)) if snapshot else 0
        entries = []
        try:
            text = self.log_path.read_text()
        except FileNotFoundError:
            text = ""
        for line in text.splitlines():
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if int(entry.get("seq", 0)) > after:
                entries.append(entry)
        entries.sort(key=lambda e: int(e["seq"]))
        if snapshot is not None:
            self._version = int(snapshot.get("version", -1))
        self._lines = [(int(e["seq"]), json.dumps(e, separators=(",", ":"))) for e in entries]
        return snapshot, entries

    # ----- writing -----------------------------------------------------------------------

    def write(self, snapshot: dict[str, Any], points: Iterable[str] = (), *, skip_unchanged: bool = False) -> bool:
        """Write ``snapshot`` (from :meth:`JobMaster.snapshot`) unless a newer one was written
        (or, with ``skip_unchanged``, unless nothing but its version changed since the last
        one); drop the log lines it includes. Returns whether it was written. Then fires the
        test hook for ``points``."""
        body = dict(snapshot)
        version, seq = int(body.pop("version")), int(snapshot["seq"])
        text = json.dumps(body, separators=(",", ":"))
        with self._lock:
            written = version > self._version and not (skip_unchanged and text == self._last_body)
            if written:
                write_atomic(self.path, f'{text[:-1]},"version":{version}}}')
                self._version, self._last_body = version, text
                keep = [(s, line) for s, line in self._lines if s > seq]
                if len(keep) != len(self._lines):
                    self._rewrite_log(keep)
        for point in points:
            self._maybe_crash(point)
        return written

    def append(self, entry: dict[str, Any], point: str | None = None) -> None:
        """Append one change (a dict with an increasing ``seq``) to the log."""
        line = json.dumps(entry, separators=(",", ":"))
        with self._lock:
            if self._log is None:
                self._log = open(self.log_path, "a", buffering=1)
            self._log.write(line + "\n")  # line-buffered: one write(2), in the kernel when this returns
            self._lines.append((int(entry["seq"]), line))
        if point is not None:
            self._maybe_crash(point)

    def _rewrite_log(self, keep: list[tuple[int, str]]) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
        write_atomic(self.log_path, "".join(line + "\n" for _, line in keep))
        self._lines = keep

    def remove(self) -> None:
        """Delete the journal (the job is over and its result written)."""
        with self._lock:
            if self._log is not None:
                self._log.close()
                self._log = None
            for p in (self.path, self.log_path):
                p.unlink(missing_ok=True)

    # ----- the test hook ---------------------------------------------------------------------

    def _maybe_crash(self, point: str) -> None:
        wanted = [n for p, n in self._crash if p == point]
        if not wanted:
            return
        self._counts[point] = n = self._counts.get(point, 0) + 1
        if n not in wanted:
            return
        marker = self.path.with_name(f"test_crash_{point}_{n}.fired")
        if marker.exists():  # the master already crashed here once: this is its successor
            return
        marker.write_text(str(os.getpid()))
        log.warning("master_test_crash", point=point, n=n, hook=CRASH_AT_ENV)
        os._exit(CRASH_EXIT_CODE)


class WriteAhead:
    """The master's write-ahead discipline over a :class:`Journal` (``None``: nothing is
    written, the effects run at once).

    :meth:`batch` holds the master's lock; journal points decided inside (:meth:`decided`)
    are written as one snapshot when the outermost batch ends, and the effects deferred with
    :meth:`after` run after that write. :meth:`note` appends one node's change as a log line.

    Args:
        journal: where to write.
        lock: the master's lock (an ``RLock``: a batch may open inside another).
        snapshot: the master's snapshot (:meth:`JobMaster.snapshot`); it reads :attr:`seq`.
    """

    def __init__(self, journal: Journal | None, lock: threading.RLock, snapshot: Callable[[], dict[str, Any]]) -> None:
        self.journal = journal
        self._lock = lock
        self._snapshot = snapshot
        self.seq = 0  # node changes logged
        self._due: list[str] = []  # journal points decided in the current batch, not written yet
        self._deferred: list[Callable[[], None]] = []  # effects that wait for that write (relaunches)
        self._depth = 0

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Hold the lock; write what was decided inside once, when the outermost batch ends."""
        with self._lock:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.flush()

    def decided(self, point: str) -> None:
        """A decision the job must survive was taken (``point`` names it): journal it before
        it takes effect — now, or at the end of the current batch."""
        self._due.append(point)
        if self._depth == 0:
            self.flush()

    def after(self, effect: Callable[[], None]) -> None:
        """Run ``effect`` once the decisions taken so far are journaled."""
        if self._depth == 0:
            self.flush()
            effect()
        else:
            self._deferred.append(effect)

    def flush(self) -> None:
        due, self._due = self._due, []
        deferred, self._deferred = self._deferred, []
        if due and self.journal is not None:
            try:
                self.journal.write(self._snapshot(), points=dict.fromkeys(due))
            except OSError as exc:  # the job goes on; a master restart would lose this decision
                log.error("master_journal_failed", points=list(dict.fromkeys(due)), error=f"{type(exc).__name__}: {exc}")
        for effect in deferred:
            effect()

    def note(self, entry: dict[str, Any], *, node_id: int, point: str | None = None) -> None:
        """Log one node's change (``entry`` gets the next ``seq``) before the answer or the
        effect that follows it. (A snapshot of 10,000 nodes per lost node would stall the
        master just when many are lost.)"""
        if self.journal is None:
            return
        self.seq += 1
        try:
            self.journal.append({"seq": self.seq, **entry}, point=point)
        except OSError as exc:
            log.error("master_journal_failed", node_id=node_id, error=f"{type(exc).__name__}: {exc}")

    def write_if_changed(self) -> bool:
        """Write a snapshot now, unless nothing changed since the last one (the periodic
        write for soft state: progress, metrics, goodput). Returns whether it wrote."""
        if self.journal is None:
            return False
        return self.journal.write(self._snapshot(), skip_unchanged=True)
