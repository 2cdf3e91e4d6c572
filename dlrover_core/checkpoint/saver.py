"""The agent's checkpoint saver: persists this node's snapshots in the background.

A scanning thread looks at the headers of the node's snapshot slots (every ``poll_s``; the
raw header bytes, and the checked headers only when those or its own tables changed). For
each rank, the oldest complete snapshot flagged for persistence and not yet persisted is
written through the storage hook as ``step_<S>/rank_<r>-round<R>.safetensors`` (staging
name, fsync, rename; ``R`` is the incarnation — the rendezvous round — that took the
snapshot, so a late write of a stale incarnation never overwrites a current file) by a
writer thread of its own, while holding a shared lock on its slot; a CRC32 of the data is
computed alongside. Ranks are written in parallel. Each persisted shard is reported to the
master, which commits the step when every rank's shard of one incarnation is in.

Nothing here holds a lock during storage I/O: the saver's lock guards only its tables, so
:meth:`CheckpointSaver.flush` has a bound, the agent's heartbeat never waits for a storage
write, and a write that never returns (a hung mount) is logged as slow
(``checkpoint_write_slow``) after a minute, or a quarter of ``persist_timeout_s`` if sooner,
and again at each such interval; after ``persist_timeout_s`` it is reported to the master
as fatal (the job ends FAILED naming the storage, the step and the error — a node is
never blamed for it). A write that fails (disk full, permission) is retried by
:func:`dlrover_core.retry.storage_retrying`, then given up, reported and logged; the slot
is freed, training goes on and the previous commit stays loadable. The final flush reports
whether the newest requested snapshot of every rank is durable.

At a failure (:meth:`CheckpointSaver.request_breakpoint`) every complete snapshot newer than
the last commit is persisted ("save at breakpoint"), so the newest step all ranks hold can
still be committed. It runs in the background, beside the restarting workers.

Slots are re-opened when their name points at another file than the one held open (a
segment removed and re-created): a rank hosted again after a scale change is persisted
like any other, and nothing is carried over from the slots it had before.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

import attrs
import tenacity

from dlrover_core.checkpoint.memory import SLOTS
from dlrover_core.checkpoint.shm import SlotHeader, SnapshotSlot, segment_name
from dlrover_core.logging import get_logger
from dlrover_core.protocol.messages import CheckpointErrorReport, ShardAnswer, ShardReport
from dlrover_core.retry import storage_retrying
from dlrover_core.storage.base import CheckpointStorage

__all__ = ["CheckpointSaver", "FlushResult", "shard_path", "step_dir"]

log = get_logger()

_SLOTS = SLOTS  # (a rank's slots: two, three where snapshots are replicated; absent ones are skipped)
#: How often the saver reads the ``latest`` marker again while snapshots flagged for
#: persistence wait at or below the commit it knows and the last read told nothing new
#: (seconds; see ``_settle_below_commit``). A snapshot it has not seen there yet is looked
#: at on the next scan.
_MARKER_RECHECK_S = 0.5
#: Seconds between the saver's full scans of its slots when nothing it can see has changed
#: (no header rewritten, no table changed): at most the marker's re-check interval.
_FULL_SCAN_S = _MARKER_RECHECK_S / 2
#: Longest the saver waits for that read (seconds).
_MARKER_READ_TIMEOUT_S = 2.0
#: A shard write still in flight after this many seconds (or a quarter of
#: ``persist_timeout_s``, if sooner) is logged as slow, and again each such interval,
#: so a hung mount shows long before ``persist_timeout_s`` fails the job.
_SLOW_WRITE_WARN_S = 60.0
_CHUNK = 64 * 2**20


def step_dir(step: int) -> str:
    """``step_<S>`` (10 digits): the directory of one step's files."""
    return f"step_{step:010d}"


