"""Replica frames (dlrover_core/checkpoint/replica.py): a rank's snapshot copied out of its
slot, checked, and published into a slot on another node; a corrupted or torn frame is
never published, a slot re-published during the copy yields no frame, and a receiver
killed while it writes leaves no slot that reads as valid."""

from __future__ import annotations

import io
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid

import pytest

from dlrover_core.checkpoint.layout import build_layout, parse_header, tensor_views
from dlrover_core.checkpoint.memory import MemorySnapshots
from dlrover_core.checkpoint.replica import (
    PREAMBLE_SIZE,
    ReplicaError,
    frame_header,
    read_preamble,
    receive_frame,
    send_frame,
    take_frame,
    verify_frame,
    write_frame,
)
from dlrover_core.checkpoint.shm import SnapshotSlot, remove_segments, segment_name


@pytest.fixture
def job_id():
    job = f"replica-{uuid.uuid4().hex[:8]}"
    yield job
    remove_segments(f"dlrover-{job}-")


def state_at(step: int, n: int):
    """A state whose every value says which step it is from (a torn copy shows)."""
    import torch

    return {"w": torch.full((n,), float(step)), "b": torch.arange(7, dtype=torch.int64) + step, "step": step}


def values_of(slot: SnapshotSlot) -> tuple[int, set[float]]:
    """(step, the distinct values of its tensors less their step offsets) of a valid slot."""
    h = slot.header()
    assert h is not None and h.live
    entries, _, _ = parse_header(memoryview(slot.mm)[h.layout_off: h.layout_off + h.layout_len], with_data=False)
    views = tensor_views(slot.mm, h.data_off, entries)
    w = views[next(k for k in views if k.endswith("w"))]
    b = views[next(k for k in views if k.endswith("b"))]
    return h.step, set(w.tolist()) | set((b - __import__("torch").arange(7)).tolist())


def test_a_frame_round_trips_into_another_nodes_slot(job_id):
    """rank 3's snapshot, taken from node 0's slot and written into a slot named for node 1,
    is found and read by node 1's MemorySnapshots as rank 3's own, equal value for value."""
    ours = MemorySnapshots(job_id=job_id, node_id=0, rank=3, round_index=2)
    ours.save(build_layout(state_at(5, 1000), step=5, rank=3, world_size=4), step=5, world_size=4, persist=True)
    slot = next(s for s in ours.slots if (h := s.header()) is not None and h.live)
    frame = take_frame(slot, rank=3)
    assert frame is not None
    h = verify_frame(frame)
    assert (h.rank, h.step, h.world_size, h.round) == (3, 5, 4, 2)
    assert take_frame(slot, rank=3, newer_than=5) is None  # nothing newer than what the buddy holds
    assert take_frame(slot, rank=2) is None

    theirs_slot = SnapshotSlot.open(segment_name(job_id, 1, 3, 0), create=True)
    write_frame(theirs_slot, frame)
    theirs = MemorySnapshots(job_id=job_id, node_id=1, rank=3)
    assert theirs.held(4) == [(5, 2)]  # same step, same lineage (round)
    assert not theirs.slots[0].header().persist_requested  # the owner persists, not the buddy
    with theirs.read(5, 4, round_index=2) as (tensors, _):
        assert tensors["w"].eq(5.0).all() and tensors["w"].numel() == 1000
        assert tensors["b"].tolist() == list(range(5, 12))


@pytest.mark.parametrize("seed", range(8))
def test_a_damaged_frame_is_refused_and_the_slot_keeps_what_it_held(job_id, seed):
    """A flipped byte anywhere (preamble, layout, data) or a truncation: ReplicaError naming
    what did not match; the destination slot still holds its previous replica."""
    rng = random.Random(seed)
    src = MemorySnapshots(job_id=job_id, node_id=0, rank=0)
    dst = SnapshotSlot.open(segment_name(job_id, 1, 0, 0), create=True)
    for step in (1, 2):
        src.save(build_layout(state_at(step, 5000), step=step, rank=0, world_size=2), step=step, world_size=2,
                 persist=False)
        frame = max((f for s in src.slots if (f := take_frame(s, rank=0)) is not None),
                    key=lambda f: frame_header(f).step)
        if step == 1:
            write_frame(dst, frame)
    damaged = bytearray(frame)
    if rng.random() < 0.2:
        damaged = damaged[: rng.randrange(len(damaged))]
    else:
        at = rng.randrange(PREAMBLE_SIZE, len(damaged)) if rng.random() < 0.9 else rng.randrange(8)
        damaged[at] ^= 1 << rng.randrange(8)
    with pytest.raises(ReplicaError, match="checksum|bytes|magic|preamble|torn"):
        write_frame(dst, damaged)
    assert values_of(dst) == (1, {1.0})


