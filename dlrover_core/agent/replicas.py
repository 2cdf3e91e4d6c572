"""Replicas of a node's snapshots in a buddy node's memory (issue 28): what the agents do.

Each agent serves its node's snapshots as replica frames (:mod:`dlrover_core.checkpoint.replica`)
over HTTP, and the replicas it holds for other nodes::

    GET /v1/steps?ranks=<r>,<r>                         the newest step of each of these ranks (JSON)
    GET /v1/snapshot/<rank>?round=<r>&seq=<s>&step=<t>&next_s=<w>
                                                        this node's newest snapshot of <rank> (of step <t>)
    GET /v1/replica/<node>/<rank>?newer_than=<step>    the newest replica held of <node>'s <rank>

answered 200 with the frame (``application/octet-stream``), or 204 when there is nothing
newer: than the snapshot ``(round, seq)`` the asking buddy holds (a later round's first;
within a round a rank's snapshots are numbered in the order they were written, so after a
restore to an older step the new lineage's snapshots replace the abandoned ones at once),
or than step ``newer_than``; 409 when the buddy's snapshot is of a lineage this node went
back from (the buddy drops it). A buddy's ``round`` and ``seq`` also say which snapshot it
holds (``ack=1``: only that, right after a pull), and ``next_s`` when it will ask next: the
source's agent confirms and releases the *replica pins* of its snapshots from that
(:func:`pins_to_release`; the pins: :mod:`dlrover_core.checkpoint.memory`), so that every
node keeps the steps a lost node's replicas are of, and holds them while the buddy is silent.

A buddy agent pulls the frames of its source node's ranks in the background
(:class:`ReplicaPuller`), one step of every rank per pass (the newest step they all hold),
within a bandwidth budget (:func:`replica_budget`), a share of a core and at the lowest CPU
priority, and keeps them in two slots per rank (:class:`ReplicaStore`): a frame is written
into the slot that does not hold the newest whole replica, so a pull cut off half-way, or a
damaged frame (refused by its checksums), never costs the replica already held. When the
source node is lost, its replacement fetches each rank's newest replica into its own slot
(:func:`fetch_replica`) and restores from memory, not from storage.

Replica segments are named ``dlrover-<job>-n<holder>-a<agent>-x<node>-r<rank>-s<slot>``:
under the holder agent's prefix (:func:`~dlrover_core.checkpoint.shm.node_prefix`), so they
go with its other segments when it exits or is replaced.

The agent holds one :class:`NodeReplicas`: it serves, keeps its node's pins, pulls from the
source the master names in each round (``RoundAssignment.replica_source``, placed on another
host: :mod:`dlrover_core.master.replicas`; a source relaunched within the round is named
again in the heartbeat answers), reports what it holds in every heartbeat, and, for a node
whose memory is gone, fetches its ranks' two newest replicas before the workers start
(``RoundAssignment.replica_holders``), so the restore finds a step every rank holds.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import http.server
import json
import os
import re
import socket
import threading
import time
from collections.abc import Callable, Hashable, Mapping, Sequence
from typing import Any
from urllib.parse import parse_qs, urlsplit

import psutil

from dlrover_core.checkpoint.memory import SLOTS
from dlrover_core.checkpoint.replica import (
    FrameHeader,
    ReplicaError,
    ReplicaTornError,
    ReplicaTruncatedError,
    frame_header,
    read_preamble,
    receive_frame,
    send_frame,
    take_frame,
    write_frame,
)
from dlrover_core.checkpoint.shm import (
    PIN_CONFIRMED,
    PIN_HELD,
    PIN_KEPT,
    PIN_RELEASED,
    READY,
    SlotHeader,
    SnapshotSlot,
    node_prefix,
    segment_name,
)
from dlrover_core.logging import get_logger

__all__ = ["NodeReplicas", "ReplicaPuller", "ReplicaServer", "ReplicaStore", "fetch_replica", "pins_to_release",
           "replica_budget", "replica_segment_name"]

log = get_logger()

#: nice value of the puller's thread: the lowest (``nice -n 19``): training comes first
_PULL_NICE = 19
#: slots of each replica a holder keeps: the newest whole one and the one being written
_SLOTS = 2
#: Seconds past the time a buddy said it would ask next after which it is *silent* (lost,
#: or its puller stopped): the source's pins are then held, no longer waited for.
_BUDDY_GRACE_S = 3.0
#: Longest a buddy's ``/v1/steps`` waits for a new step (seconds), and how often the source
#: looks meanwhile (an unchecked look at its slots' headers: :meth:`SnapshotSlot.peek`)
_LONG_POLL_S = 1.0
_LONG_POLL_MAX_S = 5.0
_LONG_POLL_TICK_S = 0.005
#: How often the source's agent looks at its pins besides each buddy request (seconds).
_PIN_TICK_S = 0.25


def replica_segment_name(job_id: str, holder: int, agent: int, node_id: int, rank: int, slot: int) -> str:
    """``dlrover-<job>-n<holder>-a<agent>-x<node>-r<rank>-s<slot>``: slot ``slot`` of the
    replica of ``node_id``'s ``rank`` held by node ``holder`` (its agent's token ``agent``)."""
    return f"{node_prefix(job_id, holder, agent)}x{node_id}-r{rank}-s{slot}"


def _order(h: SlotHeader) -> tuple[int, int]:
    """Newest first by this: a later round's snapshot, then the later written (``seq``:
    after a restore to an older step, the new lineage's snapshots are the newer ones)."""
    return (h.round, h.seq)


