"""A rank's shared-memory slots, as the worker sees them: save a snapshot, find and read
snapshots, abandon a lineage the job went back from. A rank has two slots; three where the
job keeps replicas of its snapshots on other nodes (below).

A save writes into a slot that no one is reading (the persister holds a shared lock on the
slot it persists) and that does not hold a snapshot still waiting for its persist. So a
save never overwrites a snapshot being persisted or due to be, and the newest complete
snapshot other than the one being written is always intact.

When both slots hold snapshots waiting for their persist (persists requested faster than
the storage writes them), a save that asks for persistence waits for the persister to free
a slot — backpressure, as ``torch.distributed.checkpoint.async_save`` gives when its
previous future is awaited — and one that does not is skipped. No snapshot due for
persistence is ever dropped: every rank persists the same steps, so every such step can be
committed (dropping the older of two requests, decided by each rank's timing alone, let
ranks persist different steps and none was ever committed).

**Replica pins** (``replicated``: the job keeps a replica of every snapshot in a buddy
node's memory, ``Checkpoint.replicas``). A lost node's ranks resume from their replicas, so
every other rank must still hold the step those replicas are of. Each snapshot is
published *pinned*; the node's agent marks it *confirmed* once the buddy holds it (or a
newer one) of every rank of the node, and *releases* it once the buddy holds a newer one
than the step before (:func:`dlrover_core.agent.replicas.pins_to_release`). A snapshot is
taken only once the rank's newest one is confirmed and a slot is not pinned; the ranks
agree on it at each step's start in ``train.steps`` (:meth:`MemorySnapshots.ready_to_save`,
in the live loop's all-reduce) and skip a memory-only save together otherwise (another
loop's save waits for it), so the snapshots go at the pace of their
replication while the training goes at its own (as Gemini, SOSP '23 §4, checkpoints to
remote memory as often as the network allows without slowing the iterations). No node's
snapshots run more than one ahead of its replicas, every rank's snapshots are of the same
steps, and every rank's three slots hold the step a lost node's replicas are of
(``tests/test_replica_pins.py`` checks it under random schedules). A save due for
persistence is never skipped (every rank persists the steps ``persist_every_steps`` names):
it waits for the confirmation (backpressure). While the buddy is silent (lost, or its puller stopped) the
agent marks the pins *held*: a save is skipped rather than waiting (nothing the survivors
may need is overwritten); a save due for persistence takes a held slot (storage first).
"""

from __future__ import annotations

import contextlib
import mmap
import threading
import time
from collections.abc import Iterator
from typing import Any

from dlrover_core.checkpoint.layout import CopyTargets, Layout, parse_header, tensor_views
from dlrover_core.checkpoint.shm import (
    FLAG_PERSIST,
    FLAG_PINNED,
    HEADER_SIZE,
    PIN_HELD,
    PIN_KEPT,
    SHM_DIR,
    SlotHeader,
    SnapshotSlot,
    segment_name,
    shm_free_bytes,
)
from dlrover_core.errors import CheckpointError
from dlrover_core.logging import get_logger

__all__ = ["SLOTS", "MemorySnapshots", "ShmTooSmall", "prefault_for_restore", "release_prefaulted", "slot_count",
           "slots_exist", "take_prefaulted"]

log = get_logger()

#: The most slots a rank has (three where snapshots are replicated, else two: :func:`slot_count`).
SLOTS = 3
_ALIGN = 4096
#: Seconds between looks at the slots while a save waits for the persister.
_WAIT_POLL_S = 0.005


def slot_count(replicated: bool) -> int:
    """Slots of a rank: three with replica pins (the buddy's newest step, the one before,
    and the newest snapshot), else two."""
    return 3 if replicated else 2


def _align(n: int, to: int = _ALIGN) -> int:
    return (n + to - 1) // to * to


