"""A snapshot as bytes that travel to another host, and back into a slot there (issue 28:
a lost node's ranks restore from a buddy's memory, not from storage).

A *replica frame* is one complete snapshot of one rank, taken from its slot::

    offset 0                  preamble (``PREAMBLE_SIZE`` bytes: the fields of :class:`FrameHeader`)
    PREAMBLE_SIZE             layout (the slot's layout JSON, as the slot holds it)
    + layout_len              data (the tensor bytes, as the slot holds them)
    + data_len                trailer (``TRAILER_SIZE`` bytes: two checksums and a "whole" flag)

The preamble carries the snapshot's identity (rank, step, world size, round: its lineage,
``seq``) and the lengths; the trailer carries two 64-bit checksums (XXH3-64, the ``xxhash``
library: about five times the speed of zlib's CRC32 here, and it is the checksum that costs
the most CPU in a transfer), of the layout and of the data, computed by the sender from the
bytes it sent, and whether the slot still held that same snapshot when the last byte was
sent (2 where the bytes were sent by reference, ``sendfile``: then checksums that differ mean
the slot changed before the kernel read the pages, a torn frame too). A receiver trusts a frame only when both checksums match what it received and the flag says whole; then the frame is published into a slot
with the slots' own protocol (WRITING, layout and data, fields and checksum, READY last),
so a receiver killed while it writes leaves a slot that is simply not READY, and a worker
restores from a replica slot exactly as from its own
(:class:`~dlrover_core.checkpoint.memory.MemorySnapshots`).

Two ways to send, neither ever blocks a save:

- :func:`send_frame` streams straight from the slot's mapping, taking no lock (the seqlock
  rule: the slot's header is read before and after; a save that re-published the slot
  meanwhile makes the trailer say "not whole", and the receiver drops the frame). No copy
  in this process; the bytes go from shared memory to the socket. A transfer slower than
  two saves of its rank is always cut this way.
- :func:`take_frame` copies the snapshot out under a shared lock taken without waiting (a
  worker writing into the slot holds the exclusive lock; the frame is then taken at the
  next look), at memory speed, and the copy travels without any lock: the fallback for a
  transfer too slow for the stream.

:func:`receive_frame` reads a frame from a stream straight into the destination slot
(checksummed on the way, published only when whole), so the receiving side copies nothing
either.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

import attrs
import xxhash

from dlrover_core.checkpoint.shm import HEADER_SIZE, SlotHeader, SnapshotSlot
from dlrover_core.errors import CheckpointError

__all__ = ["PREAMBLE_SIZE", "TRAILER_SIZE", "FrameHeader", "ReplicaError", "ReplicaTornError", "ReplicaTruncatedError",
           "frame_header", "read_preamble", "receive_frame", "send_frame", "take_frame", "verify_frame", "write_frame"]

_MAGIC = b"DLRREP2\0"
# magic, rank, world_size, round, step, seq, layout_len, data_len
_FMT = "<8sIIIqQQQ"
PREAMBLE_SIZE = struct.calcsize(_FMT)
# layout_hash, data_hash (XXH3-64), whole (1: the slot held this snapshot until the last byte was sent)
_TRAILER_FMT = "<QQI"
#: the "whole" flag of a frame sent by reference (``sendfile``): the pages are read by the
#: kernel after the sender's last look at the slot, so checksums that differ mean a save
#: changed the slot meanwhile (torn), as a 0 does
_WHOLE_BY_REFERENCE = 2
TRAILER_SIZE = struct.calcsize(_TRAILER_FMT)
_ALIGN = 4096
#: bytes checksummed and sent (or received) at a time: a few MiB stay in the CPU's caches
#: between the checksum and the copy
CHUNK_BYTES = 4 << 20


class ReplicaError(CheckpointError):
    """A replica frame that cannot be trusted (truncated, a checksum mismatch, not a frame,
    re-published while it was sent); the message names what did not match. The frame is
    dropped; the newest replica held is not touched."""


class ReplicaTornError(ReplicaError):
    """The sender's slot was re-published while the frame was streamed: its trailer says so.
    Nothing is wrong with the link; ask again (as a copy when it keeps happening)."""


class ReplicaTruncatedError(ReplicaError):
    """The stream ended before the frame did (the sender or the link went away)."""


@attrs.frozen(kw_only=True)
class FrameHeader:
    """The identity of one replica frame (its preamble).

    Attributes:
        rank, world_size: the rank that took the snapshot and its world size.
        round: the rendezvous round (incarnation) of the worker that took it: its lineage.
        step: the training step of the snapshot.
        seq: the slot's publication counter when the frame was taken.
        layout_len, data_len: bytes of the layout JSON and of the tensor data.
    """

    rank: int
    world_size: int
    round: int
    step: int
    seq: int
    layout_len: int
    data_len: int

    @property
    def frame_len(self) -> int:
        """Bytes of the whole frame (preamble, layout, data, trailer)."""
        return PREAMBLE_SIZE + self.layout_len + self.data_len + TRAILER_SIZE

    def pack(self) -> bytes:
        return struct.pack(_FMT, _MAGIC, self.rank, self.world_size, self.round, self.step, self.seq,
                           self.layout_len, self.data_len)

    @classmethod
    def of(cls, h: SlotHeader) -> FrameHeader:
        """The preamble of a frame of the snapshot whose slot header is ``h``."""
        return cls(rank=h.rank, world_size=h.world_size, round=h.round, step=h.step, seq=h.seq,
                   layout_len=h.layout_len, data_len=h.data_len)


def frame_header(frame: bytes | bytearray | memoryview) -> FrameHeader:
    """The header of ``frame`` (its first :data:`PREAMBLE_SIZE` bytes at least).

    Raises:
        ReplicaError: shorter than a preamble, or not a replica frame.
    """
    if len(frame) < PREAMBLE_SIZE:
        raise ReplicaError(f"a replica frame of {len(frame)} bytes is shorter than its preamble ({PREAMBLE_SIZE})")
    magic, rank, world, round_index, step, seq, layout_len, data_len = struct.unpack_from(_FMT, frame, 0)
    if magic != _MAGIC:
        raise ReplicaError(f"not a replica frame (magic {magic!r})")
    return FrameHeader(rank=rank, world_size=world, round=round_index, step=step, seq=seq, layout_len=layout_len,
                       data_len=data_len)


def _same(h: SlotHeader | None, ref: SlotHeader) -> bool:
    """Whether the slot still holds the snapshot ``ref`` was read from (the seqlock check)."""
    return h is not None and h.live and (h.seq, h.step, h.round, h.rank) == (ref.seq, ref.step, ref.round, ref.rank)


def _usable(h: SlotHeader | None, rank: int, newer_than: int) -> bool:
    return h is not None and h.live and h.rank == rank and h.step > newer_than


def take_frame(slot: SnapshotSlot, *, rank: int, newer_than: int = -1) -> bytearray | None:
    """A replica frame (a copy) of the complete snapshot of ``rank`` in ``slot``; ``None``
    when there is none newer than step ``newer_than``, or the slot is being written (its
    worker holds the lock), or it was re-published during the copy.

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
        fh = FrameHeader.of(h)
        frame = bytearray(fh.frame_len)
        view = memoryview(frame)
        body = view[PREAMBLE_SIZE : PREAMBLE_SIZE + h.layout_len + h.data_len]
        body[: h.layout_len] = slot.mm[h.layout_off : h.layout_off + h.layout_len]
        body[h.layout_len :] = slot.mm[h.data_off : h.data_off + h.data_len]
        if not _same(slot.header(), h):  # re-published meanwhile
            return None
    finally:
        slot.unlock()
    view[:PREAMBLE_SIZE] = fh.pack()
    view[PREAMBLE_SIZE + h.layout_len + h.data_len :] = struct.pack(
        _TRAILER_FMT, _hash(body[: h.layout_len]), _hash(body[h.layout_len :]), 1)
    body.release()
    view.release()
    return frame


