"""Incarnations and lineage in one process: a commit never mixes incarnations; a restore
abandons what is newer; a rank hosted again after a scale change is persisted (issue 11)."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch
from helpers import wait_for

from dlrover_core.checkpoint.layout import build_layout
from dlrover_core.checkpoint.memory import MemorySnapshots
from dlrover_core.checkpoint.saver import CheckpointSaver, shard_path
from dlrover_core.checkpoint.shm import remove_segments
from dlrover_core.master.checkpoints import CheckpointCoordinator
from dlrover_core.protocol import (
    RestorePlanRequest,
    RestoreVerify,
    RestoreVerifyAnswer,
    ShardAnswer,
    ShardReport,
)
from dlrover_core.storage.posix import PosixStorage


@pytest.fixture
def job_id(request):
    jid = f"lin{os.getpid()}{abs(hash(request.node.name)) % 10**6}"
    yield jid
    remove_segments(f"dlrover-{jid}-")


def layout(step: int, value: float, rank: int = 0, world: int = 1):
    return build_layout({"state": {"w": torch.full((64,), value)}}, step=step, rank=rank, world_size=world)


def coordinator(tmp_path, event=lambda *a, **k: None):
    return CheckpointCoordinator(PosixStorage(str(tmp_path)), keep_last=10, event=event)


def shard(c, *, step, rank, round_index, file, world_size=2):
    """Rank ``rank`` reports its shard of ``step`` (written in round ``round_index``) durable."""
    return c.shard_done(ShardReport(node_id=0, rank=rank, step=step, world_size=world_size, round=round_index,
                                    file=file))


def plan(c, *, round_index, rank, memory, world_size=2):
    """Rank ``rank`` reports the ``[step, round]`` snapshots it holds in memory."""
    return c.restore_plan(RestorePlanRequest(round=round_index, rank=rank, world_size=world_size,
                                             memory=tuple(tuple(m) for m in memory)))


def verify(c, *, round_index, rank, step, ok, error="", world_size=2):
    return c.verify(RestoreVerify(round=round_index, rank=rank, world_size=world_size, step=step, ok=ok, error=error))


def no_commit(shard):
    return ShardAnswer()


def test_shards_of_two_incarnations_never_make_a_commit(tmp_path):
    """Rank 0 persisted step 30 in round 0; round 1 went back to step 20 and trained 30
    again: rank 1's round-1 shard does not complete round 0's, rank 0's late round-0 shard
    is refused as stale, and the commit of 30 names round 1's files only."""
    c = coordinator(tmp_path)
    assert shard(c, step=30, rank=0, round_index=0, file="a") == ShardAnswer(committed=None)
    plan(c, round_index=1, rank=0, memory=[[20, 0]])
    assert plan(c, round_index=1, rank=1, memory=[[20, 0]]).step == 20
    assert c.pending_shards() == []  # round 0's step-30 shard was discarded by the restore
    assert shard(c, step=30, rank=1, round_index=1, file="r1") == ShardAnswer(committed=None)
    late = shard(c, step=30, rank=0, round_index=0, file="r0-late")
    assert late.stale and "round 1 went back to step 20" in late.reason
    assert c.latest is None
    shard(c, step=30, rank=0, round_index=1, file="r0")
    assert c.latest == 30
    meta = json.loads((tmp_path / "step_0000000030" / "checkpoint.json").read_text())
    assert meta["round"] == 1 and {s["file"] for s in meta["shards"].values()} == {"r0", "r1"}


def test_a_restore_never_picks_snapshots_of_an_abandoned_lineage(tmp_path):
    """Rank 0 still holds step 12 from round 0 (it died before round 1 restored, so nobody
    abandoned it); round 1 went back to 10 and rank 1 trained 12 again. In round 2 the
    two step-12 snapshots are of different lineages: memory restores the newest common
    step of the current lineage, 11 (round 1)."""
    c = coordinator(tmp_path)
    for r in (0, 1):
        plan(c, round_index=1, rank=r, memory=[[10, 0]])
    held = {0: [[11, 1], [12, 0]], 1: [[11, 1], [12, 1]]}
    answers = [plan(c, round_index=2, rank=r, memory=m) for r, m in held.items()]
    assert (answers[1].source, answers[1].step, answers[1].snapshot_round) == ("memory", 11, 1)


def committed_10_and_20(tmp_path, event=lambda *a, **k: None) -> tuple[PosixStorage, CheckpointCoordinator]:
    """A storage and its coordinator with steps 10 and 20 committed by two ranks (round 0)."""
    storage = PosixStorage(str(tmp_path))
    c = coordinator(tmp_path, event)
    for step in (10, 20):
        for r in (0, 1):
            storage.write_bytes(shard_path(step, r, 0), b"x")
            shard(c, step=step, rank=r, round_index=0, file=f"rank_0000{r}-round0.safetensors")
    return storage, c