class ShmTooSmall(OSError):
    """/dev/shm cannot hold the rank's snapshot slots of this state. ``needed_bytes`` says how much."""

    def __init__(self, needed_bytes: int, free_bytes: int) -> None:
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes
        super().__init__(
            f"/dev/shm has {free_bytes / 2**20:.0f} MiB free but the snapshot slots of this state (two; three where they are replicated) need "
            f"{needed_bytes / 2**20:.0f} MiB; give the container a larger /dev/shm "
            f"(docker --shm-size, a Memory emptyDir in Kubernetes)"
        )


class MemorySnapshots:
    """The worker side of a rank's snapshot slots in /dev/shm.

    Args:
        job_id, node_id, rank: name the segments (``dlrover-<job>-n<node>-a<agent>-r<rank>-s<slot>``).
        agent: the fencing token of the node's agent (names the segments).
        round_index: the rendezvous round of this worker, recorded in every snapshot.
        wait_timeout_s: longest a save waits for the persister, or for the agent to
            release a replica pin, to free a slot (seconds).
        replicated: the job replicates its snapshots (three slots, each snapshot published
            pinned: the module doc).
    """

    def __init__(self, *, job_id: str, node_id: int, rank: int, agent: int = 0, round_index: int = 0,
                 wait_timeout_s: float = 600.0, replicated: bool = False) -> None:
        self.rank = rank
        self.round = round_index
        self.replicated = replicated
        #: what names these slots and the snapshots they write (see :func:`take_prefaulted`)
        self.key = (job_id, node_id, rank, agent, round_index)
        self.wait_timeout_s = wait_timeout_s
        self.waited_s = 0.0  # seconds the last save waited for the persister or a replica pin
        self.waited_for = ""  # what it waited for: "persist" or "replicas"
        self.slots = []
        for s in range(SLOTS):  # (a third slot left by a replicated round is read, and written, too)
            slot = SnapshotSlot.open(segment_name(job_id, node_id, rank, s, agent), create=s < slot_count(replicated))
            if slot is not None:
                self.slots.append(slot)
        headers = [h for h in (slot.header() for slot in self.slots) if h is not None]
        self._seq = max((h.seq for h in headers), default=0)
        # per slot: the views a save copies into, for one mapping, data offset and plan
        self._targets: dict[int, tuple[Any, int, Any, CopyTargets]] = {}

    def _targets_for(self, index: int, layout: Layout, data_off: int) -> CopyTargets:
        """The views of slot ``index`` that ``layout``'s tensors are copied into: made once
        per mapping, data offset and layout plan, then reused (making views of 259 tensors
        costs about what copying a 1M-parameter state does)."""
        slot = self.slots[index]
        cached = self._targets.get(index)
        if (cached is not None and cached[0] is slot.mm and cached[1] == data_off and layout.plan is not None
                and cached[2] is layout.plan):
            return cached[3]
        self._targets.pop(index, None)
        targets = layout.targets(slot.mm, data_off)
        if layout.plan is not None:
            self._targets[index] = (slot.mm, data_off, layout.plan, targets)
        return targets

    def _live(self) -> list[tuple[SnapshotSlot, SlotHeader]]:
        out = []
        for slot in self.slots:
            h = slot.header()
            if h is not None and h.live and h.rank == self.rank:
                out.append((slot, h))
        return out

    def held(self, world_size: int) -> list[tuple[int, int]]:
        """``(step, round)`` of the complete snapshots of this rank taken at ``world_size``
        (``round``: the incarnation that wrote it)."""
        return sorted((h.step, h.round) for _, h in self._live() if h.world_size == world_size)

    def held_steps(self, world_size: int) -> list[int]:
        """Steps of the complete snapshots of this rank taken at ``world_size``."""
        return sorted({step for step, _ in self.held(world_size)})

    def _free(self, h: SlotHeader | None, *, persist: bool = False) -> tuple[int, int] | None:
        """How good a target the slot whose header is ``h`` is for the next save (lower
        first), or ``None`` when it holds a snapshot waiting for its persist, or pinned for
        the replicas (a save due for persistence may take a pin the agent holds for a
        silent buddy)."""
        if h is None or not h.live or h.rank != self.rank:
            return (0, 0)
        if h.awaiting_persist or (self.replicated and h.pinned and not (persist and h.pin == PIN_HELD)):
            return None  # (pins left by a replicated round bind only a replicated writer)
        return (1, h.seq)

    def ready_to_save(self) -> bool:
        """Whether a memory-only save now finds a slot without waiting: where snapshots are
        replicated, the buddy confirmed the rank's newest snapshot and a slot is neither
        pinned nor waiting for its persist. A replicated job's ranks agree on it at each
        step's start in ``train.steps`` and skip the step's memory-only save together when
        one is not ready (:meth:`dlrover_core.train.Checkpointer.agree`): the snapshots go
        at the pace of their replication, the training does not wait for it."""
        headers = [slot.header() for slot in self.slots]
        if self.replicated and any(h is not None and h.pinned and h.pin == PIN_KEPT and h.rank == self.rank
                                   for h in headers):
            return False
        return any(self._free(h) is not None for h in headers)

    def _lock_free_slot(self, *, persist: bool, unpinned: bool = False) -> SnapshotSlot | None:
        """A slot locked exclusively that holds nothing waiting for a persist or pinned for
        the replicas. A save due for persistence, or one of a replicated job, waits for one
        (at most ``wait_timeout_s``): for the persister, or for the agent to release a pin;
        a replicated save is skipped (``None``) when the agent holds the pins (the buddy is
        silent) or the wait ran out; any other save does not wait. ``unpinned``: a snapshot
        outside the replicas' schedule (see :meth:`save`): any free slot now, or ``None``."""
        t0 = time.monotonic()
        wait = (persist or self.replicated) and not unpinned
        while True:
            headers = [slot.header() for slot in self.slots]
            # the buddy must hold the newest snapshot before the next one is taken (module doc)
            unconfirmed = self.replicated and not unpinned and any(
                h is not None and h.pinned and h.pin == PIN_KEPT and h.rank == self.rank for h in headers)
            ranked = [] if unconfirmed else sorted(
                ((p, i) for i, h in enumerate(headers) if (p := self._free(h, persist=persist)) is not None))
            for _, i in ranked:
                slot = self.slots[i]
                if slot.try_lock(exclusive=True):  # the persister's shared lock keeps us out
                    if self._free(slot.header(), persist=persist) is not None:  # (again, under the lock)
                        self.waited_s = time.monotonic() - t0
                        return slot
                    slot.unlock()
            live = [h for h in headers if h is not None and h.live]
            pins = [h for h in live if h.pinned]
            self.waited_for = "replicas" if pins and not any(h.awaiting_persist for h in live) else "persist"
            if not wait or (self.replicated and not persist and any(h.pin == PIN_HELD for h in pins)):
                self.waited_s = time.monotonic() - t0
                return None
            if time.monotonic() - t0 > self.wait_timeout_s:
                self.waited_s = time.monotonic() - t0
                if not persist:
                    return None  # the replicas do not keep up: this snapshot is skipped
                raise CheckpointError(
                    f"rank {self.rank}: every snapshot slot still waits for its persist after "
                    f"{self.wait_timeout_s:g} s (checkpoint.persist_timeout_s): the checkpoint storage is not "
                    "writing; see the agent's log for the storage error")
            time.sleep(_WAIT_POLL_S)

    def save(self, layout: Layout, *, step: int, world_size: int, persist: bool, unpinned: bool = False) -> bool:
        """Copy ``layout``'s tensors into a free slot and publish it; return whether it was
        saved (a save without ``persist`` is skipped when no slot is free). ``unpinned``
        (not with ``persist``): a snapshot outside the replicas' schedule — a sharded
        world's replacement keeping the state a replica peer sent it, of a step its node's
        other ranks may or may not hold — published without a replica pin, so it neither
        waits for the buddy's confirmation of the newest snapshot nor holds back the next
        save for its own; skipped when no slot is free now.

        Raises:
            ShmTooSmall: /dev/shm cannot hold the slots (checked before allocating).
            CheckpointError: ``persist`` and no slot was freed within ``wait_timeout_s``.
            OSError: allocation failed anyway (e.g. another process filled /dev/shm).
        """
        meta = layout.header_bytes()
        data_off = _align(HEADER_SIZE + len(meta))
        needed = _align(data_off + layout.data_len, 2**20)
        self._check_capacity(needed)
        self.waited_s, self.waited_for = 0.0, ""
        slot = self._lock_free_slot(persist=persist, unpinned=unpinned)
        if slot is None:
            return False
        index = self.slots.index(slot)
        try:
            if slot.size < needed:  # the mapping changes: let go of the views of the old one
                self._targets.pop(index, None)
            slot.ensure_size(needed)
            slot.begin_write()
            assert slot.mm is not None
            slot.mm[HEADER_SIZE : HEADER_SIZE + len(meta)] = meta
            layout.copy_into(slot.mm, data_off, self._targets_for(index, layout, data_off))
            self._seq += 1
            pin = FLAG_PINNED if self.replicated and not unpinned else 0
            slot.publish(flags=(FLAG_PERSIST if persist else 0) | pin, step=step, seq=self._seq, world_size=world_size,
                         rank=self.rank, layout_len=len(meta), data_off=data_off, data_len=layout.data_len,
                         round_index=self.round)
        finally:
            slot.unlock()
        return True

    def _check_capacity(self, slot_bytes: int) -> None:
        have = [s.size for s in self.slots]
        missing = sum(max(0, slot_bytes - h) for h in have)
        if missing:
            free = shm_free_bytes()
            if free < missing:
                raise ShmTooSmall(needed_bytes=len(self.slots) * slot_bytes, free_bytes=free + sum(have))

    @contextlib.contextmanager
    def read(self, step: int, world_size: int, round_index: int | None = None,
             ) -> Iterator[tuple[dict[str, Any], dict[str, str]]]:
        """Yield ``(tensor views, metadata)`` of the complete snapshot of ``step`` (written
        in ``round_index`` when given), under a shared lock; the views are valid only inside
        the ``with`` block.

        Raises:
            LookupError: no complete snapshot of that step.
        """
        for slot in self.slots:
            slot.lock(exclusive=False)
            try:
                h = slot.header()
                if (h is not None and h.live and h.step == step and h.world_size == world_size and h.rank == self.rank
                        and (round_index is None or h.round == round_index)):
                    assert slot.mm is not None
                    entries, metadata, _ = parse_header(memoryview(slot.mm)[h.layout_off : h.layout_off + h.layout_len],
                                                  with_data=False)
                    yield tensor_views(slot.mm, h.data_off, entries), metadata
                    return
            finally:
                slot.unlock()
        raise LookupError(f"rank {self.rank} holds no complete snapshot of step {step}")

    def forget_after(self, step: int, *, keep_round: int | None = None) -> None:
        """Abandon snapshots newer than ``step`` (a lineage the job went back from), and
        with ``keep_round``, those of ``step`` itself written in another round. Takes only a
        shared lock, so it never waits for a persist in progress; the persister sees the
        flag and does not report what it wrote."""
        for slot in self.slots:
            with slot.shared():
                h = slot.header()
                if h is None or not h.state or h.abandoned:
                    continue
                if h.step > step or (keep_round is not None and h.step == step and h.round != keep_round):
                    slot.abandon()

    def prefault(self) -> threading.Thread | None:
        """Start faulting the pages of this rank's complete snapshots into this process's
        page tables, in a daemon thread (returned; ``None``: no snapshot to fault in).

        A fresh process that maps a slot takes a page fault on the first touch of each 4 KiB
        page: at 1 GiB about 0.09 s of a one-thread restore's 0.17 s (measured on 2 cores),
        paid inside ``load()``. Started at ``train.init()``, the faults overlap with building
        the model. Only reads: a save or ``close()`` meanwhile keeps the mapping alive while the
        thread's view exists (:meth:`SnapshotSlot._remap`)."""
        slots = []
        for slot in self.slots:
            try:
                h = slot.header()  # no lock: a torn answer only picks which pages to touch
            except Exception:  # (a header being written) not worth a failed start
                continue
            if h is not None and h.live and h.rank == self.rank and slot.mm is not None:
                slots.append((h.seq, slot.mm))
        if not slots:
            return None
        maps = [m for _, m in sorted(slots, key=lambda s: s[0], reverse=True)]  # the newest first
        thread = threading.Thread(target=_touch_pages, args=(maps,), name="dlrover-shm-prefault", daemon=True)
        thread.start()
        return thread

    def close(self) -> None:
        self._targets.clear()  # views of the mappings: they would keep them open
        for slot in self.slots:
            slot.close()