def streamed(slot: SnapshotSlot, *, chunk_bytes: int = 1 << 20) -> tuple[bytes, bool]:
    """(the frame :func:`send_frame` streams out of ``slot``'s newest snapshot, whether whole)."""
    out = io.BytesIO()
    whole = send_frame(slot, slot.header(), out.write, chunk_bytes=chunk_bytes)
    return out.getvalue(), whole


def received(slot: SnapshotSlot, frame: bytes, *, chunk_bytes: int = 1 << 20):
    """:func:`receive_frame` of ``frame`` into ``slot``, read from a stream as a socket gives it."""
    stream = io.BytesIO(frame)
    return receive_frame(slot, read_preamble(stream.readinto), stream.readinto, chunk_bytes=chunk_bytes)


def test_a_streamed_frame_equals_the_copied_one_and_lands_in_the_slot_whole(job_id):
    """send_frame (no lock, no copy) gives the bytes take_frame (a copy under a lock) gives;
    receive_frame reads them straight into a slot that MemorySnapshots then restores from."""
    ours = MemorySnapshots(job_id=job_id, node_id=0, rank=1, round_index=3)
    ours.save(build_layout(state_at(7, 300_000), step=7, rank=1, world_size=2), step=7, world_size=2, persist=True)
    slot = next(s for s in ours.slots if (h := s.header()) is not None and h.live)
    frame, whole = streamed(slot, chunk_bytes=64 << 10)  # many chunks
    assert whole and frame == bytes(take_frame(slot, rank=1))
    dst = SnapshotSlot.open(segment_name(job_id, 1, 1, 0), create=True)
    h = received(dst, frame, chunk_bytes=100_000)  # chunks that do not divide the frame's parts
    assert (h.rank, h.step, h.round) == (1, 7, 3)
    assert values_of(dst) == (7, {7.0})
    theirs = MemorySnapshots(job_id=job_id, node_id=1, rank=1)
    assert theirs.held(2) == [(7, 3)]


def _tcp_pair():
    import socket

    with socket.create_server(("127.0.0.1", 0)) as server:
        client = socket.create_connection(server.getsockname())
        peer, _ = server.accept()
    return client, peer


def _send_by_reference(sock, slot):
    """send_frame as the replica server sends it: preamble and trailer written, the layout
    and data bytes by ``sendfile`` straight from the slot's file."""
    from dlrover_core.agent.replicas import _socket_sender

    return send_frame(slot, slot.header(), sock.sendall, send_file=_socket_sender(sock), chunk_bytes=64 << 10)


def test_a_frame_sent_by_reference_lands_whole_and_a_slot_changed_before_it_is_read_is_torn(job_id):
    """Sent by sendfile over a TCP socket, a frame lands whole in the buddy's slot; when the
    slot's bytes change after the last send but before the receiver reads them (the kernel
    holds references to the shared memory's pages, not a copy), the receiver refuses the
    frame as torn (and the next pull copies), never as whole with bytes that are not the
    snapshot's."""
    from dlrover_core.checkpoint.replica import ReplicaTornError

    ours = MemorySnapshots(job_id=job_id, node_id=0, rank=1, round_index=3)
    ours.save(build_layout(state_at(7, 20_000), step=7, rank=1, world_size=2), step=7, world_size=2, persist=True)
    slot = next(s for s in ours.slots if (h := s.header()) is not None and h.live)
    dst = SnapshotSlot.open(segment_name(job_id, 1, 1, 0), create=True)
    client, peer = _tcp_pair()
    try:
        assert _send_by_reference(peer, slot)
        stream = client.makefile("rb")
        h = receive_frame(dst, read_preamble(stream.readinto), stream.readinto)
        assert (h.rank, h.step, h.round) == (1, 7, 3) and values_of(dst) == (7, {7.0})
        assert _send_by_reference(peer, slot)  # unread in the socket until the slot changed
        sh = slot.header()
        slot.mm[sh.data_off : sh.data_off + 64] = b"\xff" * 64
        other = SnapshotSlot.open(segment_name(job_id, 1, 1, 1), create=True)
        try:
            receive_frame(other, read_preamble(stream.readinto), stream.readinto)
        except ReplicaTornError as exc:  # (Linux: the pages are read when the receiver reads)
            assert "sent by reference" in str(exc)
            assert not (other.header() and other.header().live)
        else:  # (a kernel that copies at sendfile: the bytes sent are the snapshot's)
            assert values_of(other) == (7, {7.0})
        assert values_of(dst) == (7, {7.0})
    finally:
        client.close()
        peer.close()


