"""The agent's checkpoint saver: persists this node's snapshots in the background.

A thread polls the headers of the node's snapshot slots (every ``poll_s``). A complete
snapshot flagged for persistence and not yet persisted is written through the storage hook
as ``step_<S>/rank_<r>.safetensors`` (staging name, fsync, rename) while holding a shared
lock on its slot, so the worker's next save goes to the other slot; a CRC32 of the data is
computed alongside the write. Each persisted shard is reported to the master, which commits
the step when every rank's shard is in.

At a failure (:meth:`CheckpointSaver.request_breakpoint`) every complete snapshot newer than
the last commit is persisted ("save at breakpoint"), so the newest step all ranks hold can
still be committed. It runs in the background, beside the restarting workers: they restore
from memory and do not need it, and a save never overwrites a slot being persisted. A storage error (disk full, permission) is reported and logged; the
thread carries on and the previous commit stays loadable.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import zlib
from collections.abc import Callable
from typing import Any

from dlrover_core.checkpoint.shm import SlotHeader, SnapshotSlot, remove_segments, segment_name
from dlrover_core.logging import get_logger
from dlrover_core.storage.base import CheckpointStorage

__all__ = ["CheckpointSaver", "shard_path", "step_dir"]

log = get_logger()

_SLOTS = 2
_CHUNK = 64 * 2**20


def step_dir(step: int) -> str:
    return f"step_{step:010d}"


def shard_path(step: int, rank: int) -> str:
    return f"{step_dir(step)}/rank_{rank:05d}.safetensors"


class CheckpointSaver:
    """Persists the snapshots of this node's ranks.

    Args:
        job_id, node_id: which segments are this node's.
        storage: where to persist.
        report: called with ``(endpoint, body)`` to tell the master (``checkpoint_shard`` →
            answer holds ``committed``; ``checkpoint_error``); returns the master's answer.
        poll_s: seconds between scans of the slot headers.
    """

    def __init__(
        self,
        *,
        job_id: str,
        node_id: int,
        storage: CheckpointStorage,
        report: Callable[[str, dict[str, Any]], dict[str, Any]],
        poll_s: float = 0.01,
    ) -> None:
        self.job_id = job_id
        self.node_id = node_id
        self.storage = storage
        self._report = report
        self._poll_s = poll_s
        self._ranks: tuple[int, ...] = ()
        self._slots: dict[tuple[int, int], SnapshotSlot] = {}
        self._done_seq: dict[int, int] = {}  # rank -> newest seq persisted (or given up on)
        self.committed: int | None = storage.latest_step()
        self._busy = threading.Lock()
        self._breakpoint: tuple[int, ...] | None = None  # ranks whose snapshots to persist now
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="dlrover-ckpt-saver", daemon=True)
        self.persisted: list[dict[str, Any]] = []

    # ----- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def set_ranks(self, ranks: list[int]) -> None:
        """The global ranks this node hosts in the current round. Snapshots of ranks it no
        longer hosts are dropped (after a pending breakpoint save)."""
        with self._busy:
            gone = set(self._ranks) - set(ranks) - set(self._breakpoint or ())
            self._ranks = tuple(ranks)
            for rank in gone:
                self._drop_rank(rank)

    def _drop_rank(self, rank: int) -> None:
        for index in range(_SLOTS):
            slot = self._slots.pop((rank, index), None)
            if slot is not None:
                slot.close()
            remove_segments(segment_name(self.job_id, self.node_id, rank, index))

    def stop(self) -> None:
        """Persist what is due, stop the thread, close the slots (segments stay)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)
        if self._breakpoint is not None:
            self._run_breakpoint()
        self.persist_due()
        with self._busy:
            for slot in self._slots.values():
                slot.close()
            self._slots.clear()

    def _loop(self) -> None:
        # Background persists yield the CPU to training: nice 19 for this thread (and the
        # checksum threads it starts, which inherit it). Breakpoint saves run at normal
        # priority on the agent's main thread. (Linux: setpriority on a thread id.)
        with contextlib.suppress(OSError, AttributeError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        while not self._stop.wait(self._poll_s):
            try:
                if self._breakpoint is not None:
                    self._run_breakpoint()
                self.persist_due()
            except Exception as exc:  # the saver must never take the agent down
                log.error("checkpoint_saver_error", node_id=self.node_id, error=f"{type(exc).__name__}: {exc}")

    # ----- scanning ----------------------------------------------------------------------

    def _slot(self, rank: int, index: int) -> SnapshotSlot | None:
        slot = self._slots.get((rank, index))
        if slot is None:
            slot = SnapshotSlot.open(segment_name(self.job_id, self.node_id, rank, index), create=False)
            if slot is not None:
                self._slots[(rank, index)] = slot
        return slot

    def _candidates(self, rank: int, *, everything: bool) -> list[tuple[SnapshotSlot, SlotHeader]]:
        out = []
        for index in range(_SLOTS):
            slot = self._slot(rank, index)
            h = slot.header() if slot is not None else None
            if h is None or not h.valid or h.rank != rank or h.persisted or h.seq <= self._done_seq.get(rank, 0):
                continue
            if self.committed is not None and h.step <= self.committed:
                continue
            if everything or h.persist_requested:
                out.append((slot, h))
        return sorted(out, key=lambda c: c[1].seq)

    def pending(self) -> bool:
        """Whether a flagged snapshot waits to be persisted."""
        with self._busy:
            return any(self._candidates(r, everything=False) for r in self._ranks)

    def persist_due(self) -> int:
        """Persist the newest flagged snapshot of each rank; return how many were written."""
        with self._busy:
            written = 0
            for rank in self._ranks:
                candidates = self._candidates(rank, everything=False)
                if candidates and self._persist(rank, *candidates[-1]):
                    written += 1
                    for slot, _ in candidates[:-1]:  # older requests, superseded by a newer state
                        if slot.try_lock(exclusive=False):
                            slot.mark_persisted()
                            slot.unlock()
            return written

    def request_breakpoint(self) -> None:
        """Save at breakpoint, in the background: persist every complete snapshot of the
        current ranks newer than the last commit (call when workers stop after a failure)."""
        with self._busy:
            self._breakpoint = tuple(sorted({*(self._breakpoint or ()), *self._ranks}))

    def persist_breakpoint(self) -> int:
        """Save at breakpoint now, in the caller's thread; return the shards written."""
        self.request_breakpoint()
        return self._run_breakpoint()

    def _run_breakpoint(self) -> int:
        with self._busy:
            ranks, self._breakpoint = self._breakpoint or (), None
            written = 0
            for rank in ranks:
                for slot, h in reversed(self._candidates(rank, everything=True)):
                    written += bool(self._persist(rank, slot, h))
                if rank not in self._ranks:
                    self._drop_rank(rank)
            if written:
                log.info("checkpoint_breakpoint_saved", node_id=self.node_id, shards=written)
            return written

    def flush(self, timeout_s: float = 600.0) -> None:
        """Block until no breakpoint save or flagged snapshot waits (the final checkpoint
        of a job)."""
        deadline = time.monotonic() + timeout_s
        while (self._breakpoint is not None or self.pending()) and time.monotonic() < deadline:
            if self._breakpoint is not None:
                self._run_breakpoint()
            self.persist_due()
            time.sleep(self._poll_s)

    # ----- one shard -----------------------------------------------------------------------

    def _persist(self, rank: int, slot: SnapshotSlot, seen: SlotHeader) -> bool:
        if not slot.try_lock(exclusive=False):
            return False  # the worker is writing into it; it will be a newer snapshot
        try:
            h = slot.header()
            if h is None or not h.valid or h.seq != seen.seq:
                return False
            t0 = time.monotonic()
            try:
                crc, nbytes = self._write(slot, h)
            except OSError as exc:
                self._done_seq[rank] = h.seq  # do not retry this snapshot; the next one will try
                log.error("checkpoint_persist_failed", rank=rank, step=h.step, error=str(exc))
                self._tell("checkpoint_error", {"node_id": self.node_id, "rank": rank, "step": h.step,
                                                "error": f"{type(exc).__name__}: {exc}"})
                return False
            self._done_seq[rank] = h.seq
            slot.mark_persisted()
        finally:
            slot.unlock()
        persist_s = time.monotonic() - t0
        info = {"node_id": self.node_id, "rank": rank, "step": h.step, "world_size": h.world_size,
                "crc32": crc, "bytes": nbytes, "persist_s": round(persist_s, 6)}
        self.persisted.append(info)
        answer = self._tell("checkpoint_shard", info)
        if answer and answer.get("committed") is not None:
            self.committed = int(answer["committed"])
        log.debug("checkpoint_shard_persisted", rank=rank, step=h.step, mb=round(nbytes / 2**20, 1),
                  persist_s=round(persist_s, 3))
        return True

    def _write(self, slot: SnapshotSlot, h: SlotHeader) -> tuple[int, int]:
        """Write header + data of the slot; return (CRC32 of the data, data bytes)."""
        assert slot.mm is not None
        view = memoryview(slot.mm)
        data = view[h.data_off : h.data_off + h.data_len]
        result: dict[str, int] = {}
        # zlib releases the GIL on large buffers: the checksum runs while the data is written
        crc_thread = threading.Thread(target=lambda: result.__setitem__("crc", zlib.crc32(data)))
        crc_thread.start()
        try:
            with self.storage.open_write(shard_path(h.step, h.rank)) as f:
                f.write(view[h.layout_off : h.layout_off + h.layout_len])
                for begin in range(0, h.data_len, _CHUNK):
                    f.write(data[begin : begin + _CHUNK])
        finally:
            crc_thread.join()
            data.release()
            view.release()
        return result["crc"], h.data_len

    def _tell(self, endpoint: str, body: dict[str, Any]) -> dict[str, Any] | None:
        try:
            return self._report(endpoint, body)
        except Exception as exc:
            log.error("checkpoint_report_failed", endpoint=endpoint, error=str(exc))
            return None