def _touch_pages(maps: list[mmap.mmap]) -> None:
    """Read one byte of every page of each mapping (numpy lets go of the GIL meanwhile)."""
    import numpy as np  # heavy: numpy

    for m in maps:
        try:
            pages = np.frombuffer(m, dtype=np.uint8)[:: mmap.PAGESIZE]
        except (ValueError, TypeError):  # closed meanwhile
            continue
        pages.max()
        del pages


#: The snapshots :func:`prefault_for_restore` mapped, until a Checkpointer takes them.
_prefaulted: MemorySnapshots | None = None
_prefaulted_lock = threading.Lock()


def prefault_for_restore(*, job_id: str, node_id: int, rank: int, agent: int, round_index: int,
                         replicated: bool = False) -> bool:
    """At ``train.init()`` of a worker started by an agent: map this rank's snapshot slots
    and begin faulting in the pages of its complete snapshots (:meth:`MemorySnapshots.prefault`),
    so that a restarted worker's first ``load()`` from memory copies without page faults.
    The mapping waits for :func:`take_prefaulted`. Returns whether a snapshot is being
    faulted in (none on a fresh start). Creates no segment: the slots of a rank that saved
    exist together (the first save's :class:`MemorySnapshots` made them all)."""
    global _prefaulted
    if not slots_exist(job_id=job_id, node_id=node_id, rank=rank, agent=agent):
        return False
    snapshots = MemorySnapshots(job_id=job_id, node_id=node_id, rank=rank, agent=agent, round_index=round_index,
                                replicated=replicated)
    thread = snapshots.prefault()
    with _prefaulted_lock:
        old, _prefaulted = _prefaulted, snapshots
    if old is not None:
        old.close()
    log.debug("checkpoint_prefault_started", rank=rank, started=thread is not None)
    return thread is not None


