"""Shared-memory snapshot slots: a file in /dev/shm, a fixed header, flock, mmap.

One slot holds one snapshot of one rank::

    offset 0     header (``HEADER_SIZE`` bytes, fields below)
    layout_off   layout JSON (tensor table and the non-tensor tree)
    data_off     tensor bytes, packed in layout order (4096-aligned start)

Publishing protocol (the writer holds ``LOCK_EX`` on the slot file): set ``state`` to
WRITING, write layout and data, write the fields with the header checksum, and set
``state`` to READY last. A reader takes ``LOCK_SH``, and trusts the slot only if ``state``
is READY and the checksum over fields and layout matches — so a writer killed mid-copy
leaves a slot that is simply not READY, never a torn snapshot. flock locks die with their
process, so a SIGKILLed holder never blocks anyone.

The flags sit outside the checksum, one byte each, so that two processes holding shared
locks can set their own flag with a single-byte store and never lose the other's:
byte 12 "persist requested" (the writer, at publish), byte 13 "persisted" or "given up"
(the persister), byte 14 "abandoned" (a restoring worker: a snapshot newer than the step
the job went back to, of a lineage that no longer exists), byte 15 the replica pin: "kept
for the replicas" (the writer, at publish, where the job replicates its snapshots),
"confirmed", "released" or "held, the buddy is silent" (the node's agent:
:mod:`dlrover_core.agent.replicas`).

Each snapshot records the rendezvous round of the worker that wrote it (its
*incarnation*): the master uses it to tell a stale shard from a current one.

Segments are named ``dlrover-<job_id>-n<node>-a<agent>-r<rank>-s<slot>``, where ``agent``
is the fencing token the master gave the node's agent when it registered: a replacement
agent of the same node never opens, nor removes, the segments of the agent it replaced,
and the old one cannot touch the new one's. The node's agent and the local scheduler find
every segment of a job or node by prefix.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import struct
import threading
import zlib
from collections.abc import Iterator
from pathlib import Path

import attrs

__all__ = [
    "FLAG_PINNED",
    "HEADER_SIZE",
    "PIN_CONFIRMED",
    "PIN_HELD",
    "PIN_KEPT",
    "PIN_RELEASED",
    "SHM_DIR",
    "READY",
    "SlotHeader",
    "SnapshotSlot",
    "node_prefix",
    "remove_segments",
    "segment_name",
    "shm_free_bytes",
]

SHM_DIR = Path(os.environ.get("DLROVER_SHM_DIR", "/dev/shm"))
HEADER_SIZE = 4096
_MAGIC = b"DLRFCP2\0"
# magic, state, flags, step, seq, world_size, rank, round, layout_off, layout_len, data_off, data_len, crc
_FMT = "<8sIIqQIIIQQQQI"
_HEADER_FIELDS_LEN = struct.calcsize(_FMT)
_COVERED = "<qQIIIQQQQ"
EMPTY, WRITING, READY = 0, 1, 2
#: byte offsets of the one-byte flags (outside the checksum)
_PERSIST_AT, _PERSISTED_AT, _ABANDONED_AT, _PIN_AT = 12, 13, 14, 15
#: ``flags`` bits as read little-endian: persist requested; persisted; given up (the
#: persister could not write it); abandoned
FLAG_PERSIST = 1
FLAG_PERSISTED = 1 << 8
FLAG_GAVE_UP = 2 << 8
FLAG_ABANDONED = 1 << 16
#: the replica pin (byte 15): kept until the agent releases it, the buddy holding no replica
#: of it yet; released; held while the buddy is silent (not overwritten, but a save does not
#: wait for it either); confirmed: kept, and the buddy holds it or a newer snapshot
PIN_KEPT, PIN_RELEASED, PIN_HELD, PIN_CONFIRMED = 1, 2, 3, 4
FLAG_PINNED = PIN_KEPT << 24

def node_prefix(job_id: str, node_id: int, agent: int | None = None) -> str:
    """The name prefix of a node's segments: of one agent incarnation (``agent``, its
    fencing token) or of every incarnation (``None``)."""
    base = f"dlrover-{job_id}-n{node_id}-a"
    return base if agent is None else f"{base}{agent}-"


def segment_name(job_id: str, node_id: int, rank: int, slot: int, agent: int = 0) -> str:
    """``dlrover-<job>-n<node>-a<agent>-r<rank>-s<slot>`` (``agent``: the fencing token)."""
    return f"{node_prefix(job_id, node_id, agent)}r{rank}-s{slot}"


def remove_segments(prefix: str) -> list[str]:
    """Unlink every segment in /dev/shm whose name starts with ``prefix``; return their names."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except FileNotFoundError:
        return removed
    for name in names:
        if name.startswith(prefix):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(SHM_DIR / name)
                removed.append(name)
    return removed


def shm_free_bytes() -> int:
    """Bytes that can still be allocated in /dev/shm."""
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


