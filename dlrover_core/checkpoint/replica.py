"""A snapshot as bytes that travel to another host, and back into a slot there (issue 28:
a lost node's ranks restore from a buddy's memory, not from storage).

A *replica frame* is one complete snapshot of one rank, taken from its slot::

    offset 0            preamble (``PREAMBLE_SIZE`` bytes: the fields of :class:`FrameHeader`)
    PREAMBLE_SIZE       layout (the slot's layout JSON, as the slot holds it)
    + layout_len        data (the tensor bytes, as the slot holds them)

The preamble carries the snapshot's identity (rank, step, world size, round: its lineage,
``seq``) and two CRC32s (zlib), of the layout and of the data, computed on the sending
side from the bytes it sends. A receiver trusts a frame only when both match what it
received; then it writes the frame into a slot with the slots' own publishing protocol
(WRITING, layout and data, fields and checksum, READY last), so a receiver killed while it
writes leaves a slot that is simply not READY, and a worker restores from a replica slot
exactly as from its own (:class:`~dlrover_core.checkpoint.memory.MemorySnapshots`).

Taking a frame never blocks a save: it copies the newest complete snapshot under a shared
lock taken without waiting (a worker writing into the slot holds the exclusive lock; the
frame is then taken at the next look), at memory speed, and the copy travels without any
lock. The frame is re-checked against the slot's header after the copy (same ``seq``,
still READY), the seqlock rule: a slot re-published during the copy yields no frame.
"""

from __future__ import annotations

import struct
import zlib

import attrs

from dlrover_core.checkpoint.shm import HEADER_SIZE, SlotHeader, SnapshotSlot
from dlrover_core.errors import CheckpointError

__all__ = ["PREAMBLE_SIZE", "FrameHeader", "ReplicaError", "frame_header", "take_frame", "verify_frame", "write_frame"]

_MAGIC = b"DLRREP1\0"
# magic, rank, world_size, round, step, seq, layout_len, data_len, layout_crc, data_crc
_FMT = "<8sIIIqQQQII"
PREAMBLE_SIZE = struct.calcsize(_FMT)
_ALIGN = 4096


class ReplicaError(CheckpointError):
    """A replica frame that cannot be trusted (truncated, a checksum mismatch, not a frame);
    the message names what did not match. The frame is dropped; the slot is not touched."""


@attrs.frozen(kw_only=True)
class FrameHeader:
    """The identity and checksums of one replica frame.

    Attributes:
        rank, world_size: the rank that took the snapshot and its world size.
        round: the rendezvous round (incarnation) of the worker that took it: its lineage.
        step: the training step of the snapshot.
        seq: the slot's publication counter when the frame was taken.
        layout_len, data_len: bytes of the layout JSON and of the tensor data.
        layout_crc, data_crc: CRC32 (zlib) of the layout and of the data, as sent.
    """

    rank: int
    world_size: int
    round: int
    step: int
    seq: int
    layout_len: int
    data_len: int
    layout_crc: int
    data_crc: int

    @property
    def frame_len(self) -> int:
        """Bytes of the whole frame (preamble, layout, data)."""
        return PREAMBLE_SIZE + self.layout_len + self.data_len

    def pack(self) -> bytes:
        return struct.pack(_FMT, _MAGIC, self.rank, self.world_size, self.round, self.step, self.seq,
                           self.layout_len, self.data_len, self.layout_crc, self.data_crc)


def frame_header(frame: bytes | bytearray | memoryview) -> FrameHeader:
    """The header of ``frame`` (its first :data:`PREAMBLE_SIZE` bytes at least).

    Raises:
        ReplicaError: shorter than a preamble, or not a replica frame.
    """
    if len(frame) < PREAMBLE_SIZE:
        raise ReplicaError(f"a replica frame of {len(frame)} bytes is shorter than its preamble ({PREAMBLE_SIZE})")
    magic, rank, world, round_index, step, seq, layout_len, data_len, layout_crc, data_crc = struct.unpack_from(
        _FMT, frame, 0)
    if magic != _MAGIC:
        raise ReplicaError(f"not a replica frame (magic {magic!r})")
    return FrameHeader(rank=rank, world_size=world, round=round_index, step=step, seq=seq, layout_len=layout_len,
                       data_len=data_len, layout_crc=layout_crc, data_crc=data_crc)


