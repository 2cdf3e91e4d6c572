"""Flash Checkpoint pieces in one process: slots, the saver, commits and restore decisions."""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import zlib

import pytest
import torch
from helpers import wait_for

from dlrover_core.checkpoint.layout import build_layout, decode, parse_header
from dlrover_core.checkpoint.memory import MemorySnapshots
from dlrover_core.checkpoint.saver import CheckpointSaver, shard_path
from dlrover_core.checkpoint.shm import SHM_DIR, SnapshotSlot, remove_segments, segment_name
from dlrover_core.master.checkpoints import CheckpointCoordinator
from dlrover_core.protocol import RestoreDecision, RestorePlanRequest, ShardAnswer, ShardReport
from dlrover_core.retry import storage_retrying
from dlrover_core.storage.posix import PosixStorage


@pytest.fixture
def job_id(request):
    jid = f"unit{os.getpid()}{abs(hash(request.node.name)) % 10**6}"
    yield jid
    remove_segments(f"dlrover-{jid}-")


def layout(step: int, rank: int = 0, world: int = 1, n: int = 1000):
    return build_layout({"state": {"w": torch.full((n,), float(step)), "step": step}}, step=step, rank=rank,
                        world_size=world)


def test_snapshot_round_trip_and_slot_rotation(job_id):
    """Saves alternate between the two slots; reads give the exact bytes of a held step."""
    snaps = MemorySnapshots(job_id=job_id, node_id=0, rank=0)
    try:
        for step in (1, 2, 3):
            snaps.save(layout(step), step=step, world_size=1, persist=step == 2)
        assert snaps.held_steps(1) == [2, 3]
        assert snaps.held_steps(2) == []  # another world size: not ours
        with snaps.read(3, 1) as (views, meta):
            assert torch.equal(views["state/w"], torch.full((1000,), 3.0))
            assert json.loads(meta["step"]) == 3
        with pytest.raises(LookupError):
            with snaps.read(1, 1):
                pass
        snaps.forget_after(2)
        assert snaps.held_steps(1) == [2]
    finally:
        snaps.close()


def test_a_save_never_overwrites_a_snapshot_being_read(job_id):
    """While the persister holds a slot, saves go to the other one, and do not wait."""
    snaps = MemorySnapshots(job_id=job_id, node_id=0, rank=0)
    persister = SnapshotSlot.open(segment_name(job_id, 0, 0, 0), create=False)
    try:
        snaps.save(layout(1), step=1, world_size=1, persist=True)  # slot 0 (both empty: first one)
        snaps.save(layout(2), step=2, world_size=1, persist=False)  # slot 1
        assert persister.header().step in (1, 2)
        held_slot = persister if persister.header().step == 1 else None
        assert held_slot is not None
        assert held_slot.try_lock(exclusive=False)  # the persister reads step 1
        for step in (3, 4, 5):
            snaps.save(layout(step), step=step, world_size=1, persist=False)
        assert held_slot.header().step == 1 and held_slot.header().valid
        held_slot.unlock()
        assert snaps.held_steps(1) == [1, 5]
    finally:
        persister.close()
        snaps.close()


def test_a_threads_unlock_never_drops_the_lock_another_thread_holds(job_id):
    """flock locks belong to the open file: two threads using one slot object would share
    one lock, and the first unlock would let a worker overwrite a snapshot the other
    thread is still persisting. The object lets one thread hold it at a time."""
    snaps = MemorySnapshots(job_id=job_id, node_id=0, rank=0)
    persister = SnapshotSlot.open(segment_name(job_id, 0, 0, 0), create=False)
    worker = SnapshotSlot.open(segment_name(job_id, 0, 0, 0), create=False)
    try:
        assert persister.try_lock(exclusive=False)  # a writer thread persists this slot
        other = []

        def look() -> None:  # another thread of the persister looks at the slot meanwhile
            got = persister.try_lock(exclusive=False)
            other.append(got)
            if got:
                persister.unlock()

        thread = threading.Thread(target=look)
        thread.start()
        thread.join()
        assert other == [False]
        assert not worker.try_lock(exclusive=True), "the persister's lock was dropped"
        persister.unlock()
        assert worker.try_lock(exclusive=True)
        worker.unlock()
    finally:
        worker.close()
        persister.close()
        snaps.close()