def send_frame(slot: SnapshotSlot, h: SlotHeader, write: Callable[[memoryview | bytes], object], *,
               chunk_bytes: int = CHUNK_BYTES, send_file: Callable[[int, int, int], object] | None = None) -> bool:
    """Stream the snapshot ``h`` (a live header read from ``slot``) as one frame of
    ``FrameHeader.of(h).frame_len`` bytes through ``write``, straight from the slot's
    mapping, taking no lock. Returns whether the frame went out whole: ``False`` when the
    slot was re-published while it was sent (its trailer then says so, and a receiver
    refuses it).

    ``send_file(fd, offset, count)``, where given, sends the layout and data bytes from the
    slot's file instead of ``write`` (``sendfile(2)`` into a socket: the kernel takes the
    shared memory's pages, with no copy into the socket's buffers in this process). Each
    chunk is checksummed from the mapping just before it is sent; a save that changes it in
    between makes the receiver's checksum differ, and the frame is refused as a torn one is.

    Raises:
        OSError: from ``write`` or ``send_file`` (the peer went away).
    """
    assert slot.mm is not None
    write(FrameHeader.of(h).pack())
    mm = memoryview(slot.mm)
    try:
        hashes = []
        for off, length in ((h.layout_off, h.layout_len), (h.data_off, h.data_len)):
            digest = xxhash.xxh3_64()
            for at in range(off, off + length, chunk_bytes):
                chunk = mm[at : min(at + chunk_bytes, off + length)]
                digest.update(chunk)
                if send_file is None:
                    write(chunk)
                else:
                    send_file(slot.fd, at, len(chunk))
                chunk.release()
            hashes.append(digest.intdigest())
    finally:
        mm.release()
    whole = _same(slot.header(), h)
    write(struct.pack(_TRAILER_FMT, hashes[0], hashes[1], (_WHOLE_BY_REFERENCE if send_file else 1) if whole else 0))
    return whole