def take_frame(slot: SnapshotSlot, *, rank: int, newer_than: int = -1) -> bytearray | None:
    """A replica frame of the complete snapshot of ``rank`` in ``slot``; ``None`` when there
    is none newer than step ``newer_than``, or the slot is being written (its worker holds
    the lock), or it was re-published during the copy.

    Never waits for a lock; copies ``PREAMBLE_SIZE + layout + data`` bytes (memory speed)
    while holding a shared lock, which a save waits out by writing the other slot.
    """
    if not slot.try_lock(exclusive=False):
        return None
    try:
        h = slot.header()
        if not _usable(h, rank, newer_than):
            return None
        assert h is not None and slot.mm is not None
        frame = bytearray(PREAMBLE_SIZE + h.layout_len + h.data_len)
        view = memoryview(frame)
        view[PREAMBLE_SIZE : PREAMBLE_SIZE + h.layout_len] = slot.mm[h.layout_off : h.layout_off + h.layout_len]
        view[PREAMBLE_SIZE + h.layout_len :] = slot.mm[h.data_off : h.data_off + h.data_len]
        after = slot.header()
        if after is None or not after.live or after.seq != h.seq:  # re-published meanwhile
            return None
    finally:
        slot.unlock()
    layout_crc = zlib.crc32(view[PREAMBLE_SIZE : PREAMBLE_SIZE + h.layout_len])
    data_crc = zlib.crc32(view[PREAMBLE_SIZE + h.layout_len :])
    view[:PREAMBLE_SIZE] = FrameHeader(
        rank=h.rank, world_size=h.world_size, round=h.round, step=h.step, seq=h.seq, layout_len=h.layout_len,
        data_len=h.data_len, layout_crc=layout_crc, data_crc=data_crc).pack()
    view.release()
    return frame


def _usable(h: SlotHeader | None, rank: int, newer_than: int) -> bool:
    return h is not None and h.live and h.rank == rank and h.step > newer_than


def verify_frame(frame: bytes | bytearray | memoryview) -> FrameHeader:
    """The header of ``frame`` once its length and both checksums match.

    Raises:
        ReplicaError: naming what does not match (length, layout CRC, data CRC).
    """
    h = frame_header(frame)
    if len(frame) != h.frame_len:
        raise ReplicaError(f"replica frame of rank {h.rank} step {h.step}: {len(frame)} bytes, "
                           f"its preamble says {h.frame_len}")
    view = memoryview(frame)
    layout = view[PREAMBLE_SIZE : PREAMBLE_SIZE + h.layout_len]
    if zlib.crc32(layout) != h.layout_crc:
        raise ReplicaError(f"replica frame of rank {h.rank} step {h.step}: the layout's CRC32 does not match")
    if zlib.crc32(view[PREAMBLE_SIZE + h.layout_len :]) != h.data_crc:
        raise ReplicaError(f"replica frame of rank {h.rank} step {h.step}: the data's CRC32 does not match")
    return h


def write_frame(slot: SnapshotSlot, frame: bytes | bytearray | memoryview) -> FrameHeader:
    """Verify ``frame`` and publish it into ``slot`` (taking its exclusive lock): the slot
    then holds the snapshot as its rank's own slot would, not flagged for persistence.

    Raises:
        ReplicaError: the frame is not whole (nothing written).
        OSError: /dev/shm cannot hold it (ENOSPC from ``posix_fallocate``).
    """
    h = verify_frame(frame)
    view = memoryview(frame)
    data_off = (HEADER_SIZE + h.layout_len + _ALIGN - 1) // _ALIGN * _ALIGN
    needed = (data_off + h.data_len + 2**20 - 1) // 2**20 * 2**20
    slot.lock(exclusive=True)
    try:
        slot.ensure_size(needed)
        slot.begin_write()
        assert slot.mm is not None
        slot.mm[HEADER_SIZE : HEADER_SIZE + h.layout_len] = view[PREAMBLE_SIZE : PREAMBLE_SIZE + h.layout_len]
        slot.mm[data_off : data_off + h.data_len] = view[PREAMBLE_SIZE + h.layout_len :]
        slot.publish(flags=0, step=h.step, seq=h.seq, world_size=h.world_size, rank=h.rank, layout_len=h.layout_len,
                     data_off=data_off, data_len=h.data_len, round_index=h.round)
    finally:
        slot.unlock()
    return h