def test_a_write_overtaken_by_a_commit_keeps_its_slot_until_it_returns(job_id, tmp_path):
    """At a breakpoint a rank writes its newest snapshot first, then the older one; while
    that older write is in flight, the commit of the newer step makes it superseded. The
    saver must not free that slot before the write returns (a worker would overwrite the
    data being written, and the write's "persisted" mark would land on the new snapshot,
    which then is never written): the next save goes to the other slot, and is committed."""
    from structlog.testing import capture_logs

    entered, release, go0 = threading.Event(), threading.Event(), threading.Event()

    class GatedStorage(PosixStorage):
        @contextlib.contextmanager
        def open_write(self, path):
            if path == shard_path(2, 0, 0):
                go0.wait(30)
            if path == shard_path(1, 1, 0):
                entered.set()
                release.wait(30)
            with super().open_write(path) as f:
                yield f

    lock = threading.Lock()
    coordinator = CheckpointCoordinator(PosixStorage(str(tmp_path)), keep_last=10, event=lambda *a, **k: None)

    def report_shard(shard):
        with lock:
            return coordinator.shard_done(shard)

    saver = CheckpointSaver(job_id=job_id, node_id=0, storage=GatedStorage(str(tmp_path)), report_shard=report_shard,
                            report_error=print, poll_s=0.005)
    snaps = [MemorySnapshots(job_id=job_id, node_id=0, rank=r) for r in (0, 1)]
    try:
        saver.set_ranks([0, 1])
        for step in (1, 2):
            for r in (0, 1):
                snaps[r].save(layout(step, r, 2), step=step, world_size=2, persist=True)
        with capture_logs() as logs:
            saver.request_breakpoint()
            saver.start()
            assert entered.wait(10), "rank 1 did not start writing step 1 after step 2"
            go0.set()  # rank 0's step 2 lands: step 2 is committed while rank 1 writes step 1
            wait_for(lambda: coordinator.latest == 2, 10, "step 2 to be committed")
            wait_for(lambda: any(e["event"] == "checkpoint_snapshot_superseded" for e in logs), 10,
                     "rank 0's step 1 to be superseded")
            time.sleep(0.1)  # the saver's loop looks at rank 1's step 1 in the same pass, and again
        t0 = time.monotonic()
        for r in (0, 1):
            assert snaps[r].save(layout(3, r, 2), step=3, world_size=2, persist=True)
        assert time.monotonic() - t0 < 5
        release.set()
        result = saver.flush(10)
        assert result.ok, result
        assert PosixStorage(str(tmp_path)).latest_step() == 3
        assert [e for e in logs if e["event"] == "checkpoint_snapshot_superseded"] == [
            e for e in logs if e["event"] == "checkpoint_snapshot_superseded" and e["rank"] == 0]
    finally:
        release.set()
        go0.set()
        for s in snaps:
            s.close()
        saver.stop(timeout_s=5)


def test_a_writer_killed_mid_copy_leaves_no_readable_torn_slot(job_id):
    """A slot whose writer died after marking it WRITING is not READY: nobody reads it."""
    snaps = MemorySnapshots(job_id=job_id, node_id=0, rank=0)
    try:
        snaps.save(layout(1), step=1, world_size=1, persist=False)
        slot = SnapshotSlot.open(segment_name(job_id, 0, 0, 0), create=False)
        slot.begin_write()  # what a writer does first; then it "dies"
        assert slot.header().valid is False
        slot.close()
        assert snaps.held_steps(1) == []
    finally:
        snaps.close()


def test_saver_persists_flagged_snapshots_with_crc(job_id, tmp_path):
    storage = PosixStorage(str(tmp_path))
    reports: list[ShardReport] = []
    saver = CheckpointSaver(job_id=job_id, node_id=0, storage=storage,
                            report_shard=lambda shard: reports.append(shard) or ShardAnswer(), report_error=print)
    snaps = MemorySnapshots(job_id=job_id, node_id=0, rank=0)
    try:
        saver.set_ranks([0])
        snaps.save(layout(1), step=1, world_size=1, persist=False)
        assert saver.persist_due() == 0  # not flagged
        snaps.save(layout(2), step=2, world_size=1, persist=True)
        assert saver.persist_due() == 1
        assert saver.persist_due() == 0  # once only
        data = (tmp_path / shard_path(2, 0, 0)).read_bytes()
        entries, _, start = parse_header(data)
        shard, = reports
        assert shard.step == 2 and shard.rank == 0
        assert shard.crc32 == zlib.crc32(data[start:])
        state, _ = decode(data)
        assert torch.equal(state["state"]["w"], torch.full((1000,), 2.0))
        # at a breakpoint, unflagged snapshots newer than the last commit are persisted too
        snaps.save(layout(3), step=3, world_size=1, persist=False)
        assert saver.persist_breakpoint() == 1
        assert (tmp_path / shard_path(3, 0, 0)).exists()
    finally:
        snaps.close()
        saver.stop()