def _hash(data: bytes | bytearray | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


def _check_trailer(fh: FrameHeader, trailer: bytes | bytearray | memoryview, layout_hash: int, data_hash: int) -> None:
    want_layout, want_data, whole = struct.unpack_from(_TRAILER_FMT, trailer, 0)
    if whole == _WHOLE_BY_REFERENCE and (layout_hash != want_layout or data_hash != want_data):
        raise ReplicaTornError(f"replica frame of rank {fh.rank} step {fh.step}: sent by reference, and the slot "
                               "changed before its pages were read (torn)")
    if whole not in (1, _WHOLE_BY_REFERENCE):  # first: a torn stream's checksums need not match either
        raise ReplicaTornError(f"replica frame of rank {fh.rank} step {fh.step}: the snapshot was re-published "
                               "while it was sent (torn)")
    if layout_hash != want_layout:
        raise ReplicaError(f"replica frame of rank {fh.rank} step {fh.step}: the layout's checksum does not match")
    if data_hash != want_data:
        raise ReplicaError(f"replica frame of rank {fh.rank} step {fh.step}: the data's checksum does not match")


def verify_frame(frame: bytes | bytearray | memoryview) -> FrameHeader:
    """The header of ``frame`` once its length, both checksums and its "whole" flag match.

    Raises:
        ReplicaError: naming what does not match (length, layout checksum, data checksum, torn).
    """
    h = frame_header(frame)
    if len(frame) != h.frame_len:
        raise ReplicaError(f"replica frame of rank {h.rank} step {h.step}: {len(frame)} bytes, "
                           f"its preamble says {h.frame_len}")
    view = memoryview(frame)
    end = PREAMBLE_SIZE + h.layout_len + h.data_len
    _check_trailer(h, view[end:], _hash(view[PREAMBLE_SIZE : PREAMBLE_SIZE + h.layout_len]),
                   _hash(view[PREAMBLE_SIZE + h.layout_len : end]))
    return h


def _data_off(layout_len: int) -> int:
    return (HEADER_SIZE + layout_len + _ALIGN - 1) // _ALIGN * _ALIGN


def _slot_bytes(h: FrameHeader) -> int:
    return (_data_off(h.layout_len) + h.data_len + 2**20 - 1) // 2**20 * 2**20


def _publish(slot: SnapshotSlot, h: FrameHeader) -> None:
    slot.publish(flags=0, step=h.step, seq=h.seq, world_size=h.world_size, rank=h.rank, layout_len=h.layout_len,
                 data_off=_data_off(h.layout_len), data_len=h.data_len, round_index=h.round)


def write_frame(slot: SnapshotSlot, frame: bytes | bytearray | memoryview) -> FrameHeader:
    """Verify ``frame`` and publish it into ``slot`` (taking its exclusive lock): the slot
    then holds the snapshot as its rank's own slot would, not flagged for persistence.

    Raises:
        ReplicaError: the frame is not whole (nothing written).
        OSError: /dev/shm cannot hold it (ENOSPC from ``posix_fallocate``).
    """
    h = verify_frame(frame)  # first: a frame that is not whole never touches the slot
    view, at = memoryview(frame), PREAMBLE_SIZE

    def read_into(into: memoryview) -> int:  # the frame as the stream receive_frame reads
        nonlocal at
        n = min(len(into), len(view) - at)
        into[:n] = view[at : at + n]
        at += n
        return n

    return receive_frame(slot, h, read_into)


def _read_exactly(read_into: Callable[[memoryview], int], into: memoryview) -> None:
    got = 0
    while got < len(into):
        n = read_into(into[got:])
        if not n:
            raise ReplicaTruncatedError(f"replica frame truncated: {len(into) - got} bytes missing")
        got += n


def read_preamble(read_into: Callable[[memoryview], int]) -> FrameHeader:
    """Read and parse a frame's preamble from a stream (``read_into(buffer) -> bytes read``,
    0 at its end, as ``io.RawIOBase.readinto``).

    Raises:
        ReplicaError: the stream ended first, or it is not a replica frame.
    """
    buf = bytearray(PREAMBLE_SIZE)
    _read_exactly(read_into, memoryview(buf))
    return frame_header(buf)


def receive_frame(slot: SnapshotSlot, h: FrameHeader, read_into: Callable[[memoryview], int], *,
                  on_progress: Callable[[int], None] | None = None, chunk_bytes: int = CHUNK_BYTES) -> FrameHeader:
    """Read the rest of the frame whose preamble was ``h`` (:func:`read_preamble`) straight
    into ``slot`` (under its exclusive lock), checksumming on the way, and publish it only
    when the trailer matches. ``on_progress(bytes so far)`` runs after each chunk (a
    bandwidth budget sleeps there).

    Raises:
        ReplicaError: truncated, a checksum mismatch or torn: the slot is left EMPTY (it held
            the older of a rank's two replicas: the newest is in the other slot).
        OSError: /dev/shm cannot hold it (ENOSPC from ``posix_fallocate``), or the stream failed.
    """
    data_off = _data_off(h.layout_len)
    slot.lock(exclusive=True)
    try:
        slot.ensure_size(_slot_bytes(h))
        slot.begin_write()
        assert slot.mm is not None
        mm = memoryview(slot.mm)
        done = False
        try:
            hashes, received = [], PREAMBLE_SIZE
            for off, length in ((HEADER_SIZE, h.layout_len), (data_off, h.data_len)):
                digest = xxhash.xxh3_64()
                for at in range(off, off + length, chunk_bytes):
                    chunk = mm[at : min(at + chunk_bytes, off + length)]
                    _read_exactly(read_into, chunk)
                    digest.update(chunk)
                    received += len(chunk)
                    chunk.release()
                    if on_progress is not None:
                        on_progress(received)
                hashes.append(digest.intdigest())
            trailer = bytearray(TRAILER_SIZE)
            _read_exactly(read_into, memoryview(trailer))
            _check_trailer(h, trailer, hashes[0], hashes[1])
            _publish(slot, h)
            done = True
        finally:
            mm.release()
            if not done:
                slot.invalidate()
    finally:
        slot.unlock()
    return h
