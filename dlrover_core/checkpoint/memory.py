"""A rank's two shared-memory slots, as the worker sees them: save a snapshot, find and read
snapshots, forget an abandoned lineage.

A save writes into a slot that no one is reading (the persister holds a shared lock on the
slot it persists) and that does not hold a snapshot still waiting for its persist — the
older slot if it may go, else the newer one. So a save never waits for, nor overwrites, a
snapshot being persisted or due to be, and the newest complete snapshot other than the one
being written is always intact.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from dlrover_core.checkpoint.layout import Layout, parse_header, tensor_views
from dlrover_core.checkpoint.shm import (
    FLAG_PERSIST,
    HEADER_SIZE,
    SlotHeader,
    SnapshotSlot,
    segment_name,
    shm_free_bytes,
)

__all__ = ["MemorySnapshots", "ShmTooSmall"]

SLOTS = 2
_ALIGN = 4096


def _align(n: int, to: int = _ALIGN) -> int:
    return (n + to - 1) // to * to


class ShmTooSmall(OSError):
    """/dev/shm cannot hold two snapshots of this state. ``needed_bytes`` says how much."""

    def __init__(self, needed_bytes: int, free_bytes: int) -> None:
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes
        super().__init__(
            f"/dev/shm has {free_bytes / 2**20:.0f} MiB free but two snapshots of this state need "
            f"{needed_bytes / 2**20:.0f} MiB; give the container a larger /dev/shm "
            f"(docker --shm-size, a Memory emptyDir in Kubernetes)"
        )


class MemorySnapshots:
    """The worker side of a rank's snapshot slots in /dev/shm.

    Args:
        job_id, node_id, rank: name the segments (``dlrover-<job>-n<node>-r<rank>-s<slot>``).
    """

    def __init__(self, *, job_id: str, node_id: int, rank: int) -> None:
        self.rank = rank
        self.slots = []
        for s in range(SLOTS):
            slot = SnapshotSlot.open(segment_name(job_id, node_id, rank, s), create=True)
            assert slot is not None
            self.slots.append(slot)
        headers = [h for h in (slot.header() for slot in self.slots) if h is not None]
        self._seq = max((h.seq for h in headers), default=0)

    def _valid(self) -> list[tuple[SnapshotSlot, SlotHeader]]:
        out = []
        for slot in self.slots:
            h = slot.header()
            if h is not None and h.valid and h.rank == self.rank:
                out.append((slot, h))
        return out

    def held_steps(self, world_size: int) -> list[int]:
        """Steps of the complete snapshots of this rank taken at ``world_size``."""
        return sorted(h.step for _, h in self._valid() if h.world_size == world_size)

    def save(self, layout: Layout, *, step: int, world_size: int, persist: bool) -> None:
        """Copy ``layout``'s tensors into a free slot and publish it.

        Raises:
            ShmTooSmall: /dev/shm cannot hold the slots (checked before allocating).
            OSError: allocation failed anyway (e.g. another process filled /dev/shm).
        """
        meta = layout.header_bytes()
        data_off = _align(HEADER_SIZE + len(meta))
        needed = _align(data_off + layout.data_len, 2**20)
        self._check_capacity(needed)
        # Preference: a free slot; else one whose snapshot may go (not awaiting its persist),
        # oldest first. The persister holds a shared lock on the slot it writes out, so
        # try_lock skips it: a save never waits for, nor overwrites, a snapshot being persisted.
        def preference(slot: SnapshotSlot) -> tuple[int, int]:
            h = slot.header()
            if h is None or not h.valid or h.rank != self.rank:
                return (0, 0)
            return (2 if h.awaiting_persist else 1, h.seq)

        order = sorted(self.slots, key=preference)
        for slot in order:
            if slot.try_lock(exclusive=True):
                break
        else:  # both slots busy: cannot happen with one persister, but never spin
            slot = order[0]
            slot.lock(exclusive=True)
        try:
            replaced = slot.header()
            # overwriting a snapshot still waiting for its persist (persists requested faster
            # than the disk writes): the newer snapshot inherits the request, so the newest
            # requested state is always persisted
            inherit = replaced is not None and replaced.rank == self.rank and replaced.awaiting_persist
            slot.ensure_size(needed)
            slot.begin_write()
            assert slot.mm is not None
            slot.mm[HEADER_SIZE : HEADER_SIZE + len(meta)] = meta
            layout.copy_into(slot.mm, data_off)
            self._seq += 1
            slot.publish(flags=FLAG_PERSIST if persist or inherit else 0, step=step, seq=self._seq, world_size=world_size,
                         rank=self.rank, layout_len=len(meta), data_off=data_off, data_len=layout.data_len)
        finally:
            slot.unlock()

    def _check_capacity(self, slot_bytes: int) -> None:
        have = [s.size for s in self.slots]
        missing = sum(max(0, slot_bytes - h) for h in have)
        if missing:
            free = shm_free_bytes()
            if free < missing:
                raise ShmTooSmall(needed_bytes=SLOTS * slot_bytes, free_bytes=free + sum(have))

    @contextlib.contextmanager
    def read(self, step: int, world_size: int) -> Iterator[tuple[dict[str, Any], dict[str, str]]]:
        """Yield ``(tensor views, metadata)`` of the complete snapshot of ``step``, under a
        shared lock; the views are valid only inside the ``with`` block.

        Raises:
            LookupError: no complete snapshot of that step.
        """
        for slot in self.slots:
            slot.lock(exclusive=False)
            try:
                h = slot.header()
                if h is not None and h.valid and h.step == step and h.world_size == world_size and h.rank == self.rank:
                    assert slot.mm is not None
                    entries, metadata, _ = parse_header(memoryview(slot.mm)[h.layout_off : h.layout_off + h.layout_len],
                                                  with_data=False)
                    yield tensor_views(slot.mm, h.data_off, entries), metadata
                    return
            finally:
                slot.unlock()
        raise LookupError(f"rank {self.rank} holds no complete snapshot of step {step}")

    def forget_after(self, step: int) -> None:
        """Drop snapshots newer than ``step`` (an abandoned lineage after a restore)."""
        for slot in self.slots:
            if slot.try_lock(exclusive=True):
                try:
                    h = slot.header()
                    if h is not None and h.state and h.step > step:
                        slot.invalidate()
                finally:
                    slot.unlock()

    def close(self) -> None:
        for slot in self.slots:
            slot.close()