@pytest.mark.parametrize("seed", range(6))
def test_a_damaged_or_cut_stream_publishes_nothing(job_id, seed):
    """A flipped bit after the preamble, a stream cut short (the sender died), or a frame
    whose sender saw its slot re-published: ReplicaError, and the slot reads as empty (it
    held the older of two replicas), never as a torn snapshot."""
    rng = random.Random(seed)
    src = MemorySnapshots(job_id=job_id, node_id=0, rank=0)
    src.save(build_layout(state_at(3, 50_000), step=3, rank=0, world_size=1), step=3, world_size=1, persist=False)
    frame, _ = streamed(next(s for s in src.slots if (h := s.header()) is not None and h.live))
    dst = SnapshotSlot.open(segment_name(job_id, 1, 0, 0), create=True)
    received(dst, frame)  # it held a whole replica before
    damaged = bytearray(frame)
    kind = seed % 3
    if kind == 0:
        at = rng.randrange(PREAMBLE_SIZE, len(damaged))
        damaged[at] ^= 1 << rng.randrange(8)
    elif kind == 1:
        damaged = damaged[: rng.randrange(PREAMBLE_SIZE, len(damaged))]
    else:
        damaged[-4] = 0  # the trailer's "whole" flag: the sender's slot was re-published meanwhile
    with pytest.raises(ReplicaError, match="checksum|truncated|torn"):
        received(dst, bytes(damaged))
    h = dst.header()
    assert h is None or not h.live


WRITER = textwrap.dedent("""
    import random, sys, time
    sys.path.insert(0, sys.argv[1])
    from test_replica import state_at
    from dlrover_core.checkpoint.layout import build_layout
    from dlrover_core.checkpoint.memory import MemorySnapshots
    job, seed, start = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    rng = random.Random(seed)
    mem = MemorySnapshots(job_id=job, node_id=0, rank=0)
    step = start
    while True:
        n = rng.choice([100, 4000, 70000])  # sizes change: slots grow and are remapped
        mem.save(build_layout(state_at(step, n), step=step, rank=0, world_size=1), step=step, world_size=1,
                 persist=False)
        print(step, flush=True)
        step += 1
        time.sleep(rng.random() * 0.003)
""")

RECEIVER = textwrap.dedent("""
    import sys
    from dlrover_core.checkpoint.replica import write_frame
    from dlrover_core.checkpoint.shm import SnapshotSlot
    slot = SnapshotSlot.open(sys.argv[1], create=True)
    frame = sys.stdin.buffer.read()
    print("writing", flush=True)
    while True:
        write_frame(slot, frame)
""")


@pytest.mark.parametrize("seed", range(2))
def test_frames_taken_while_a_writer_saves_and_dies_are_whole_seeded(job_id, tmp_path, seed):
    """A writer process saves a snapshot of every step into the two slots as fast as it can,
    with sizes changing, and is SIGKILLed and restarted at random moments; frames are taken
    (copied under a lock) or streamed (no lock) meanwhile at random moments. Every frame
    taken verifies, and its data is all of its own step (none torn by a concurrent save);
    a streamed frame is either refused as torn or whole and of its own step; receivers
    SIGKILLed while they write a frame into a slot leave it invalid or whole, never torn."""
    rng = random.Random(seed)
    here = os.path.dirname(__file__)
    (tmp_path / "writer.py").write_text(WRITER)
    (tmp_path / "receiver.py").write_text(RECEIVER)

    def start_writer(step: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(tmp_path / "writer.py"), here, job_id, str(rng.randrange(10**6)),
                                 str(step)], stdout=subprocess.PIPE, text=True)

    slots = [SnapshotSlot.open(segment_name(job_id, 0, 0, s), create=True) for s in range(2)]
    writer = start_writer(0)
    taken = torn_free = kills = streams_whole = streams_torn = 0
    frames = []
    try:
        writer.stdout.readline()  # its first snapshot is published
        deadline, cap = time.monotonic() + 3, time.monotonic() + 60  # (a restarted writer imports torch again)
        next_kill = time.monotonic() + rng.uniform(0.2, 0.8)
        while (time.monotonic() < deadline or kills < 2) and time.monotonic() < cap:
            if time.monotonic() > next_kill:
                kills += 1
                writer.send_signal(signal.SIGKILL)
                writer.wait()
                newest = max((h.step for s in slots if (h := s.header()) is not None and h.live), default=-1)
                writer = start_writer(newest + 1)
                writer.stdout.readline()
                next_kill = time.monotonic() + rng.uniform(0.2, 0.8)
            time.sleep(rng.random() * 0.01)
            for slot in rng.sample(slots, 2):
                h0 = slot.header()
                if h0 is not None and h0.live and rng.random() < 0.5:  # streamed, no lock: torn or whole
                    frame, whole = streamed(slot, chunk_bytes=rng.choice([4096, 65536, 1 << 20]))
                    dst = SnapshotSlot.open(segment_name(job_id, 7, 0, 0), create=True)
                    try:
                        h = received(dst, frame)
                    except ReplicaError as exc:
                        assert not whole and "torn" in str(exc), exc
                        streams_torn += 1
                        continue
                    finally:
                        dst.close()
                    assert whole
                    dst = SnapshotSlot.open(segment_name(job_id, 7, 0, 0), create=False)
                    step, values = values_of(dst)
                    dst.close()
                    assert step == h.step and values == {float(step)}, (step, values)
                    streams_whole += 1
                    continue
                frame = take_frame(slot, rank=0)
                if frame is None:
                    continue
                h = verify_frame(frame)
                taken += 1
                dst = SnapshotSlot.open(segment_name(job_id, 9, 0, taken % 2), create=True)
                write_frame(dst, frame)
                step, values = values_of(dst)
                assert step == h.step and values == {float(step)}, (step, values)
                torn_free += 1
                if len(frames) < 4:
                    frames.append(bytes(frame))
    finally:
        writer.kill()
        writer.wait()
    assert taken >= 8 and torn_free == taken and kills >= 2, (taken, kills)
    assert streams_whole >= 8, (streams_whole, streams_torn)

    # receivers killed mid-write: the slot is invalid or holds one whole frame
    name = segment_name(job_id, 8, 0, 0)
    for frame in frames:
        receiver = subprocess.Popen([sys.executable, str(tmp_path / "receiver.py"), name], stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE)
        receiver.stdin.write(frame)
        receiver.stdin.close()
        receiver.stdout.readline()
        time.sleep(rng.random() * 0.05)
        receiver.send_signal(signal.SIGKILL)
        receiver.wait()
        slot = SnapshotSlot.open(name, create=False)
        h = slot.header()
        if h is not None and h.live:
            step, values = values_of(slot)
            assert values == {float(step)} and step in {frame_header(f).step for f in frames}
        slot.close()