def test_a_damaged_storage_step_makes_every_rank_fall_back(tmp_path):
    """Verification: one rank's shard of the newest commit is damaged; every rank is told
    to check the previous commit next, and all load it."""
    storage, c = committed_10_and_20(tmp_path)
    decided = [plan(c, round_index=1, rank=r, memory=[]) for r in (0, 1)][1]
    assert (decided.source, decided.step) == ("storage", 20)
    assert verify(c, round_index=1, rank=0, step=20, ok=True) == RestoreVerifyAnswer(state="waiting")
    answer = verify(c, round_index=1, rank=1, step=20, ok=False, error="torn file")
    assert answer.state == "retry" and answer.step == 10 and "rank 1" in answer.reason
    assert verify(c, round_index=1, rank=0, step=20, ok=True).step == 10  # a late rank learns too
    verify(c, round_index=1, rank=0, step=10, ok=True)
    assert verify(c, round_index=1, rank=1, step=10, ok=True) == RestoreVerifyAnswer(state="ok", step=10)
    assert c.damaged == {20: "rank 1's shard: torn file"}
    # the marker went back with the restore: a later job starts from the intact step
    assert c.latest == 10 and storage.latest_step() == 10
    # the next restore skips the damaged step at once
    decided = [plan(c, round_index=2, rank=r, memory=[]) for r in (0, 1)][1]
    assert (decided.source, decided.step) == ("storage", 10)


def test_the_lineage_that_went_back_commits_the_damaged_step_anew(tmp_path):
    """After a fallback below a damaged commit, the steps trained again are committed
    again: their shards are not ignored as "at or below the last commit", the new commit
    replaces the damaged one (no longer damaged), and retention keeps it."""
    storage, c = committed_10_and_20(tmp_path)
    [plan(c, round_index=1, rank=r, memory=[]) for r in (0, 1)]
    verify(c, round_index=1, rank=0, step=20, ok=True)
    verify(c, round_index=1, rank=1, step=20, ok=False, error="torn file")
    for r in (0, 1):
        verify(c, round_index=1, rank=r, step=10, ok=True)
    for r in (0, 1):
        storage.write_bytes(shard_path(20, r, 1), b"y")
    assert shard(c, step=20, rank=0, round_index=1, file="rank_00000-round1.safetensors").committed == 10
    assert shard(c, step=20, rank=1, round_index=1, file="rank_00001-round1.safetensors").committed == 20
    assert c.damaged == {} and storage.latest_step() == 20
    meta = json.loads((tmp_path / "step_0000000020" / "checkpoint.json").read_text())
    assert meta["round"] == 1
    assert sorted(p.rsplit("/", 1)[-1] for p in storage.list("step_0000000020")) == [
        "checkpoint.json", "rank_00000-round1.safetensors", "rank_00001-round1.safetensors"]
    assert c.committed_steps() == [10, 20]


def test_a_marker_that_cannot_go_back_leaves_latest_and_the_fallback_stands(tmp_path, monkeypatch):
    """The storage refuses the marker's rollback: every rank still falls back (the restore
    does not depend on it) and ``latest`` stays where the storage says."""
    storage = PosixStorage(str(tmp_path))
    c = coordinator(tmp_path)
    for step in (10, 20):
        for r in (0, 1):
            shard(c, step=step, rank=r, round_index=0, file=f"rank_0000{r}-round0.safetensors")

    def refuse(step):
        raise OSError("read-only file system")

    monkeypatch.setattr(c.storage, "commit", refuse)
    [plan(c, round_index=1, rank=r, memory=[]) for r in (0, 1)]
    verify(c, round_index=1, rank=0, step=20, ok=True)
    assert verify(c, round_index=1, rank=1, step=20, ok=False, error="torn").step == 10
    assert c.latest == 20 and storage.latest_step() == 20


def test_the_same_steps_rule(tmp_path):
    """A rank that goes past a step another rank saved for storage, without saving it,
    breaks the rule; a rank that is merely behind does not."""
    c = coordinator(tmp_path)
    c.note_saves(0, 0, [5])
    c.note_progress(0, 1, 5)
    assert c.misuse(0) is None  # rank 1 reported step 5 and will save it next
    c.note_progress(0, 1, 6)
    assert "rank(s) [1] went past step 5" in c.misuse(0)
    assert c.misuse(1) is None