def _newest(slots: list[SnapshotSlot], rank: int) -> tuple[SnapshotSlot, SlotHeader] | None:
    return _pick(slots, rank, -1)


def _pick(slots: list[SnapshotSlot], rank: int, newer_than: int, older_than: int | None = None,
          after: tuple[int, int] | None = None, step: int | None = None) -> tuple[SnapshotSlot, SlotHeader] | None:
    """The slot holding the newest snapshot of ``rank`` in ``slots`` (:func:`_order`) newer
    than step ``newer_than`` — with ``after``: than the snapshot ``(round, seq)`` — older
    than step ``older_than`` and of step ``step`` where given, with its header."""
    def wanted(h: SlotHeader) -> bool:
        newer = h.step > newer_than if after is None else _order(h) > after
        return newer and (older_than is None or h.step < older_than) and (step is None or h.step == step)

    found = [(s, h) for s in slots if (h := s.header()) is not None and h.live and h.rank == rank and wanted(h)]
    return max(found, key=lambda sh: _order(sh[1]), default=None)


def _abandoned(slots: list[SnapshotSlot], rank: int, held: tuple[int, int]) -> bool:
    """Whether a buddy's newest replica ``held`` (``(round, seq)``) of ``rank`` is of a
    lineage this node went back from: newer than every snapshot of its round here, and not
    one of them (a node with no snapshot of that round yet, e.g. a replacement about to
    fetch its replicas, says nothing). (One older than this node's newest is replaced by the
    buddy's next pull: :meth:`ReplicaStore._target`.)"""
    mine = [_order(h) for slot in slots if (h := slot.header()) is not None and h.live and h.rank == rank
            and h.round == held[0]]
    return bool(mine) and held not in mine and held > max(mine)


def pins_to_release(own: Mapping[int, Sequence[tuple[int, Hashable]]],
                    held: Mapping[int, Hashable]) -> tuple[dict[int, set[Hashable]], dict[int, set[Hashable]]]:
    """Which of a node's pinned snapshots its agent may release, and which it marks
    *confirmed* (kept, and the buddy holds them or newer): two maps ``rank -> {id}``.

    Args:
        own: per rank of the node, ``(step, id)`` of each of its complete snapshots of the
            current lineage (the agent's id: ``(round, seq)``).
        held: per rank, the id of the newest replica its buddy holds (absent: none).

    The buddy holds, of every rank, a snapshot the rank still has (its newest replica is
    never released: below); ``h`` is the oldest step of those. Every rank keeps ``h`` and
    the step before it (and anything newer) and releases the rest. Every node keeps the
    step before its own ``h`` because another node's buddy may be one snapshot behind:
    the saves wait for released slots, so the nodes' ``h`` differ by at most one snapshot,
    and a lost node's newest replica (``h`` of that node, or the one before it) is then
    always among every other node's snapshots (``tests/test_replica_pins.py`` checks it
    under random schedules). Nothing is released while the buddy holds no current
    snapshot of some rank.
    """
    steps = []
    for rank, snapshots in own.items():
        if not snapshots:
            continue
        step = next((st for st, sq in snapshots if sq == held.get(rank)), None)
        if step is None:
            return {}, {}
        steps.append(step)
    if not steps:
        return {}, {}
    h = min(steps)
    released: dict[int, set[Hashable]] = {}
    confirmed: dict[int, set[Hashable]] = {}
    for rank, snapshots in own.items():
        keep_from = max((st for st, _ in snapshots if st < h), default=h)  # (h and the step before)
        if gone := {sq for st, sq in snapshots if st < keep_from}:
            released[rank] = gone
        if kept := {sq for st, sq in snapshots if keep_from <= st <= h}:
            confirmed[rank] = kept
    return released, confirmed