def slots_exist(*, job_id: str, node_id: int, rank: int, agent: int) -> bool:
    """Whether ``rank``'s slots exist on this node (a save made them), without creating any."""
    return all((SHM_DIR / segment_name(job_id, node_id, rank, s, agent)).exists() for s in range(slot_count(False)))


def take_prefaulted(*, job_id: str, node_id: int, rank: int, agent: int, round_index: int,
                    wait_timeout_s: float, replicated: bool = False) -> MemorySnapshots | None:
    """The snapshots :func:`prefault_for_restore` mapped, if they are these (same job, node,
    rank, agent, round and slots); else ``None`` (and they are let go)."""
    global _prefaulted
    with _prefaulted_lock:
        snapshots, _prefaulted = _prefaulted, None
    if snapshots is None:
        return None
    if snapshots.key != (job_id, node_id, rank, agent, round_index) or snapshots.replicated != replicated:
        snapshots.close()
        return None
    snapshots.wait_timeout_s = wait_timeout_s
    return snapshots


def release_prefaulted() -> None:
    """Let go of prefaulted snapshots no Checkpointer will take (memory snapshots are off, or
    the training loop began without one)."""
    global _prefaulted
    with _prefaulted_lock:
        snapshots, _prefaulted = _prefaulted, None
    if snapshots is not None:
        snapshots.close()