def test_a_rank_hosted_again_after_a_scale_change_is_persisted(job_id, tmp_path):
    """The node hosts rank 1, then not (scale down: its segments go), then again (scale
    up: new segments, a new sequence): its new snapshots are persisted, nothing of the old
    slots skips them."""
    saver = CheckpointSaver(job_id=job_id, node_id=0, storage=PosixStorage(str(tmp_path)),
                            report_shard=no_commit, report_error=lambda error: None)
    try:
        saver.set_ranks([0, 1])
        first = MemorySnapshots(job_id=job_id, node_id=0, rank=1, round_index=0)
        for step in range(1, 6):
            first.save(layout(step, 1.0, rank=1, world=2), step=step, world_size=2, persist=True)
            assert saver.persist_due() == 1
        first.close()
        saver.set_ranks([0])  # scale down: rank 1 lives elsewhere now
        saver.set_ranks([0, 1])  # scale up: rank 1 is back here, with a fresh worker
        again = MemorySnapshots(job_id=job_id, node_id=0, rank=1, round_index=2)
        again.save(layout(7, 2.0, rank=1, world=2), step=7, world_size=2, persist=True)
        assert saver.persist_due() == 1
        assert (tmp_path / shard_path(7, 1, 2)).exists()
        again.close()
    finally:
        saver.stop(timeout_s=5)


def saver_above(job_id: str, tmp_path, *, committed: int) -> tuple[PosixStorage, CheckpointSaver, list[int]]:
    """A storage whose marker says ``committed``, a saver on it, and the steps it reports durable."""
    storage = PosixStorage(str(tmp_path))
    storage.commit(committed)
    reports: list[int] = []
    saver = CheckpointSaver(job_id=job_id, node_id=0, storage=storage,
                            report_shard=lambda s: reports.append(s.step) or ShardAnswer(),
                            report_error=lambda error: None)
    return storage, saver, reports


def test_the_saver_writes_steps_below_a_commit_whose_marker_went_back(job_id, tmp_path):
    """The saver started when the marker said 20. A restore then found 19 and 20 damaged
    and the master moved the marker back to 18: the re-trained steps 19 and 20, flagged for
    persistence, are written (not skipped as "at or below the commit"). A flagged snapshot
    still at or below the marker is covered by a commit: its slot is freed, not kept
    waiting for a persist that never comes (a save would wait for a free slot)."""
    storage, saver, reports = saver_above(job_id, tmp_path, committed=20)
    snaps = MemorySnapshots(job_id=job_id, node_id=0, rank=0, round_index=1, wait_timeout_s=0.5)
    try:
        saver.set_ranks([0])
        assert saver.committed == 20
        storage.commit(18)  # the master's rollback
        snaps.save(layout(19, 1.0), step=19, world_size=1, persist=True)
        snaps.save(layout(20, 1.0), step=20, world_size=1, persist=True)
        assert saver.persist_due() == 2 and reports == [19, 20]
        assert saver.committed == 18
        assert (tmp_path / shard_path(19, 0, 1)).exists() and (tmp_path / shard_path(20, 0, 1)).exists()
        # a flagged snapshot at or below the commit (the marker did not move): no write, slot freed
        snaps.save(layout(17, 1.0), step=17, world_size=1, persist=True)
        snaps.save(layout(18, 1.0), step=18, world_size=1, persist=True)
        assert saver.persist_due() == 0 and reports == [19, 20]
        assert snaps.save(layout(21, 1.0), step=21, world_size=1, persist=True)  # found a free slot at once
        assert snaps.waited_s < 0.5
    finally:
        snaps.close()
        saver.stop(timeout_s=5)


def test_the_saver_thread_reads_the_marker_again_for_a_snapshot_it_has_not_seen(job_id, tmp_path, monkeypatch):
    """The background saver looked at the marker a moment ago (for step 15, covered by the
    commit 20). The marker then goes back to 10 and step 16 is flagged: its next scan reads
    the marker again for the new snapshot, without waiting for the periodic re-read (set to
    an hour here), and writes 16. (A saver that waited wrote the re-trained steps after
    newer ones, or not at all once a newer commit covered them.)"""
    import dlrover_core.checkpoint.saver as saver_module

    monkeypatch.setattr(saver_module, "_MARKER_RECHECK_S", 3600.0)
    storage, saver, reports = saver_above(job_id, tmp_path, committed=20)
    snaps = MemorySnapshots(job_id=job_id, node_id=0, rank=0, round_index=1, wait_timeout_s=5.0)

    def waiting() -> list[int]:
        return [h.step for slot in snaps.slots if (h := slot.header()) is not None and h.awaiting_persist]

    try:
        saver.set_ranks([0])
        saver.start()
        snaps.save(layout(15, 1.0), step=15, world_size=1, persist=True)
        wait_for(lambda: waiting() == [], 5, "step 15's slot to be freed (the commit 20 covers it)")
        assert reports == [] and saver.committed == 20
        storage.commit(10)  # a restore fell back to 10: the master moved the marker back
        snaps.save(layout(16, 1.0), step=16, world_size=1, persist=True)
        wait_for(lambda: reports == [16], 5, "step 16 to be written")
        assert saver.committed == 10
        assert (tmp_path / shard_path(16, 0, 1)).exists()
    finally:
        snaps.close()
        saver.stop(timeout_s=5)