class ReplicaStore:
    """The replicas one node's agent holds of other nodes' ranks, two slots per rank.

    Args:
        job_id, node_id, agent: the holder (names its segments).
    """

    def __init__(self, *, job_id: str, node_id: int, agent: int) -> None:
        self.job_id, self.node_id, self.agent = job_id, node_id, agent
        self._slots: dict[tuple[int, int], list[SnapshotSlot]] = {}
        self._lock = threading.Lock()

    def slots(self, node_id: int, rank: int) -> list[SnapshotSlot]:
        with self._lock:
            key = (node_id, rank)
            if key not in self._slots:
                self._slots[key] = [s for i in range(_SLOTS) if (s := SnapshotSlot.open(
                    replica_segment_name(self.job_id, self.node_id, self.agent, node_id, rank, i), create=True))]
            return self._slots[key]

    def newest(self, node_id: int, rank: int) -> SlotHeader | None:
        """The header of the newest whole replica of ``node_id``'s ``rank``; ``None``: none."""
        found = _newest(self.slots(node_id, rank), rank)
        return None if found is None else found[1]

    def put(self, node_id: int, frame: bytes | bytearray | memoryview) -> FrameHeader:
        """Verify ``frame`` and write it into the slot that does not hold the newest replica.

        Raises:
            ReplicaError: the frame is damaged (nothing written).
        """
        fh = frame_header(frame)
        return write_frame(self._target(node_id, fh.rank, fh.step), frame)  # (it checks the whole frame)

    def receive(self, node_id: int, h: FrameHeader, read_into: Callable[[memoryview], int], *,
                on_progress: Callable[[int], None] | None = None) -> FrameHeader:
        """Read the rest of the frame whose preamble was ``h`` straight into the slot that
        does not hold the newest replica (:func:`~dlrover_core.checkpoint.replica.receive_frame`).

        Raises:
            ReplicaError: truncated, damaged or torn (the newest replica held stays).
            OSError: /dev/shm is full, or the stream failed.
        """
        return receive_frame(self._target(node_id, h.rank, h.step), h, read_into, on_progress=on_progress)

    def _target(self, node_id: int, rank: int, step: int) -> SnapshotSlot:
        """The slot a new replica of ``node_id``'s ``rank`` at ``step`` goes into: one holding
        a replica of that step or a later one (of a lineage the source went back from: the
        new one is newer), else not the newest one's."""
        slots = self.slots(node_id, rank)
        stale = [s for s in slots if (h := s.header()) is not None and h.live and h.rank == rank and h.step >= step]
        if stale:
            return stale[0]
        newest = _newest(slots, rank)
        return next(s for s in slots if newest is None or s is not newest[0])

    def pick(self, node_id: int, rank: int, newer_than: int = -1,
             older_than: int | None = None) -> tuple[SnapshotSlot, SlotHeader] | None:
        """The slot (and its header) of the newest whole replica of ``node_id``'s ``rank``
        newer than step ``newer_than`` and older than ``older_than``; ``None``: none."""
        return _pick(self.slots(node_id, rank), rank, newer_than, older_than)

    def drop(self, node_id: int, rank: int) -> None:
        """Mark the newest replica of ``node_id``'s ``rank`` EMPTY (of an abandoned lineage)."""
        found = _newest(self.slots(node_id, rank), rank)
        if found is not None:
            slot, h = found
            slot.lock(exclusive=True)
            try:
                if (now := slot.header()) is not None and _order(now) == _order(h):
                    slot.invalidate()
            finally:
                slot.unlock()

    def held(self) -> list[tuple[int, int, int, int]]:
        """``(node, rank, step, round)`` of the newest whole replica of each rank held."""
        with self._lock:
            keys = sorted(self._slots)
        out = []
        for node_id, rank in keys:
            h = self.newest(node_id, rank)
            if h is not None:
                out.append((node_id, rank, h.step, h.round))
        return out

    def close(self) -> None:
        with self._lock:
            for slots in self._slots.values():
                for slot in slots:
                    slot.close()
            self._slots.clear()