@pytest.mark.parametrize("seed", range(3))
def test_a_replica_streamed_while_the_puller_rewrites_its_slots_is_whole_or_refused_seeded(job_id, seed):
    """In one agent, the puller's thread writes new replicas into a rank's two replica slots
    (``ReplicaStore.put``/``receive``: some streams cut short) while the server's thread
    streams the newest one out (``send_frame``, no lock), as a replacement's fetch does. Every
    frame the fetch accepts is whole and of one step; every other one is refused as torn
    or truncated, never published."""
    from dlrover_core.agent.replicas import ReplicaStore
    from dlrover_core.checkpoint.replica import ReplicaTruncatedError

    rng = random.Random(seed)
    src = MemorySnapshots(job_id=job_id, node_id=0, rank=0)
    frames = []
    for step in range(6):
        src.save(build_layout(state_at(step, rng.choice([100, 5000, 60000])), step=step, rank=0, world_size=1),
                 step=step, world_size=1, persist=False)
        frames.append(bytes(max((f for s in src.slots if (f := take_frame(s, rank=0)) is not None),
                                key=lambda f: frame_header(f).step)))
    store = ReplicaStore(job_id=job_id, node_id=1, agent=1)
    store.put(0, frames[0])
    stop = threading.Event()
    errors = []

    def puller() -> None:
        prng = random.Random(seed + 100)
        while not stop.is_set():
            frame = prng.choice(frames)
            if prng.random() < 0.3:  # a stream cut short: the target slot ends EMPTY, never torn
                stream = io.BytesIO(frame[: prng.randrange(PREAMBLE_SIZE + 1, len(frame))])
                try:
                    store.receive(0, read_preamble(stream.readinto), stream.readinto)
                    errors.append("a cut stream was published")
                except ReplicaTruncatedError:
                    pass
            else:
                store.put(0, frame)

    thread = threading.Thread(target=puller, daemon=True)
    thread.start()
    whole = refused = 0
    dst = SnapshotSlot.open(segment_name(job_id, 2, 0, 0), create=True)
    try:
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline or whole < 20:
            assert time.monotonic() < deadline + 30, (whole, refused)
            found = store.pick(0, 0)
            if found is None:
                continue
            out = io.BytesIO()
            send_frame(found[0], found[1], out.write, chunk_bytes=rng.choice([4096, 65536]))
            try:
                h = received(dst, out.getvalue())
            except ReplicaError as exc:
                assert "torn" in str(exc), exc
                refused += 1
                continue
            assert values_of(dst) == (h.step, {float(h.step)})
            whole += 1
    finally:
        stop.set()
        thread.join(10)
        dst.close()
        store.close()
    assert not errors, errors