def test_a_marker_read_that_hangs_does_not_hold_up_the_saver(job_id, tmp_path, monkeypatch):
    """On a stuck mount the marker read never returns: the saver gives up on it after a
    bound (its loop also reports stuck writes) and frees nothing it cannot prove committed."""
    import dlrover_core.checkpoint.saver as saver_module

    storage = PosixStorage(str(tmp_path))
    storage.commit(20)
    saver = CheckpointSaver(job_id=job_id, node_id=0, storage=storage, report_shard=no_commit,
                            report_error=lambda error: None)
    snaps = MemorySnapshots(job_id=job_id, node_id=0, rank=0, round_index=1)
    stuck = threading.Event()
    monkeypatch.setattr(saver_module, "_MARKER_READ_TIMEOUT_S", 0.2)
    monkeypatch.setattr(storage, "latest_step", lambda: stuck.wait(30) and 20)
    try:
        saver.set_ranks([0])
        snaps.save(layout(19, 1.0), step=19, world_size=1, persist=True)
        t0 = time.monotonic()
        assert saver.persist_due() == 0
        assert time.monotonic() - t0 < 2
        waiting = [h.step for slot in snaps.slots if (h := slot.header()) is not None and h.awaiting_persist]
        assert waiting == [19]  # not freed: the commit could not be read
    finally:
        stuck.set()
        snaps.close()
        saver.stop(timeout_s=5)


def test_the_saver_notices_a_segment_recreated_under_the_same_name(job_id, tmp_path):
    """The saver holds a rank's slot open; the segment is removed and made anew under the
    same name (another owner): the saver drops the file it held and persists what the new
    one holds, never the old file's snapshot."""
    from dlrover_core.checkpoint.shm import SHM_DIR, segment_name

    saver = CheckpointSaver(job_id=job_id, node_id=0, storage=PosixStorage(str(tmp_path)),
                            report_shard=no_commit, report_error=lambda error: None)
    try:
        saver.set_ranks([0])
        old = MemorySnapshots(job_id=job_id, node_id=0, rank=0, round_index=0)
        old.save(layout(3, 1.0), step=3, world_size=1, persist=False)
        assert saver.persist_due() == 0  # the saver has opened the slots now
        old.save(layout(4, 1.0), step=4, world_size=1, persist=True)
        for index in range(2):
            (SHM_DIR / segment_name(job_id, 0, 0, index)).unlink()
        new = MemorySnapshots(job_id=job_id, node_id=0, rank=0, round_index=5)
        new.save(layout(9, 2.0), step=9, world_size=1, persist=True)
        assert saver.persist_due() == 1
        assert (tmp_path / shard_path(9, 0, 5)).exists() and not (tmp_path / shard_path(4, 0, 0)).exists()
        old.close()
        new.close()
    finally:
        saver.stop(timeout_s=5)


@pytest.mark.parametrize(("held", "source", "why"), [
    # every rank holds step 22 in memory: from memory, nothing to explain
    ({0: [[21, 1], [22, 1]], 1: [[22, 1]]}, "memory", ""),
    # a first start of the round: nobody holds anything, storage with no reason to give
    ({0: [], 1: []}, "storage", ""),
    # a lost node's rank without a replica
    ({0: [[21, 1], [22, 1]], 1: []}, "storage", "rank(s) 1 hold no snapshot in memory"),
    # the replacement's replica (from its buddy) lags behind the survivor's two slots
    ({0: [[24, 1], [25, 1]], 1: [[21, 1], [22, 1]]}, "storage", "no step is in every rank's memory (rank 0: [24, 25]; rank 1: [21, 22])"),
    # memory older than the commit
    ({0: [[15, 1]], 1: [[15, 1]]}, "storage", "the newest step in every rank's memory (15) is older than the committed step 20"),
])
def test_a_restore_from_storage_says_why_memory_could_not_serve(tmp_path, held, source, why):
    """Issue 28: where ranks held snapshots but the restore reads storage, the decision says
    why (``CheckpointCoordinator.restore_why``, the ``restore_decided`` event's ``why``,
    ``FailureRecord.restored_why``)."""
    events = []
    _, c = committed_10_and_20(tmp_path, lambda kind, **fields: events.append(fields))
    answers = [plan(c, round_index=1, rank=r, memory=m) for r, m in held.items()]
    assert answers[-1].source == source
    assert why in c.restore_why and bool(why) == bool(c.restore_why), c.restore_why
    assert events[-1].get("why", "") == c.restore_why