class ReplicaServer:
    """Serves this node's snapshots and the replicas it holds (routes in the module doc).

    Args:
        job_id, node_id, agent: this node (names the segments it reads).
        store: the replicas this node holds for others.
        host: the address to listen on (the one the other hosts reach this host at).
        port: ``0``: a free port (:attr:`address` says which).
    """

    def __init__(self, *, job_id: str, node_id: int, agent: int, store: ReplicaStore, host: str = "127.0.0.1",
                 port: int = 0) -> None:
        self.job_id, self.node_id, self.agent, self.store = job_id, node_id, agent, store
        self._own: dict[int, list[SnapshotSlot | None]] = {}
        self._own_lock = threading.Lock()
        #: per rank of this node: ``(round, seq)`` of the newest replica its buddy says it
        #: holds, and when the buddy said it would ask next (monotonic seconds)
        self.buddy: dict[int, tuple[tuple[int, int], float]] = {}
        self._buddy_lock = threading.Lock()  # (request threads update it: no lost update)
        self._closing = False
        #: called after each buddy request (the pins may be released now)
        self.on_buddy: Callable[[], None] = lambda: None
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                try:
                    server._answer(self)
                except (BrokenPipeError, ConnectionResetError):  # the asker went away (it died, or gave up)
                    self.close_connection = True

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (http.server's name)
                pass

        self._httpd = http.server.ThreadingHTTPServer((host, port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="dlrover-replica-server", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"{host}:{port}"

    def own_slots(self, rank: int) -> list[SnapshotSlot]:
        """The rank's slots, re-opened when a name now points at another file (a worker's
        segments removed and made anew), as the saver does; a slot not made yet is looked
        for again next time (a replacement's fetched replicas fill two slots before its
        worker makes the third)."""
        with self._own_lock:
            opened = self._own.get(rank)
            if opened is not None and any(slot.replaced() for slot in opened if slot is not None):
                for slot in self._own.pop(rank):
                    if slot is not None:
                        slot.close()
                opened = None
            if opened is None or None in opened:
                opened = opened or [None] * SLOTS
                for i, slot in enumerate(opened):
                    if slot is None:
                        opened[i] = SnapshotSlot.open(segment_name(self.job_id, self.node_id, rank, i, self.agent),
                                                      create=False)
                self._own[rank] = opened
            return [slot for slot in opened if slot is not None]

    def _peek_newest(self, ranks: list[int]) -> int:
        """The oldest of the ranks' newest steps, from the headers as they are (unchecked:
        a trigger only; -1 where a rank has none)."""
        oldest = None
        for rank in ranks:
            steps = [p[1] for slot in self.own_slots(rank) if (p := slot.peek()) is not None and p[0] == READY]
            newest = max(steps, default=-1)
            oldest = newest if oldest is None else min(oldest, newest)
        return -1 if oldest is None else oldest

    def _steps_in_order(self, rank: int) -> list[int]:
        """The steps of ``rank``'s snapshots here, oldest first as written (:func:`_order`:
        after a go-back, the new lineage's last)."""
        found = [h for slot in self.own_slots(rank) if (h := slot.header()) is not None and h.live and h.rank == rank]
        return [h.step for h in sorted(found, key=_order)]

    def _heard(self, ranks: list[int], for_s: float, ident: tuple[int, int] | None = None) -> None:
        """The buddy was heard of ``ranks`` (holding ``ident`` where given): it is not silent
        for ``for_s`` seconds from now (a long poll's wait, or when it said it asks next)."""
        until = time.monotonic() + max(0.0, for_s)
        with self._buddy_lock:
            for rank in ranks:
                held = self.buddy.get(rank)
                if ident is not None:
                    self.buddy[rank] = (ident, until)
                elif held is not None:
                    self.buddy[rank] = (held[0], max(held[1], until))

    def _answer(self, request: http.server.BaseHTTPRequestHandler) -> None:
        url = urlsplit(request.path)
        query = parse_qs(url.query)
        newer_than = int((query.get("newer_than") or ["-1"])[0])
        older_than = int(query["older_than"][0]) if "older_than" in query else None
        after: tuple[int, int] | None = None
        next_s = 0.0
        copy = query.get("copy") == ["1"]
        if url.path == "/v1/steps":  # a buddy's pass begins: each rank's newest step
            ranks = [int(r) for r in (query.get("ranks") or [""])[0].split(",") if r]
            held = int((query.get("after") or ["-1"])[0])
            wait_s = min(float((query.get("wait_s") or ["0"])[0]), _LONG_POLL_MAX_S)
            self._heard(ranks, wait_s)
            deadline = time.monotonic() + wait_s
            # (a long poll: answered once some rank's newest step is not the one the buddy holds)
            while (wait_s > 0 and not self._closing and time.monotonic() < deadline
                   and self._peek_newest(ranks) == held):
                time.sleep(_LONG_POLL_TICK_S)
            held_steps = {rank: self._steps_in_order(rank) for rank in ranks}
            body = json.dumps({str(rank): steps for rank, steps in held_steps.items()}).encode()
            request.send_response(200)
            request.send_header("Content-Type", "application/json")
            request.send_header("Content-Length", str(len(body)))
            request.end_headers()
            request.wfile.write(body)
            return
        if m := re.fullmatch(r"/v1/snapshot/(\d+)", url.path):
            rank = int(m[1])
            if "seq" in query:  # a buddy: it holds the snapshot (round, seq), and asks again in next_s
                after = (int((query.get("round") or ["0"])[0]), int(query["seq"][0]))
                next_s = float((query.get("next_s") or ["0"])[0])
                self._heard([rank], next_s, after)
                self.on_buddy()
            step = int(query["step"][0]) if "step" in query else None
            slots = self.own_slots(rank)  # (slots not made yet are looked for again next time)
            if after is not None and _abandoned(slots, rank, after):
                request.send_error(409, "the replica held is of a lineage this node went back from: drop it")
                return
            found = None if query.get("ack") == ["1"] else _pick(slots, rank, newer_than, after=after, step=step)
        elif m := re.fullmatch(r"/v1/replica/(\d+)/(\d+)", url.path):
            rank = int(m[2])
            found = self.store.pick(int(m[1]), rank, newer_than, older_than)
        else:
            request.send_error(404, f"no route {url.path}")
            return
        frame = None
        if found is not None and copy:  # the stream was cut by saves last time: a copy, under a lock
            frame = take_frame(found[0], rank=rank, newer_than=found[1].step - 1)
            if frame is None or frame_header(frame).seq != found[1].seq:  # re-published meanwhile: next time
                frame, found = None, None
        if found is None:
            request.send_response(204)
            request.send_header("Content-Length", "0")
            request.end_headers()
            return
        request.send_response(200)
        request.send_header("Content-Type", "application/octet-stream")
        request.send_header("Content-Length", str(len(frame) if frame is not None else FrameHeader.of(found[1]).frame_len))
        request.end_headers()
        if frame is not None:
            request.wfile.write(frame)
            return
        if url.path.startswith("/v1/snapshot/"):  # a buddy's background pull: training comes first (a
            _lower_this_thread()  # replacement's fetch of a replica is a recovery: not lowered)
        send_frame(found[0], found[1], request.wfile.write, send_file=_socket_sender(request.connection))
        if after is not None:  # (heard until the frame was sent, and next_s after)
            self._heard([rank], next_s)

    def close(self) -> None:
        self._closing = True  # (a long poll in flight ends)
        self._httpd.shutdown()
        self._httpd.server_close()
        with self._own_lock:
            for slots in self._own.values():
                for slot in slots:
                    if slot is not None:
                        slot.close()
            self._own.clear()


#: Seconds to connect to another agent: a holder whose host is gone (its link down, no
#: refusal) must not hold up a round's start for the whole transfer timeout.
_CONNECT_TIMEOUT_S = 3.0


def _lower_this_thread() -> None:
    """This thread at the lowest CPU priority (``nice -n 19`` for one thread: Linux's
    ``setpriority(PRIO_PROCESS, tid)``); where that is not permitted, as it was."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _PULL_NICE)
    except OSError:
        pass


def _socket_sender(sock: Any) -> Callable[[int, int, int], None] | None:
    """``send_file(fd, offset, count)`` into ``sock`` by ``os.sendfile`` (the request's
    socket is blocking: the server sets no timeout), or ``None`` where the OS has none."""
    if not hasattr(os, "sendfile"):
        return None
    out = sock.fileno()

    def send_file(fd: int, offset: int, count: int) -> None:
        while count > 0:
            sent = os.sendfile(out, fd, offset, count)
            if sent == 0:
                raise ConnectionError("the buddy closed the connection while a replica frame was sent")
            offset += sent
            count -= sent

    return send_file


class _Stale(Exception):
    """The source says the replica held is of a lineage it went back from (HTTP 409)."""


class _Connection:
    """A kept-alive HTTP connection to another agent's :class:`ReplicaServer` (the standard
    library's ``http.client``: its responses read straight into a caller's buffer, which
    is how a frame lands in a slot without a copy)."""

    def __init__(self, address: str, timeout_s: float) -> None:
        host, port = address.rsplit(":", 1)
        self.host, self.port, self.timeout_s = host, int(port), timeout_s
        self._conn: http.client.HTTPConnection | None = None
        self._aborted = False

    def _connect(self) -> None:
        if self._aborted:
            raise ConnectionAbortedError(f"the connection to {self.host}:{self.port} was aborted")
        if self._conn is None:
            self._conn = http.client.HTTPConnection(self.host, self.port, timeout=min(_CONNECT_TIMEOUT_S, self.timeout_s))
            self._conn.connect()
            assert self._conn.sock is not None
            self._conn.sock.settimeout(self.timeout_s)
            if self._aborted:  # (aborted while this connected)
                self.close()
                raise ConnectionAbortedError(f"the connection to {self.host}:{self.port} was aborted")

    def get(self, path: str, receive: Callable[[FrameHeader, Callable[[memoryview], int]], FrameHeader],
            ) -> FrameHeader | None:
        """GET ``path``; on 200 hand the frame's preamble and the body's reader to
        ``receive``; ``None`` on 204.

        Raises:
            OSError, http.client.HTTPException: the holder cannot be reached or broke off.
            ReplicaError: the frame was refused (from ``receive``).
        """
        self._connect()
        assert self._conn is not None
        try:
            self._conn.request("GET", path)
            response = self._conn.getresponse()
            if response.status == 204:
                response.read()
                return None
            if response.status == 409:
                response.read()
                raise _Stale(path)
            if response.status != 200:
                raise http.client.HTTPException(f"{path}: HTTP {response.status} {response.read()[:200]!r}")
            h = receive(read_preamble(response.readinto), response.readinto)
            if response.read(1):  # (nothing after the frame: the connection stays in step)
                raise ReplicaError(f"{path}: bytes after the frame's trailer")
            return h
        except BaseException:
            self.close()  # a response cut off half-way leaves the connection out of step
            raise

    def get_json(self, path: str) -> Any:
        """GET ``path`` and parse the JSON body.

        Raises:
            OSError, http.client.HTTPException: as :meth:`get`; ValueError: not JSON.
        """
        self._connect()
        assert self._conn is not None
        try:
            self._conn.request("GET", path)
            response = self._conn.getresponse()
            body = response.read()
            if response.status != 200:
                raise http.client.HTTPException(f"{path}: HTTP {response.status} {body[:200]!r}")
            return json.loads(body)
        except BaseException:
            self.close()
            raise

    def abort(self) -> None:
        """Break off a request in flight from another thread (its read raises ``OSError`` at
        once): a source whose host is gone answers nothing, and a read would wait out the
        whole ``timeout_s``. No request is sent after it."""
        self._aborted = True
        conn = self._conn
        sock = conn.sock if conn is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def _no_frame(h: FrameHeader, read_into: Callable[[memoryview], int]) -> FrameHeader:
    raise ReplicaError(f"a frame of rank {h.rank} step {h.step} where none was asked for")


def _paced(max_bytes_per_s: float | None, sleep: Callable[[float], object]) -> Callable[[int], None] | None:
    """An ``on_progress`` that sleeps whenever ``max_bytes_per_s`` is exceeded (``None``: none)."""
    if not max_bytes_per_s:
        return None
    t0 = time.monotonic()

    def on_progress(received: int) -> None:
        ahead_s = received / max_bytes_per_s - (time.monotonic() - t0)
        if ahead_s > 0:
            sleep(ahead_s)
    return on_progress


def fetch_replica(address: str, node_id: int, rank: int, *, into: SnapshotSlot, timeout_s: float = 60.0,
                  newer_than: int = -1, older_than: int | None = None) -> FrameHeader | None:
    """Fetch the newest replica of ``node_id``'s ``rank`` (older than ``older_than`` if given)
    from the agent at ``address`` and publish it into ``into`` (a slot of the replacement's
    own rank), read straight into it; ``None``: it holds none. A stream cut by the holder
    (its replica re-published meanwhile) is asked for again as a copy.

    Raises:
        ReplicaError: the frame arrived damaged (``into`` left EMPTY).
        OSError, http.client.HTTPException: the holder cannot be reached.
    """
    connection = _Connection(address, timeout_s)
    older = "" if older_than is None else f"&older_than={older_than}"
    path = f"/v1/replica/{node_id}/{rank}?newer_than={newer_than}{older}"
    try:
        try:
            return connection.get(path, lambda h, read_into: receive_frame(into, h, read_into))
        except ReplicaTornError:
            return connection.get(path + "&copy=1", lambda h, read_into: receive_frame(into, h, read_into))
    finally:
        connection.close()


class ReplicaPuller:
    """Pulls the snapshots of a source node's ranks into a :class:`ReplicaStore`, in a
    background thread at the lowest CPU priority, every ``interval_s``, at most
    ``max_bytes_per_s`` (``None``: unbounded), and using at most ``cpu_share`` of one core
    on average: after a pass that took ``c`` seconds of its thread's CPU time it waits
    ``c / cpu_share`` at least (``Checkpoint.replica_cpu_share``), so a snapshot that is large
    against the step time is replicated every few steps instead of taking a core away from
    the training (``1.0``: no such wait beyond ``interval_s``).

    A frame that fails its checks is logged and dropped; the replica held stays. A rank
    whose stream was cut by the source's saves (its slot re-published while it was sent)
    is asked for as a copy next time.
    """

    def __init__(self, store: ReplicaStore, *, source_node: int, source_address: str, ranks: list[int],
                 interval_s: float = 1.0, max_bytes_per_s: float | None = None, cpu_share: float = 1.0,
                 timeout_s: float = 60.0) -> None:
        if not 0 < cpu_share <= 1:
            raise ValueError(f"cpu_share={cpu_share!r}: give a share of one core in (0, 1]")
        self.store, self.source_node, self.ranks = store, source_node, list(ranks)
        self.interval_s, self.max_bytes_per_s, self.cpu_share = interval_s, max_bytes_per_s, cpu_share
        self._connection = _Connection(source_address, timeout_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dlrover-replica-puller", daemon=True)
        self._copy_next: set[int] = set()  # ranks whose last stream was torn
        self.pulled = 0  # frames stored
        self.refused = 0  # frames dropped as damaged
        self.torn = 0  # streams cut by the source's saves (asked for as a copy next)
        self.next_s = interval_s  # the wait after the last pass: how long until the source hears again

    def start(self) -> ReplicaPuller:
        self._thread.start()
        return self

    def _held(self, rank: int) -> str:
        """The query that says which replica of ``rank`` this buddy holds, and when it asks next
        (the source's agent confirms and releases its pins from it)."""
        held = self.store.newest(self.source_node, rank)
        ident = "round=-1&seq=-1" if held is None else f"round={held.round}&seq={held.seq}"
        return f"{ident}&next_s={self.next_s:.3f}"

    def pull_once(self) -> int:
        """One pass over the ranks; returns how many new frames were stored.

        A pass replicates one step of every rank: the newest step every rank of the source
        has (``/v1/steps``), so that the replicas of a node's ranks are of the same steps
        (a pass cut short leaves the ranks at this step or the previous one)."""
        stored = 0
        held = [h.step if (h := self.store.newest(self.source_node, rank)) is not None else -1 for rank in self.ranks]
        after = min(held, default=-1)
        try:  # (waits at the source until there is a step newer than the one held of every rank)
            newest = self._connection.get_json(f"/v1/steps?ranks={','.join(map(str, self.ranks))}"
                                               f"&after={after}&wait_s={_LONG_POLL_S}")
        except (OSError, http.client.HTTPException, ValueError) as exc:
            log.debug("replica_pull_failed", node_id=self.source_node, error=str(exc))
            return 0
        steps = [list(newest.get(str(rank)) or ()) for rank in self.ranks]
        common = set.intersection(*map(set, steps)) if steps else set()
        # the newest step every rank holds (newest as written: after a go-back, the new
        # lineage's); where none is common (ranks that skipped different saves), each rank's
        # newest, so that the replicas go on
        target = next((step for step in reversed(steps[0]) if step in common), -1) if steps else -1
        for rank in self.ranks:
            if self._stop.is_set():
                break
            after = self._held(rank) + (f"&step={target}" if target >= 0 else "")
            copy = "&copy=1" if rank in self._copy_next else ""
            on_progress = _paced(self.max_bytes_per_s, self._stop.wait)
            try:
                h = self._connection.get(f"/v1/snapshot/{rank}?{after}{copy}", functools.partial(
                    self.store.receive, self.source_node, on_progress=on_progress))
                if h is not None:  # say so at once: the source's next save may wait for it
                    self._connection.get(f"/v1/snapshot/{rank}?{self._held(rank)}&ack=1", _no_frame)
            except _Stale:
                self.store.drop(self.source_node, rank)
                log.info("replica_dropped", node_id=self.source_node, rank=rank,
                         reason="of a lineage the source went back from")
                continue
            except ReplicaTornError as exc:
                self.torn += 1
                self._copy_next.add(rank)
                log.debug("replica_torn", node_id=self.source_node, rank=rank, reason=str(exc))
                continue
            except (OSError, http.client.HTTPException, ReplicaTruncatedError) as exc:
                # the source or the link went away, or /dev/shm is full: the replica held stays
                log.debug("replica_pull_failed", node_id=self.source_node, rank=rank, error=str(exc))
                continue
            except ReplicaError as exc:
                self.refused += 1
                log.warning("replica_refused", node_id=self.source_node, rank=rank, reason=str(exc))
                continue
            self._copy_next.discard(rank)
            if h is None:
                continue
            self.pulled += 1
            stored += 1
            log.debug("replica_pulled", node_id=self.source_node, rank=rank, step=h.step, mb=round(h.data_len / 2**20, 1))
        return stored

    def announce(self) -> None:
        """Tell the source when this puller asks next (``next_s``, the wait it is about to
        take): its pins are not held for a buddy that is only waiting its turn."""
        for rank in self.ranks:
            try:
                self._connection.get(f"/v1/snapshot/{rank}?{self._held(rank)}&ack=1", _no_frame)
            except (OSError, http.client.HTTPException, ReplicaError, _Stale):
                return

    def _run(self) -> None:
        _lower_this_thread()
        while not self._stop.is_set():
            c0 = time.thread_time()
            self.pull_once()
            self.next_s = self.wait_after(time.thread_time() - c0)
            self.announce()
            self._stop.wait(self.next_s)

    def wait_after(self, cpu_s: float) -> float:
        """Seconds to wait after a pass that took ``cpu_s`` seconds of this thread's CPU time:
        ``interval_s``, or longer, so that the thread's CPU stays within ``cpu_share`` of a core."""
        return max(self.interval_s, cpu_s / self.cpu_share)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._connection.abort()  # (a read from a source that is gone would wait its timeout out)
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self._connection.close()


#: Share of the link a puller may read at (``Checkpoint.replica_mb_per_s=None``): the rest is
#: the training's (its collectives share the interface).
_LINK_SHARE = 0.25
#: Budget (bytes/s) where the interface towards the source reports no speed (virtual NICs,
#: some cloud interfaces): 1,000 MB/s, a quarter of a 32 Gb/s link.
_UNKNOWN_LINK_BYTES_PER_S = 1e9


def replica_budget(source_address: str, mb_per_s: float | None = None) -> tuple[float | None, str]:
    """The puller's bandwidth budget towards ``source_address`` (``host:port``), in bytes
    per second (``None``: unbounded), and why.

    ``mb_per_s`` (``Checkpoint.replica_mb_per_s``) wins where given. Otherwise: no limit
    when the source is on this host (the interface is loopback: no link to share), else
    :data:`_LINK_SHARE` of the interface's speed (``psutil.net_if_stats``, from Linux's
    ``/sys/class/net/<interface>/speed``, megabits per second), or
    :data:`_UNKNOWN_LINK_BYTES_PER_S` where the interface reports none (speed 0).
    """
    if mb_per_s is not None:
        return mb_per_s * 1e6, "checkpoint.replica_mb_per_s"
    local = _address_towards(source_address)
    interface = next((name for name, addrs in psutil.net_if_addrs().items()
                      if any(a.address == local for a in addrs)), None)
    stats = psutil.net_if_stats().get(interface) if interface is not None else None
    if local.startswith("127.") or (stats is not None and "loopback" in getattr(stats, "flags", "")):
        return None, "loopback"
    if stats is None or not stats.speed:
        return _UNKNOWN_LINK_BYTES_PER_S, f"interface {interface or '?'} reports no speed"
    return stats.speed * 1e6 / 8 * _LINK_SHARE, f"{_LINK_SHARE:.0%} of {interface}'s {stats.speed} Mb/s"


def _address_towards(addr: str) -> str:
    """This host's address on the route to ``addr`` (``host:port``): the one peers reach it at."""
    host, port = addr.rsplit(":", 1)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, int(port)))  # (UDP: nothing is sent)
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


class NodeReplicas:
    """An agent's part in replication: serve, pull from the round's source, report, fetch.

    Args:
        job_id, node_id: the agent's node.
        master_addr: ``host:port`` of the job master (the server listens on this host's
            address towards it).
        interval_s: the least time between two passes of the puller (it waits for a new
            snapshot at the source: a long poll).
        mb_per_s: the puller's bandwidth budget (``Checkpoint.replica_mb_per_s``; ``None``:
            from the link towards each source, :func:`replica_budget`).
        cpu_share: the puller's share of one core (``Checkpoint.replica_cpu_share``).
    """

    def __init__(self, *, job_id: str, node_id: int, master_addr: str, interval_s: float = 0.01,
                 mb_per_s: float | None = None, cpu_share: float = 1.0) -> None:
        self.job_id, self.node_id = job_id, node_id
        self.interval_s, self.mb_per_s, self.cpu_share = interval_s, mb_per_s, cpu_share
        self.store = ReplicaStore(job_id=job_id, node_id=node_id, agent=0)
        self.server = ReplicaServer(job_id=job_id, node_id=node_id, agent=0, store=self.store,
                                    host=_address_towards(master_addr))
        self._puller: ReplicaPuller | None = None
        self._source: tuple[int, str, tuple[int, ...]] | None = None
        self._follow_lock = threading.Lock()
        self._ranks: tuple[int, ...] = ()  # this node's ranks (their pins are kept)
        self._since = time.monotonic()  # (a buddy that never asks is silent after _BUDDY_GRACE_S from here)
        self._silent = False
        self._wake = threading.Event()
        self._closing = threading.Event()
        self.server.on_buddy = self._wake.set
        self._keeper = threading.Thread(target=self._keep_pins, name="dlrover-replica-pins", daemon=True)
        self._keeper.start()

    @property
    def address(self) -> str:
        return self.server.address

    def _keep_pins(self) -> None:
        while not self._closing.is_set():
            self._wake.wait(_PIN_TICK_S)
            self._wake.clear()
            try:
                self.apply_pins()
            except Exception as exc:  # noqa: BLE001 (a slot removed under us: look again next tick)
                log.debug("replica_pins_failed", node_id=self.node_id, error=str(exc))

    def set_ranks(self, ranks: list[int]) -> None:
        """The ranks whose snapshots this node holds (their pins are kept by this agent);
        what a buddy said of other ranks is forgotten (their old snapshots hold nothing back)."""
        self._ranks = tuple(ranks)
        for rank in list(self.server.buddy):
            if rank not in ranks:
                self.server.buddy.pop(rank, None)

    def apply_pins(self) -> dict[int, set[Hashable]]:
        """Release the pins of this node's snapshots that the replicas no longer need
        (:func:`pins_to_release`, from what the buddy says it holds); while the buddy is
        silent, hold them instead (saves skip rather than wait) and keep them again when it
        is back. Returns what was released (``rank -> {(round, seq)}``)."""
        now = time.monotonic()
        buddy = dict(self.server.buddy)
        last = max((deadline for _, deadline in buddy.values()), default=self._since)
        silent = now > last + _BUDDY_GRACE_S
        if silent != self._silent:
            self._silent = silent
            log.info("replica_pins_held" if silent else "replica_pins_kept", node_id=self.node_id,
                     reason="the buddy node stopped asking for this node's snapshots" if silent else "the buddy is back")
        own: dict[int, list[tuple[int, tuple[int, int]]]] = {}
        pinned: list[tuple[SnapshotSlot, SlotHeader]] = []
        for rank in sorted(set(buddy) | set(self._ranks)):
            own[rank] = []
            for slot in self.server.own_slots(rank):
                h = slot.header()
                if h is None or not h.live or h.rank != rank:
                    continue
                own[rank].append((h.step, (h.round, h.seq)))
                if h.pinned:
                    pinned.append((slot, h))
        if not pinned:
            return {}
        released, confirmed = ({}, {}) if silent else pins_to_release(  # (the ranks the buddy follows)
            {rank: own[rank] for rank in buddy}, {rank: ident for rank, (ident, _) in buddy.items()})
        for slot, h in pinned:
            ident = (h.round, h.seq)
            # a rank the buddy does not follow (one a worker took over in the live world): not kept
            unfollowed = bool(buddy) and h.rank not in buddy
            pin = (PIN_HELD if silent else PIN_RELEASED if unfollowed or ident in released.get(h.rank, ())
                   else PIN_CONFIRMED if ident in confirmed.get(h.rank, ()) else PIN_KEPT)
            if pin == h.pin:
                continue
            with slot.shared():  # (a save holds it exclusively: the slot is the writer's until it publishes)
                now_h = slot.header()
                if now_h is not None and (now_h.round, now_h.seq) == ident and now_h.pinned:
                    slot.set_pin(pin)
        return released

    def set_token(self, token: int) -> None:
        """The agent's fencing token (names its segments), once it registered."""
        self.store.agent = self.server.agent = token

    def held(self) -> tuple[tuple[int, int, int, int], ...]:
        return tuple(self.store.held())

    def holds(self, rank: int) -> bool:
        """Whether this agent's slots hold a complete snapshot of ``rank``."""
        for slot_index in range(SLOTS):
            slot = SnapshotSlot.open(segment_name(self.job_id, self.node_id, rank, slot_index, self.store.agent),
                                     create=False)
            if slot is None:
                continue
            try:
                h = slot.header()
                if h is not None and h.live and h.rank == rank:
                    return True
            finally:
                slot.close()
        return False

    def fetch_missing(self, holders: tuple[tuple[int, int, str], ...]) -> list[dict[str, Any]]:
        """For each ``(rank, node, holder address)`` whose rank this node holds no snapshot
        of, fetch the holder's two newest replicas into the rank's two
        slots. Returns what was fetched (for the log); a holder that cannot be reached, or a
        damaged frame, leaves that rank without (its restore then reads storage)."""
        fetched = []
        for rank, node_id, address in holders:
            if self.holds(rank):
                continue
            older_than = None
            for slot_index in range(_SLOTS):
                slot = SnapshotSlot.open(segment_name(self.job_id, self.node_id, rank, slot_index, self.store.agent),
                                         create=True)
                assert slot is not None
                try:
                    h = fetch_replica(address, node_id, rank, into=slot, older_than=older_than)
                except (OSError, http.client.HTTPException, ReplicaError) as exc:
                    log.warning("replica_fetch_failed", node_id=self.node_id, rank=rank, holder=address, error=str(exc))
                    h = None
                finally:
                    slot.close()
                if h is None:
                    break
                fetched.append({"rank": rank, "step": h.step, "round": h.round, "mb": round(h.data_len / 2**20, 2)})
                older_than = h.step
        return fetched

    def follow(self, source: int, address: str, ranks: tuple[int, ...]) -> None:
        """Keep replicas of ``source``'s ``ranks`` (served at ``address``); ``source < 0``: none."""
        with self._follow_lock:  # (the round's start and the heartbeats both say whom to follow)
            self._follow(source, address, ranks)

    def _follow(self, source: int, address: str, ranks: tuple[int, ...]) -> None:
        wanted = (source, address, tuple(ranks)) if source >= 0 and address else None
        if wanted == self._source:
            return
        if self._puller is not None:
            self._puller.stop()
            self._puller = None
        self._source = wanted
        if wanted is not None:
            budget, why = replica_budget(address, self.mb_per_s)
            log.info("replica_source", node_id=self.node_id, source=source, ranks=list(ranks),
                     mb_per_s=None if budget is None else round(budget / 1e6, 1), budget=why)
            self._puller = ReplicaPuller(self.store, source_node=source, source_address=address, ranks=list(ranks),
                                         interval_s=self.interval_s, max_bytes_per_s=budget,
                                         cpu_share=self.cpu_share).start()

    def close(self) -> None:
        self._closing.set()
        self._wake.set()
        self._keeper.join(5.0)
        if self._puller is not None:
            self._puller.stop()
            self._puller = None
        self.server.close()
        self.store.close()