@attrs.frozen(kw_only=True)
class SlotHeader:
    """The published fields of a slot (``valid`` when READY with a matching checksum)."""

    state: int
    flags: int
    step: int
    seq: int
    world_size: int
    rank: int
    round: int
    layout_off: int
    layout_len: int
    data_off: int
    data_len: int
    crc: int
    valid: bool

    @property
    def persist_requested(self) -> bool:
        return bool(self.flags & FLAG_PERSIST)

    @property
    def persisted(self) -> bool:
        """Written out, or given up on (the persister is done with it either way)."""
        return bool(self.flags & (FLAG_PERSISTED | FLAG_GAVE_UP))

    @property
    def gave_up(self) -> bool:
        return bool(self.flags & FLAG_GAVE_UP)

    @property
    def abandoned(self) -> bool:
        return bool(self.flags & FLAG_ABANDONED)

    @property
    def live(self) -> bool:
        """A complete snapshot of the current lineage (valid and not abandoned)."""
        return self.valid and not self.abandoned

    @property
    def pin(self) -> int:
        """The replica pin: 0 (none), ``PIN_KEPT``, ``PIN_RELEASED`` or ``PIN_HELD``."""
        return (self.flags >> 24) & 0xFF

    @property
    def pinned(self) -> bool:
        """Kept (confirmed, or held) for the replicas: a save must not overwrite it."""
        return self.live and self.pin in (PIN_KEPT, PIN_HELD, PIN_CONFIRMED)

    @property
    def awaiting_persist(self) -> bool:
        """Flagged for persistence and not persisted yet: must not be overwritten."""
        return self.live and self.persist_requested and not self.persisted


def _checksum(fields: tuple, layout: bytes | memoryview) -> int:
    return zlib.crc32(layout, zlib.crc32(struct.pack(_COVERED, *fields)))