def test_saver_reports_storage_errors_and_goes_on(job_id, tmp_path):
    blocked = tmp_path / "ro"
    blocked.write_text("a file where a directory should be")  # every write under it fails
    reports = []
    saver = CheckpointSaver(job_id=job_id, node_id=0, storage=PosixStorage(str(blocked)),
                            report_shard=lambda shard: ShardAnswer(), report_error=reports.append,
                            retrying=lambda: storage_retrying(sleep=lambda s: None))
    snaps = MemorySnapshots(job_id=job_id, node_id=0, rank=0)
    try:
        saver.set_ranks([0])
        snaps.save(layout(2), step=2, world_size=1, persist=True)
        assert saver.persist_due() == 0
        assert reports and reports[0].step == 2
        assert not reports[0].fatal  # a failed write is reported; training goes on
        result = saver.flush(5)  # ...but the final checkpoint is not durable, and flush says why
        assert not result.ok and result.step == 2 and str(blocked) in result.reason and "Error" in result.reason
    finally:
        snaps.close()
        saver.stop()


def test_commit_needs_every_rank_and_only_moves_forward(tmp_path):
    storage = PosixStorage(str(tmp_path))
    events = []
    c = CheckpointCoordinator(storage, keep_last=2, event=lambda kind, **d: events.append((kind, d["step"] if "step" in d else None)))
    for step in (10, 20, 30):
        for r in range(2):
            storage.write_bytes(shard_path(step, r), b"x")
    storage.write_bytes(shard_path(25, 0), b"torn")  # a step that never completes
    def shard(step, rank, **info):
        return ShardReport(node_id=0, rank=rank, step=step, world_size=2, **info)

    assert c.shard_done(shard(10, 0, crc32=1, bytes=1)) == ShardAnswer(committed=None)
    assert c.shard_done(shard(10, 1, crc32=2, bytes=1)) == ShardAnswer(committed=10)
    assert storage.latest_step() == 10
    for step in (20, 30):
        c.shard_done(shard(step, 0))
        c.shard_done(shard(step, 1))
    assert c.shard_done(shard(20, 0)) == ShardAnswer(committed=30)  # stale: ignored
    assert storage.latest_step() == 30
    assert sorted({p.split("/")[0] for p in storage.list() if p.startswith("step_")}) == [
        "step_0000000020", "step_0000000030"]  # keep_last=2; the torn 25 is gone too
    meta = json.loads(storage.read("step_0000000030/checkpoint.json"))
    assert meta["world_size"] == 2 and sorted(meta["shards"]) == ["0", "1"]
    assert [k for k, _ in events].count("checkpoint_committed") == 3


@pytest.mark.parametrize(
    ("held", "committed", "want"),
    [
        ({0: [4, 5], 1: [4, 5]}, 4, ("memory", 5)),
        ({0: [4, 5], 1: [3, 4]}, 4, ("memory", 4)),
        ({0: [5, 6], 1: [3]}, 2, ("storage", 2)),   # no common step
        ({0: [3], 1: [3]}, 4, ("storage", 4)),      # memory older than the commit
        ({0: [], 1: []}, None, ("fresh", None)),
    ],
)
def test_restore_decision(tmp_path, held, committed, want):
    storage = PosixStorage(str(tmp_path))
    if committed is not None:
        storage.commit(committed)
    c = CheckpointCoordinator(storage, keep_last=3, event=lambda *a, **k: None)
    def plan(rank, steps):  # snapshots of round 0, as older workers report them
        return c.restore_plan(RestorePlanRequest(round=1, rank=rank, world_size=2, memory_steps=tuple(steps)))

    answers = [plan(r, s) for r, s in held.items()]
    assert answers[0] == RestoreDecision(state="waiting")
    assert (answers[1].source, answers[1].step) == want
    assert plan(0, []) == answers[1]  # decided once


def test_segments_live_in_the_shm_dir(job_id):
    snaps = MemorySnapshots(job_id=job_id, node_id=3, rank=7)
    snaps.close()
    assert sorted(n for n in os.listdir(SHM_DIR) if n.startswith(f"dlrover-{job_id}-")) == [
        f"dlrover-{job_id}-n3-a0-r7-s0", f"dlrover-{job_id}-n3-a0-r7-s1"]