def shard_path(step: int, rank: int, round_index: int | None = None) -> str:
    """Path of one rank's shard of ``step``, written by incarnation ``round_index``
    (``None``: the name of format 1, before incarnations were recorded)."""
    if round_index is None:
        return f"{step_dir(step)}/rank_{rank:05d}.safetensors"
    return f"{step_dir(step)}/rank_{rank:05d}-round{round_index}.safetensors"


@attrs.frozen(kw_only=True)
class FlushResult:
    """What :meth:`CheckpointSaver.flush` achieved.

    Attributes:
        ok: every rank's newest snapshot requested for persistence is durable.
        reason: why not (names the storage, the step, the rank and the error).
        step: the step that is not durable, if one is known.
    """

    ok: bool
    reason: str = ""
    step: int | None = None


@attrs.define
class _Write:
    """A shard write in flight."""

    rank: int
    step: int
    seq: int
    since: float
    stuck_reported: bool = False
    slow_warnings: int = 0  # intervals of _slow_after_s() that checkpoint_write_slow has covered


class CheckpointSaver:
    """Persists the snapshots of this node's ranks.

    Args:
        job_id, node_id: which segments are this node's.
        storage: where to persist.
        report_shard: tells the master a shard is durable; returns its answer (the newest
            commit, and whether the shard was stale). Called from the saver's threads only.
        report_error: tells the master a shard write failed (or is stuck: ``fatal``).
            Called from the saver's threads only.
        agent: the fencing token of the agent (names the segments).
        poll_s: seconds between scans of the slot headers.
        persist_timeout_s: a shard write that has not returned after this many seconds is
            reported as stuck (fatal for the job); ``Checkpoint.persist_timeout_s``.
        retrying: the retry policy of a failing write (default
            :func:`dlrover_core.retry.storage_retrying`).
    """

    def __init__(
        self,
        *,
        job_id: str,
        node_id: int,
        storage: CheckpointStorage,
        report_shard: Callable[[ShardReport], ShardAnswer | None],
        report_error: Callable[[CheckpointErrorReport], Any],
        agent: int = 0,
        poll_s: float = 0.01,
        persist_timeout_s: float = 600.0,
        retrying: Callable[[], tenacity.Retrying] = storage_retrying,
    ) -> None:
        self.job_id = job_id
        self.node_id = node_id
        self.agent = agent
        self.storage = storage
        self._report_shard = report_shard
        self._report_error = report_error
        self._poll_s = poll_s
        self.persist_timeout_s = persist_timeout_s
        self._retrying = retrying
        self._ranks: tuple[int, ...] = ()
        self._slots: dict[tuple[int, int], SnapshotSlot] = {}
        self._writes: dict[int, _Write] = {}  # rank -> its write in flight
        self._errors: dict[tuple[tuple[int, int], int], str] = {}  # (slot identity, seq) -> why it was given up
        try:
            self.committed: int | None = storage.latest_step()
        except (OSError, ValueError):
            self.committed = None
        self._lock = threading.Lock()  # guards the tables above; never held during storage I/O
        self._changed = threading.Condition(self._lock)
        self._breakpoint: set[int] = set()  # ranks whose every snapshot newer than the commit is due
        self._marker_read_at = -_MARKER_RECHECK_S  # (monotonic) the last read of the marker
        self._below_seen: set[tuple[int, int]] = set()  # (rank, seq) below the commit, looked at
        self._marker_reader: threading.Thread | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dlrover-ckpt-saver", daemon=True)
        #: the first storage failure that makes the job fail (a stuck write), if any
        self.fatal: str | None = None

    # ----- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def set_ranks(self, ranks: list[int]) -> None:
        """The global ranks this node hosts in the current round. Snapshots of ranks it no
        longer hosts are dropped (after a pending breakpoint save)."""
        with self._lock:
            gone = set(self._ranks) - set(ranks) - self._breakpoint - set(self._writes)
            self._ranks = tuple(ranks)
            for rank in gone:
                self._drop_rank(rank)

    def _drop_rank(self, rank: int) -> None:
        """Close a rank's slots and remove its segments (only the files this saver opened:
        never a segment re-created by someone else under the same name)."""
        for index in range(_SLOTS):
            slot = self._slots.pop((rank, index), None)
            if slot is None:
                slot = SnapshotSlot.open(segment_name(self.job_id, self.node_id, rank, index, self.agent), create=False)
            if slot is None:
                continue
            if not slot.replaced():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(slot.path)
            self._errors = {k: v for k, v in self._errors.items() if k[0] != slot.identity}
            slot.close()

    def stop(self, timeout_s: float | None = None) -> FlushResult:
        """Persist what is due (at most ``timeout_s``, default ``persist_timeout_s``), stop
        the threads, close the slots (segments stay). Returns the flush's result."""
        result = self.flush(self.persist_timeout_s if timeout_s is None else timeout_s)
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        with self._lock:
            if not self._writes:  # a stuck writer keeps its slot open: its process exit closes it
                for slot in self._slots.values():
                    slot.close()
                self._slots.clear()
        return result

    def _loop(self) -> None:
        # Background persists yield the CPU to training: nice 19 for this thread (and the
        # writer threads it starts, which inherit it). (Linux: setpriority on a thread id.)
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        seen: tuple[Any, ...] | None = None
        full_scan_at = 0.0
        while not self._stop.wait(self._poll_s):
            try:
                # a full scan reads every slot's header (its checksum covers the layout: tens
                # of microseconds a slot) — only when a header or this saver's tables changed,
                # and every _FULL_SCAN_S regardless (the marker's re-reads are timed)
                now_seen = self._stamp()
                if now_seen != seen or time.monotonic() >= full_scan_at:
                    seen, full_scan_at = now_seen, time.monotonic() + _FULL_SCAN_S
                    self._settle_below_commit()
                    self._dispatch()
                self._watch_stuck()
            except Exception as exc:  # the saver must never take the agent down
                seen = None
                log.error("checkpoint_saver_error", node_id=self.node_id, error=f"{type(exc).__name__}: {exc}")

    def _stamp(self) -> tuple[Any, ...]:
        """What a scan's outcome depends on, cheaply: each slot's identity and raw header
        (:meth:`SnapshotSlot.stamp`), and this saver's tables (ranks, commit, writes in
        flight, breakpoint, given-up writes)."""
        with self._lock:
            ranks = sorted({*self._ranks, *self._breakpoint})
            parts: list[Any] = [tuple(ranks), self.committed, tuple(sorted(self._writes)),
                                tuple(sorted(self._breakpoint)), len(self._errors)]
            for rank in ranks:
                for index in range(_SLOTS):
                    slot = self._slot(rank, index)
                    parts.append(None if slot is None else (slot.identity, slot.stamp()))
        return tuple(parts)

    # ----- scanning ----------------------------------------------------------------------

    def _slot(self, rank: int, index: int) -> SnapshotSlot | None:
        """The rank's slot ``index``, re-opened when its name now points at another file."""
        slot = self._slots.get((rank, index))
        if slot is not None and slot.replaced() and rank not in self._writes:
            self._slots.pop((rank, index))
            slot.close()
            slot = None
        if slot is None:
            slot = SnapshotSlot.open(segment_name(self.job_id, self.node_id, rank, index, self.agent), create=False)
            if slot is not None:
                self._slots[(rank, index)] = slot
        return slot

    def _candidates(self, rank: int, *, everything: bool) -> list[tuple[SnapshotSlot, SlotHeader]]:
        """Snapshots of ``rank`` to persist, oldest first: flagged ones (or, with
        ``everything``, every complete one newer than the last commit)."""
        out = []
        for index in range(_SLOTS):
            slot = self._slot(rank, index)
            h = slot.header() if slot is not None else None
            if slot is None or h is None or not h.live or h.rank != rank or h.persisted:
                continue
            if self.committed is not None and h.step <= self.committed:
                continue
            if everything or h.persist_requested:
                out.append((slot, h))
        return sorted(out, key=lambda c: c[1].seq)

    def _below_commit(self) -> list[tuple[int, SnapshotSlot, SlotHeader]]:
        """(Under the lock) snapshots flagged for persistence, not written, at or below the
        commit this saver knows: ``(rank, slot, header)``."""
        out = []
        if self.committed is None:
            return out
        for rank in self._ranks:
            for index in range(_SLOTS):
                slot = self._slot(rank, index)
                h = slot.header() if slot is not None else None
                if (slot is not None and h is not None and h.live and h.rank == rank and h.persist_requested
                        and not h.persisted and h.step <= self.committed):
                    out.append((rank, slot, h))
        return out

    def _settle_below_commit(self, *, now: bool = False) -> None:
        """Snapshots flagged for persistence at or below the commit are not written, and
        would keep their slots (a worker waits for a free one). Where one appears that this
        saver has not looked at yet (or :data:`_MARKER_RECHECK_S` after the last look, or
        ``now``), read the ``latest`` marker again: if the master moved it back (a restore
        found the steps above it damaged, and the workers train them again), the commit this
        saver knows goes back with it and those snapshots are written, in order, before any
        newer one; those still at or below it are covered by a commit, and their slots are
        freed (logged as ``checkpoint_snapshot_superseded``)."""
        with self._lock:
            below = self._below_commit()
        if not below:
            return
        fresh = {(rank, h.seq) for rank, _, h in below} - self._below_seen
        if not (now or fresh or time.monotonic() - self._marker_read_at >= _MARKER_RECHECK_S):
            return
        self._marker_read_at = time.monotonic()
        marker = self._read_marker()
        if marker is False:
            return
        self._below_seen = {(rank, h.seq) for rank, _, h in below}
        with self._lock:
            if self.committed is not None and (marker is None or marker < self.committed):
                log.info("checkpoint_saver_commit_back", node_id=self.node_id, was=self.committed, latest=marker)
                self.committed = marker
            committed = self.committed
        for rank, slot, seen in below:
            if committed is None or seen.step > committed or not slot.try_lock(exclusive=False):
                continue
            try:
                h = slot.header()
                if h is not None and h.seq == seen.seq and h.awaiting_persist:
                    slot.mark_persisted()
                    log.info("checkpoint_snapshot_superseded", node_id=self.node_id, rank=rank, step=h.step,
                             committed=committed)
            finally:
                slot.unlock()

    def _read_marker(self) -> int | None | bool:
        """The storage's ``latest`` step (``None``: none), or ``False`` when it cannot be read
        within :data:`_MARKER_READ_TIMEOUT_S` (read on a thread of its own: a stuck mount must
        not stop the loop that reports stuck writes)."""
        if self._marker_reader is not None and self._marker_reader.is_alive():
            return False  # the last read has not returned yet
        result: list[Any] = []

        def read() -> None:
            try:
                result.append(self.storage.latest_step())
            except (OSError, ValueError) as exc:
                log.warning("checkpoint_marker_unreadable", node_id=self.node_id, error=str(exc))

        self._marker_reader = threading.Thread(target=read, name="dlrover-ckpt-marker", daemon=True)
        self._marker_reader.start()
        self._marker_reader.join(_MARKER_READ_TIMEOUT_S)
        return result[0] if result else False

    def _next(self, rank: int) -> tuple[SnapshotSlot, SlotHeader] | None:
        """What to write next for ``rank``: at a breakpoint the newest snapshot first, else
        the oldest flagged one (every flagged snapshot is written, in order)."""
        breakpoint_ = rank in self._breakpoint
        candidates = self._candidates(rank, everything=breakpoint_)
        if not candidates:
            if breakpoint_:
                self._breakpoint.discard(rank)
                if rank not in self._ranks:
                    self._drop_rank(rank)
            return None
        return candidates[-1] if breakpoint_ else candidates[0]

    def _dispatch(self) -> None:
        """Start a writer thread for every rank that has something to persist and no write
        in flight."""
        with self._lock:
            for rank in sorted({*self._ranks, *self._breakpoint}):
                if rank in self._writes:
                    continue
                found = self._next(rank)
                if found is None:
                    continue
                slot, h = found
                self._writes[rank] = _Write(rank=rank, step=h.step, seq=h.seq, since=time.monotonic())
                threading.Thread(target=self._write_job, args=(rank, slot, h), daemon=True,
                                 name=f"dlrover-ckpt-write-r{rank}").start()

    def _write_job(self, rank: int, slot: SnapshotSlot, seen: SlotHeader) -> None:
        try:
            self._persist(rank, slot, seen)
        except Exception as exc:
            log.error("checkpoint_saver_error", node_id=self.node_id, rank=rank, error=f"{type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._writes.pop(rank, None)
                self._changed.notify_all()

    def _watch_stuck(self) -> None:
        """Warn of writes in flight longer than :func:`_slow_after_s` (again at each
        multiple of it); report those that have not returned after ``persist_timeout_s``
        (once each)."""
        now = time.monotonic()
        every_s = self._slow_after_s()
        with self._lock:
            stuck = [w for w in self._writes.values()
                     if not w.stuck_reported and now - w.since > self.persist_timeout_s]
            for w in stuck:
                w.stuck_reported = True
            slow = [w for w in self._writes.values()
                    if not w.stuck_reported and now - w.since >= every_s * (w.slow_warnings + 1)]
            for w in slow:
                w.slow_warnings = int((now - w.since) // every_s)
        for w in slow:
            log.warning("checkpoint_write_slow", node_id=self.node_id, rank=w.rank, step=w.step,
                        storage=self.storage.url, waited_s=round(now - w.since, 1),
                        fails_after_s=self.persist_timeout_s)
        for w in stuck:
            reason = (f"checkpoint step {w.step} not durable: writing rank {w.rank}'s shard to storage "
                      f"{self.storage.url!r} has not returned after {now - w.since:.0f} s "
                      f"(checkpoint.persist_timeout_s={self.persist_timeout_s:g}); the storage is stuck")
            self._fail(reason, w.step, w.rank)

    def _slow_after_s(self) -> float:
        """Seconds after which a write in flight is logged as slow: ``_SLOW_WRITE_WARN_S``
        or a quarter of ``persist_timeout_s``, whichever is sooner."""
        return min(_SLOW_WRITE_WARN_S, self.persist_timeout_s / 4)

    def _fail(self, reason: str, step: int, rank: int) -> None:
        with self._lock:
            first = self.fatal is None
            if first:
                self.fatal = reason
            self._changed.notify_all()
        log.error("checkpoint_storage_stuck", node_id=self.node_id, rank=rank, step=step, storage=self.storage.url,
                  reason=reason)
        if first:
            self._tell(self._report_error, CheckpointErrorReport(
                node_id=self.node_id, rank=rank, step=step, error=reason, storage=self.storage.url, fatal=True,
                token=self.agent or None))

    def busy(self) -> bool:
        """Whether a shard write is in flight (the storage, not the workers, sets the pace)."""
        with self._lock:
            return bool(self._writes)

    # ----- synchronous API (tests, the agent's exit) ------------------------------------------

    def persist_due(self) -> int:
        """Persist, in the caller's thread, the flagged snapshots of each rank (oldest
        first); return how many were written."""
        self._settle_below_commit(now=True)
        written = 0
        while True:
            with self._lock:
                jobs = []
                for rank in self._ranks:
                    if rank in self._writes:
                        continue
                    candidates = self._candidates(rank, everything=False)
                    if candidates:
                        slot, h = candidates[0]
                        self._writes[rank] = _Write(rank=rank, step=h.step, seq=h.seq, since=time.monotonic())
                        jobs.append((rank, slot, h))
            if not jobs:
                return written
            for rank, slot, h in jobs:
                try:
                    written += bool(self._persist(rank, slot, h))
                finally:
                    with self._lock:
                        self._writes.pop(rank, None)
                        self._changed.notify_all()

    def request_breakpoint(self) -> None:
        """Save at breakpoint, in the background: persist every complete snapshot of the
        current ranks newer than the last commit (call when workers stop after a failure)."""
        with self._lock:
            self._breakpoint.update(self._ranks)

    def persist_breakpoint(self) -> int:
        """Save at breakpoint now, in the caller's thread; return the shards written."""
        with self._lock:
            ranks = sorted({*self._breakpoint, *self._ranks})
            self._breakpoint.clear()
        written = 0
        for rank in ranks:
            with self._lock:
                candidates = [] if rank in self._writes else self._candidates(rank, everything=True)
            for slot, h in reversed(candidates):
                written += bool(self._persist(rank, slot, h))
            with self._lock:
                if rank not in self._ranks and rank not in self._writes:
                    self._drop_rank(rank)
        if written:
            log.info("checkpoint_breakpoint_saved", node_id=self.node_id, shards=written)
        return written

    def flush(self, timeout_s: float | None = None) -> FlushResult:
        """Wait until no breakpoint save, flagged snapshot or write is pending — at most
        ``timeout_s`` (default ``persist_timeout_s``) — and say whether every rank's newest
        snapshot requested for persistence is durable (the final checkpoint of a job).
        Waits without holding anything the agent's other threads need."""
        timeout_s = self.persist_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout_s
        background = self._thread.is_alive()
        self._settle_below_commit(now=True)
        while True:
            if not background:
                self.persist_breakpoint() if self._breakpoint else self.persist_due()
            with self._lock:
                if self.fatal is not None:
                    return FlushResult(ok=False, reason=self.fatal, step=None)
                busy = bool(self._writes) or bool(self._breakpoint) or any(
                    self._candidates(r, everything=False) for r in self._ranks)
                if not busy:
                    return self._final_state()
                left = deadline - time.monotonic()
                if left <= 0:
                    writes = sorted(self._writes.values(), key=lambda w: w.since)
                    if writes:
                        w = writes[0]
                        reason = (f"checkpoint step {w.step} not durable: writing rank {w.rank}'s shard to storage "
                                  f"{self.storage.url!r} has not returned after {time.monotonic() - w.since:.0f} s "
                                  f"(flush bound {timeout_s:g} s)")
                        return FlushResult(ok=False, reason=reason, step=w.step)
                    return FlushResult(ok=False, reason=f"checkpoint not durable: snapshots still wait for storage "
                                                        f"{self.storage.url!r} after {timeout_s:g} s")
                if background:
                    self._changed.wait(min(left, 0.05))
            if not background:
                time.sleep(min(self._poll_s, max(0.0, deadline - time.monotonic())))

    def _final_state(self) -> FlushResult:
        """(Under the lock, nothing pending.) Whether each rank's newest flagged snapshot
        was written; if one was given up, why."""
        for rank in self._ranks:
            newest: tuple[SnapshotSlot, SlotHeader] | None = None
            for index in range(_SLOTS):
                slot = self._slot(rank, index)
                h = slot.header() if slot is not None else None
                if slot is None or h is None or not h.live or not h.persist_requested:
                    continue
                if newest is None or h.seq > newest[1].seq:
                    newest = (slot, h)
            if newest is not None and newest[1].gave_up:
                slot, h = newest
                error = self._errors.get((slot.identity, h.seq), "the write failed")
                return FlushResult(ok=False, step=h.step, reason=(
                    f"checkpoint step {h.step} not durable: writing rank {rank}'s shard to storage "
                    f"{self.storage.url!r} failed: {error}"))
        return FlushResult(ok=True)

    # ----- one shard -----------------------------------------------------------------------

    def _persist(self, rank: int, slot: SnapshotSlot, seen: SlotHeader) -> bool:
        """Write one snapshot (the caller registered the write in ``_writes``); report it."""
        if not slot.try_lock(exclusive=False):
            return False  # the worker is writing into it; it will be a newer snapshot
        path = shard_path(seen.step, rank, seen.round)
        try:
            h = slot.header()
            if h is None or not h.live or h.seq != seen.seq:
                return False
            t0 = time.monotonic()
            try:
                crc, nbytes = self._write_retrying(slot, h, path)
            except OSError as exc:
                error = f"{type(exc).__name__}: {exc}"
                slot.mark_persisted(gave_up=True)  # the slot is free again; the next request tries anew
                with self._lock:
                    self._errors[(slot.identity, h.seq)] = error
                log.error("checkpoint_persist_failed", node_id=self.node_id, rank=rank, step=h.step,
                          storage=self.storage.url, error=error)
                self._tell(self._report_error, CheckpointErrorReport(
                    node_id=self.node_id, rank=rank, step=h.step, round=h.round, storage=self.storage.url,
                    error=error, token=self.agent or None))
                return False
            slot.mark_persisted()
            after = slot.header()
            abandoned = after is not None and after.abandoned
        finally:
            slot.unlock()
        persist_s = time.monotonic() - t0
        if abandoned:  # restored to an older step meanwhile: this shard belongs to no lineage
            log.info("checkpoint_shard_abandoned", node_id=self.node_id, rank=rank, step=h.step, round=h.round)
            return False
        answer = self._tell(self._report_shard, ShardReport(
            node_id=self.node_id, rank=rank, step=h.step, world_size=h.world_size, round=h.round,
            file=path.rsplit("/", 1)[-1], crc32=crc, bytes=nbytes, persist_s=round(persist_s, 6),
            token=self.agent or None, due=h.persist_requested))
        if answer is not None and answer.committed is not None:
            with self._lock:
                self.committed = max(self.committed or -1, answer.committed)
        if answer is not None and answer.stale:
            log.info("checkpoint_shard_stale", node_id=self.node_id, rank=rank, step=h.step, round=h.round,
                     reason=answer.reason)
        log.debug("checkpoint_shard_persisted", rank=rank, step=h.step, mb=round(nbytes / 2**20, 1),
                  persist_s=round(persist_s, 3))
        return True

    def _write_retrying(self, slot: SnapshotSlot, h: SlotHeader, path: str) -> tuple[int, int]:
        for attempt in self._retrying():
            with attempt:
                return self._write(slot, h, path)
        raise AssertionError("unreachable")  # pragma: no cover

    def _write(self, slot: SnapshotSlot, h: SlotHeader, path: str) -> tuple[int, int]:
        """Write header + data of the slot; return (CRC32 of the data, data bytes)."""
        assert slot.mm is not None
        view = memoryview(slot.mm)
        data = view[h.data_off : h.data_off + h.data_len]
        result: dict[str, int] = {}
        # zlib releases the GIL on large buffers: the checksum runs while the data is written
        crc_thread = threading.Thread(target=lambda: result.__setitem__("crc", zlib.crc32(data)))
        crc_thread.start()
        try:
            with self.storage.open_write(path) as f:
                f.write(view[h.layout_off : h.layout_off + h.layout_len])
                for begin in range(0, h.data_len, _CHUNK):
                    f.write(data[begin : begin + _CHUNK])
        finally:
            crc_thread.join()
            data.release()
            view.release()
        return result["crc"], h.data_len

    def _tell(self, report: Callable[[Any], Any], message: ShardReport | CheckpointErrorReport) -> Any:
        """Send ``message`` with ``report``; its answer, or ``None`` when it failed (logged)."""
        try:
            return report(message)
        except Exception as exc:
            log.error("checkpoint_report_failed", message=type(message).__name__, error=str(exc))
            return None