class SnapshotSlot:
    """One slot (a shared-memory file), opened by a worker (to write and restore) or by the
    agent (to persist). Create with :meth:`open`; the mapping follows the file's size."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd
        st = os.fstat(fd)
        #: (device, inode) of the file this slot opened: a segment re-created under the same
        #: name is another file (see :meth:`replaced`)
        self.identity = (st.st_dev, st.st_ino)
        self.mm: mmap.mmap | None = None
        self._retired: list[mmap.mmap] = []
        # flock locks belong to the open file, not to a thread: two threads of one process
        # sharing this object would share one lock, and the first to unlock would drop the
        # other's (then a worker could overwrite a snapshot still being persisted). This
        # lock makes each holder of the file lock the only one in the process.
        self._holder = threading.Lock()
        self._mapped = 0
        self._remap()

    @classmethod
    def open(cls, name: str, *, create: bool) -> SnapshotSlot | None:
        """Open ``/dev/shm/<name>``; with ``create`` make it (empty) if missing."""
        path = SHM_DIR / name
        flags = os.O_RDWR | (os.O_CREAT if create else 0)
        try:
            fd = os.open(path, flags, 0o600)
        except FileNotFoundError:
            return None
        return cls(path, fd)

    @property
    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def replaced(self) -> bool:
        """Whether the name now belongs to another file (removed, or re-created) than the
        one this slot holds open."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return True
        return (st.st_dev, st.st_ino) != self.identity

    def _remap(self) -> None:
        size = self.size
        if size == self._mapped and self.mm is not None:
            return
        if self.mm is not None:
            try:
                self.mm.close()
            except BufferError:  # tensors still view the old mapping: it lives until they die
                self._retired.append(self.mm)
            self.mm = None
        if size >= HEADER_SIZE:
            self.mm = mmap.mmap(self.fd, size)
        self._mapped = size

    def ensure_size(self, nbytes: int) -> bool:
        """Grow the segment to at least ``nbytes`` and pre-touch new pages (writer holds
        LOCK_EX). Returns whether it grew. Raises OSError (ENOSPC) if /dev/shm is full."""
        self._remap()
        if self._mapped >= nbytes:
            return False
        old = self._mapped
        os.posix_fallocate(self.fd, 0, nbytes)  # reserves the pages now: ENOSPC here, not SIGBUS later
        self._remap()
        assert self.mm is not None
        import numpy as np  # heavy: numpy

        # touch one byte per page of the new part, so the first snapshot does not page-fault
        start = old - old % mmap.PAGESIZE
        pages = np.frombuffer(self.mm, dtype=np.uint8, count=nbytes - start, offset=start)
        pages[:: mmap.PAGESIZE] = 0
        del pages
        return True

    # ----- locking -----------------------------------------------------------------------

    def try_lock(self, exclusive: bool) -> bool:
        """Take the file lock without waiting; ``False`` when another process, or another
        thread using this object, holds it."""
        if not self._holder.acquire(blocking=False):
            return False
        try:
            fcntl.flock(self.fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            self._holder.release()
            return False

    def lock(self, exclusive: bool) -> None:
        """Take the file lock, waiting for the threads of this process first."""
        self._holder.acquire()
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        except BaseException:
            self._holder.release()
            raise

    def unlock(self) -> None:
        """Release the lock this thread took with :meth:`try_lock` or :meth:`lock`."""
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        self._holder.release()

    @contextlib.contextmanager
    def shared(self) -> Iterator[None]:
        self.lock(False)
        try:
            yield
        finally:
            self.unlock()

    # ----- header ------------------------------------------------------------------------

    def header(self) -> SlotHeader | None:
        """Read the header (hold a lock for a stable answer); ``None`` if the slot is empty."""
        self._remap()
        if self.mm is None:
            return None
        magic, state, flags, *fields = struct.unpack_from(_FMT, self.mm, 0)
        if magic != _MAGIC:
            return None
        step, seq, world, rank, round_index, layout_off, layout_len, data_off, data_len, crc = fields
        valid = False
        if state == READY and layout_off + layout_len <= self._mapped and data_off + data_len <= self._mapped:
            covered = (step, seq, world, rank, round_index, layout_off, layout_len, data_off, data_len)
            valid = _checksum(covered, memoryview(self.mm)[layout_off : layout_off + layout_len]) == crc
        return SlotHeader(state=state, flags=flags, step=step, seq=seq, world_size=world, rank=rank,
                          round=round_index, layout_off=layout_off, layout_len=layout_len, data_off=data_off, data_len=data_len,
                          crc=crc, valid=valid)

    def stamp(self) -> bytes:
        """The header's bytes as they are now (no checksum, no lock): equal stamps mean no
        writer published, abandoned, flagged or pinned anything in between (each of those
        rewrites a header field; a publish bumps ``seq``). A cheap test for a change, as
        :meth:`peek`; ``b""`` while the slot is empty."""
        self._remap()
        if self.mm is None:
            return b""
        return bytes(self.mm[:_HEADER_FIELDS_LEN])

    def peek(self) -> tuple[int, int, int] | None:
        """``(state, step, seq)`` as the header says now, unchecked (no checksum, no lock):
        a cheap look for a change, to be confirmed with :meth:`header`; ``None``: empty or
        abandoned."""
        self._remap()
        if self.mm is None:
            return None
        magic, state, flags, step, seq = struct.unpack_from("<8sIIqQ", self.mm, 0)
        if magic != _MAGIC or flags & FLAG_ABANDONED:
            return None
        return state, step, seq

    def begin_write(self) -> None:
        """Mark the slot WRITING (first thing a writer does)."""
        assert self.mm is not None
        struct.pack_into("<8sI", self.mm, 0, _MAGIC, WRITING)

    def publish(self, *, flags: int, step: int, seq: int, world_size: int, rank: int, layout_len: int,
                data_off: int, data_len: int, round_index: int = 0) -> None:
        """Write the fields and checksum, then mark READY (after layout and data are written)."""
        assert self.mm is not None
        fields = (step, seq, world_size, rank, round_index, HEADER_SIZE, layout_len, data_off, data_len)
        crc = _checksum(fields, memoryview(self.mm)[HEADER_SIZE : HEADER_SIZE + layout_len])
        struct.pack_into(_FMT, self.mm, 0, _MAGIC, WRITING, flags, *fields, crc)
        struct.pack_into("<I", self.mm, 8, READY)

    def mark_persisted(self, *, gave_up: bool = False) -> None:
        """Set PERSISTED (the persister, holding a shared lock, after a durable write), or
        GAVE_UP (the write failed for good): either way the slot may be reused."""
        assert self.mm is not None
        self.mm[_PERSISTED_AT] = 2 if gave_up else 1

    def abandon(self) -> None:
        """Set ABANDONED (a restoring worker, holding a shared lock): the snapshot belongs to
        a lineage the job went back from; it is neither restored nor persisted."""
        assert self.mm is not None
        self.mm[_ABANDONED_AT] = 1

    def set_pin(self, pin: int) -> None:
        """Set the replica pin (the node's agent, holding a shared lock): ``PIN_CONFIRMED``
        once the buddy holds it (or newer), ``PIN_RELEASED`` once it is no longer needed,
        ``PIN_HELD`` while the buddy is silent (:func:`dlrover_core.agent.replicas.pins_to_release`)."""
        assert self.mm is not None
        self.mm[_PIN_AT] = pin

    def invalidate(self) -> None:
        """Mark the slot EMPTY (a snapshot of an abandoned lineage)."""
        if self.mm is not None:
            struct.pack_into("<8sI", self.mm, 0, _MAGIC, EMPTY)

    def close(self) -> None:
        for m in [self.mm, *self._retired]:
            if m is not None:
                with contextlib.suppress(BufferError):
                    m.close()
        self.mm, self._retired = None, []
        with contextlib.suppress(OSError):
            os.close(self.fd)