def test_a_snapshot_awaiting_its_persist_is_not_overwritten(job_id, tmp_path):
    """Memory saves after a persist request leave the requested snapshot alone until the
    saver has written it. When persist requests come faster than the disk, nothing
    requested is dropped: a memory-only save is skipped, and a save asking for persistence
    waits until the saver frees a slot (backpressure); every requested step is written."""
    storage = PosixStorage(str(tmp_path))
    saver = CheckpointSaver(job_id=job_id, node_id=0, storage=storage, report_shard=lambda shard: ShardAnswer(),
                            report_error=print)
    snaps = MemorySnapshots(job_id=job_id, node_id=0, rank=0)
    try:
        saver.set_ranks([0])
        snaps.save(layout(10), step=10, world_size=1, persist=True)
        for step in (11, 12, 13):
            snaps.save(layout(step), step=step, world_size=1, persist=False)
            assert 10 in snaps.held_steps(1) and step in snaps.held_steps(1)
        assert saver.persist_due() == 1 and (tmp_path / shard_path(10, 0, 0)).exists()
        snaps.save(layout(14), step=14, world_size=1, persist=False)  # 10 is persisted: it may go now
        assert snaps.held_steps(1) == [13, 14]
        # two requests in a row, none persisted yet: the second overwrites nothing requested...
        assert snaps.save(layout(20), step=20, world_size=1, persist=True)
        assert snaps.save(layout(21), step=21, world_size=1, persist=True)
        # ...a memory-only save finds no free slot and is skipped...
        assert snaps.save(layout(22), step=22, world_size=1, persist=False) is False
        assert snaps.held_steps(1) == [20, 21]
        # ...and a third request waits for the saver to write 20
        writer = threading.Timer(0.3, saver.persist_due)
        writer.start()
        t0 = time.monotonic()
        assert snaps.save(layout(23), step=23, world_size=1, persist=True)
        assert time.monotonic() - t0 >= 0.25 and snaps.waited_s >= 0.25
        writer.join()
        saver.persist_due()  # what the timer's run left (23, maybe 21)
        assert all((tmp_path / shard_path(s, 0, 0)).exists() for s in (20, 21, 23))
        assert not (tmp_path / shard_path(22, 0, 0)).exists()
    finally:
        snaps.close()
        saver.stop()


def test_a_slow_write_is_warned_of_before_it_is_reported_stuck(job_id, tmp_path):
    """A shard write that does not return is logged as ``checkpoint_write_slow`` after a
    quarter of ``persist_timeout_s`` and again at each further quarter, with the seconds
    waited; at ``persist_timeout_s`` it is reported stuck (fatal), and no longer called slow."""
    from structlog.testing import capture_logs

    release = threading.Event()

    class HungStorage(PosixStorage):
        @contextlib.contextmanager
        def open_write(self, path):
            release.wait(30)  # a hung mount
            with super().open_write(path) as f:
                yield f

    errors = []
    saver = CheckpointSaver(job_id=job_id, node_id=0, storage=HungStorage(str(tmp_path)),
                            report_shard=lambda shard: ShardAnswer(), report_error=errors.append,
                            persist_timeout_s=2.0)
    snaps = MemorySnapshots(job_id=job_id, node_id=0, rank=0)
    try:
        with capture_logs() as logs:
            saver.set_ranks([0])
            snaps.save(layout(7), step=7, world_size=1, persist=True)
            saver.start()
            wait_for(lambda: errors, 10, "the stuck write to be reported")
            time.sleep(0.8)  # past the report: no slow warning after it
        slow = [e for e in logs if e["event"] == "checkpoint_write_slow"]
        assert errors and errors[0].fatal and errors[0].step == 7, errors
        # at 0.5, 1.0 and 1.5 s (a loop held up past a whole quarter warns once for both)
        assert len(slow) in (2, 3) and {e["step"] for e in slow} == {7}, slow
        waited = [e["waited_s"] for e in slow]
        assert waited == sorted(waited) and 0.5 <= waited[0] < 1.0 and 1.0 <= waited[-1] <= 2.0, waited
        assert all(e["fails_after_s"] == 2.0 and e["rank"] == 0 for e in slow)
    finally:
        release.set()
        snaps.close()
        saver.stop(timeout_s=5)
