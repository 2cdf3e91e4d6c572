"""No checkpoint is lost, mixed or silently skipped (issue 11): real jobs with slow, stuck
and damaged storage, and scripts that break the checkpoint rules.

Each test turns one of the failing inputs found by trying the product into a real run:
several workers per node persisting back to back on a slow disk; a shard write that never
returns; a damaged newest commit; saves on some ranks only; a loop that ignores what
``load()`` restored; an unwritable checkpoint directory.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from helpers import SCRIPTS, check_committed_steps, explain, job_events, use_flaky_storage

from dlrover_core import Checkpoint, Failure, Job, JobState, Nodes
from dlrover_core.errors import JobSpecError
from dlrover_core.storage.posix import PosixStorage

pytestmark = pytest.mark.slow


def ckpt_job(tmp: Path, name: str, *, args=(), nodes=1, nproc=1, storage="posix", persist_every=10,
             persist_timeout_s=600.0, keep_last=100, failure=None, ck: Path | None = None) -> Job:
    return Job(
        name=name, entrypoint=str(SCRIPTS / "ckpt_train.py"), args=list(args),
        nodes=Nodes(min=nodes, max=nodes, nproc_per_node=nproc), accelerator="cpu",
        checkpoint=Checkpoint(dir=str(ck if ck is not None else tmp / "ck"), storage=storage, memory_every_steps=1,
                              persist_every_steps=persist_every, keep_last=keep_last,
                              persist_timeout_s=persist_timeout_s),
        failure=failure or Failure(max_restarts=0), log_dir=str(tmp / "runs"),
    )


@pytest.mark.timeout(240)
def test_back_to_back_persists_on_a_slow_disk_commit_every_step(tmp_path, monkeypatch):
    """2 workers on one node, a persist every step, shard writes of 0.3 s (slower than a
    step): every requested step is persisted by both ranks and committed, in order; the
    final forced save is `latest`. (Before: each rank dropped different steps, nothing was
    committed, and the job still SUCCEEDED.)"""
    use_flaky_storage(tmp_path, monkeypatch, delay_s=0.3)
    job = ckpt_job(tmp_path, "burst", args=["--steps", "16", "--force-last"], nproc=2, storage="flaky",
                   persist_every=1)
    result = job.run(progress=False)
    assert result.state == JobState.SUCCEEDED, result.reason
    assert PosixStorage(str(tmp_path / "ck")).latest_step() == 15
    committed = [e["step"] for e in job_events(result) if e["kind"] == "checkpoint_committed"]
    assert committed == list(range(16))
    assert check_committed_steps(tmp_path / "ck") == list(range(16))
    assert result.checkpoint_stall_s > 0  # the backpressure is counted, not hidden
    assert any(e["kind"] == "checkpoint_backpressure" for e in job_events(result))


@pytest.mark.timeout(180)
def test_a_stuck_storage_write_fails_the_job_naming_it_and_blames_no_node(tmp_path, monkeypatch):
    """Shard writes of steps >= 20 never return (a hung mount). The agents keep heartbeating
    (a heartbeat timeout shorter than the stall), the final flush is bounded by
    checkpoint.persist_timeout_s, and the job ends FAILED with a reason naming the storage
    and the step; no node is lost, excluded or relaunched, no restart is spent, and the
    last commit stays at 10."""
    use_flaky_storage(tmp_path, monkeypatch, hang_from_step=20)
    job = ckpt_job(tmp_path, "stuck", args=["--steps", "30", "--step-sleep", "0.05"], nodes=2, storage="flaky",
                   persist_every=10, persist_timeout_s=6.0,
                   failure=Failure(max_restarts=3, heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0))
    t0 = time.monotonic()
    result = job.run(progress=False)
    assert time.monotonic() - t0 < 90
    assert result.state == JobState.FAILED
    assert "step 20" in result.reason and str(tmp_path / "ck") in result.reason and "not durable" in result.reason
    assert result.restarts == 0
    # (a worker whose peer was stopped at the end may still report its broken collective: the
    # master records it with "none: the job had already ended", blaming nothing)
    kinds = [e["kind"] for e in job_events(result)
             if not str(e.get("action", "")).startswith("none: the job had already ended")]
    assert not {"node_lost", "node_excluded", "node_relaunched", "worker_failed"} & set(kinds), kinds
    assert PosixStorage(str(tmp_path / "ck")).latest_step() == 10


@pytest.mark.timeout(180)
def test_a_final_checkpoint_that_cannot_be_written_fails_the_job_naming_the_error(tmp_path, monkeypatch):
    """Shard writes of steps >= 20 fail (EIO, as a full or broken disk does): training goes
    on, the failures are events, but the job ends FAILED — not SUCCEEDED without its final
    checkpoint — with a reason naming the storage, the step and the error."""
    use_flaky_storage(tmp_path, monkeypatch, fail_from_step=20)
    result = ckpt_job(tmp_path, "enospc", args=["--steps", "30", "--force-last"], nodes=2, storage="flaky",
                      failure=Failure(max_restarts=2)).run(progress=False)
    assert result.state == JobState.FAILED
    assert "step 29" in result.reason and str(tmp_path / "ck") in result.reason
    assert "Input/output error" in result.reason
    assert result.restarts == 0 and result.final_step == 29
    failed = [e for e in job_events(result) if e["kind"] == "checkpoint_persist_failed"]
    assert {e["step"] for e in failed} >= {20, 29}
    assert PosixStorage(str(tmp_path / "ck")).latest_step() == 10


@pytest.mark.timeout(120)
def test_an_unwritable_checkpoint_dir_is_refused_before_anything_starts(tmp_path):
    """Checkpoint(dir=...) naming a place that cannot be written is a JobSpecError naming
    the field, from run(), before a process starts."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the checkpoint directory should be")
    job = ckpt_job(tmp_path, "unwritable", ck=blocker / "ck")
    with pytest.raises(JobSpecError) as err:
        job.run(progress=False)
    assert err.value.field == "checkpoint.dir" and "writable" in str(err.value)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


@pytest.mark.timeout(240)
def test_a_damaged_newest_commit_falls_back_to_the_previous_intact_one(tmp_path):
    """A first job commits steps 0, 10 and 20; one shard of step 20 is then truncated. A
    second job on the same directory: every rank agrees to load step 10 (the damage is
    logged with its reason), no restart is spent, and training goes on to the end."""
    first = ckpt_job(tmp_path, "torn1", args=["--steps", "21"], nodes=2).run(progress=False)
    assert first.state == JobState.SUCCEEDED, first.reason
    ck = tmp_path / "ck"
    assert PosixStorage(str(ck)).latest_step() == 20
    meta = json.loads((ck / "step_0000000020" / "checkpoint.json").read_text())
    victim = ck / "step_0000000020" / meta["shards"]["1"]["file"]
    victim.write_bytes(victim.read_bytes()[:100])  # a torn copy
    second = ckpt_job(tmp_path, "torn2", args=["--steps", "35"], nodes=2,
                      failure=Failure(max_restarts=3)).run(progress=False)
    assert second.state == JobState.SUCCEEDED, explain(second)
    assert second.restarts == 0, explain(second)
    events = job_events(second)
    damaged = [e for e in events if e["kind"] == "checkpoint_damaged"]
    assert damaged and damaged[0]["step"] == 20 and damaged[0]["fallback"] == 10
    assert "rank 1" in damaged[0]["reason"] and "torn" in damaged[0]["reason"]
    restored = {e["step"] for e in events if e["kind"] == "checkpoint_restored"}
    assert restored == {10}
    # the steps trained again are committed again: step 20's commit is whole now
    assert [e["step"] for e in events if e["kind"] == "checkpoint_committed"] == [20, 30]
    assert PosixStorage(str(ck)).latest_step() == 30
    assert check_committed_steps(ck) == [0, 10, 20, 30]


@pytest.mark.timeout(240)
def test_two_damaged_commits_with_a_persist_every_step_do_not_stall_the_saves(tmp_path):
    """Steps 0..20 committed, one at every step; rank 1's shards of 19 and 20 are then
    truncated. The next job falls back to 18, and the master moves the `latest` marker back
    with it: the re-trained 19 and 20 are persisted and committed again. (Before: the savers
    skipped them as "at or below the commit", their snapshots kept both slots, and the next
    save waited checkpoint.persist_timeout_s for a free slot and failed, round after round.)
    A third job starts from the newest commit without finding anything damaged."""
    first = ckpt_job(tmp_path, "twice1", args=["--steps", "21"], nodes=2, persist_every=1).run(progress=False)
    assert first.state == JobState.SUCCEEDED, explain(first)
    ck = tmp_path / "ck"
    for step in (19, 20):
        meta = json.loads((ck / f"step_{step:010d}" / "checkpoint.json").read_text())
        victim = ck / f"step_{step:010d}" / meta["shards"]["1"]["file"]
        victim.write_bytes(victim.read_bytes()[:100])
    second = ckpt_job(tmp_path, "twice2", args=["--steps", "26"], nodes=2, persist_every=1, persist_timeout_s=10.0,
                      failure=Failure(max_restarts=1)).run(progress=False)
    assert second.state == JobState.SUCCEEDED and second.restarts == 0, explain(second)
    events = job_events(second)
    assert [e["step"] for e in events if e["kind"] == "checkpoint_damaged"] == [20, 19]
    assert {e["step"] for e in events if e["kind"] == "checkpoint_restored"} == {18}
    assert [e["step"] for e in events if e["kind"] == "checkpoint_committed"] == list(range(19, 26))
    assert check_committed_steps(ck) == list(range(26))
    third = ckpt_job(tmp_path, "twice3", args=["--steps", "28"], nodes=2, persist_every=1).run(progress=False)
    assert third.state == JobState.SUCCEEDED, explain(third)
    events = job_events(third)
    assert not [e for e in events if e["kind"] == "checkpoint_damaged"]
    assert {e["step"] for e in events if e["kind"] == "checkpoint_restored"} == {25}


@pytest.mark.timeout(180)
def test_saving_on_some_ranks_only_fails_at_once_naming_the_rule(tmp_path):
    """A script that saves on rank 0 only gets a FAILED job at once (not a SUCCEEDED one
    that committed nothing), with a reason that names the rule."""
    result = ckpt_job(tmp_path, "rank0only", args=["--steps", "200", "--step-sleep", "0.05", "--save-rank0-only"],
                      nodes=2, persist_every=5).run(progress=False)
    assert result.state == JobState.FAILED
    assert "every rank must call Checkpointer.save() for the same steps" in result.reason
    assert "rank(s) [1]" in result.reason
    assert result.final_step < 100  # at once, not at the end


@pytest.mark.timeout(180)
def test_a_loop_that_ignores_the_restored_step_is_an_error(tmp_path):
    """After a restore, a loop that reports steps from 0 again (replaying trained steps
    and counting them as productive) fails with an error that names the rule."""
    first = ckpt_job(tmp_path, "replay1", args=["--steps", "12"], nproc=2).run(progress=False)
    assert first.state == JobState.SUCCEEDED, first.reason
    result = ckpt_job(tmp_path, "replay2", args=["--steps", "30", "--ignore-restore"], nproc=2,
                      failure=Failure(max_restarts=2)).run(progress=False)
    assert result.state == JobState.FAILED
    assert "restored.step + 1" in result.reason and "restored step 10" in result.reason
    assert result.restarts == 0  # every rank raised it before its first step: stopped at once, no node blamed


@pytest.mark.timeout(240)
def test_a_relative_checkpoint_dir_loads_at_another_world_size(tmp_path, monkeypatch):
    """Saved by 2 workers under a relative Checkpoint(dir=...), resumed by 1 (DCP
    resharding): the restore finds the files."""
    monkeypatch.chdir(tmp_path)
    first = ckpt_job(tmp_path, "rel2", args=["--steps", "11"], nproc=2, ck=Path("ckrel")).run(progress=False)
    assert first.state == JobState.SUCCEEDED, first.reason
    second = ckpt_job(tmp_path, "rel1", args=["--steps", "15"], nproc=1, ck=Path("ckrel")).run(progress=False)
    assert second.state == JobState.SUCCEEDED, second.reason
    assert {e["step"] for e in job_events(second) if e["kind"] == "checkpoint_restored"} == {10}


def _segments(job_id: str, node: int) -> set[str]:
    from helpers import shm_entries

    return {n for n in shm_entries() if n.startswith(f"dlrover-{job_id}-n{node}-")}


@pytest.mark.timeout(300)
def test_a_replaced_agent_that_comes_back_touches_nothing_of_its_replacement(tmp_path):
    """Node 1's agent is frozen (SIGSTOP) past the heartbeat timeout: the master relaunches
    the node. When the old agent resumes (SIGCONT) it is fenced: it exits without touching
    its replacement's workers or shared memory, and the new agent goes on persisting and
    committing every rank to the end."""
    import json
    import os
    import signal

    import psutil

    run = ckpt_job(tmp_path, "fence", args=["--steps", "160", "--step-sleep", "0.05", "--noise", "--force-last"],
                   nodes=2, persist_every=10,
                   failure=Failure(max_restarts=3, heartbeat_interval_s=0.5, heartbeat_timeout_s=3.0,
                                   stop_grace_s=2)).submit()
    handle = Path(run.handle.log_dir) / "handle.json"
    deadline = time.monotonic() + 90
    while run.status().step < 20:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    old = psutil.Process(json.loads(handle.read_text())["agents"]["node-1"])
    os.kill(old.pid, signal.SIGSTOP)
    try:
        # the master declares node 1 lost and relaunches it; the new agent's workers train
        deadline = time.monotonic() + 60
        while True:
            relaunched = json.loads(handle.read_text()).get("relaunched", {})
            new_agents = [psutil.Process(pid) for key, pid in relaunched.items() if key.startswith("node-1:")]
            status = run.status()
            if new_agents and status.round >= 1 and len(status.worker_pids) == 2:
                break
            assert time.monotonic() < deadline, "node 1 was not relaunched"
            time.sleep(0.2)
        step_then = run.status().step
        deadline = time.monotonic() + 60
        while run.status().step < step_then + 15:  # the new round commits a step or more
            assert time.monotonic() < deadline
            time.sleep(0.1)
        new_agent = new_agents[0]
        new_workers = set(run.status().worker_pids.values())  # (the new round's, the new agent's among them)
        assert len(new_workers) == 2, new_workers
        segments = _segments(run.job_id, 1)
        assert segments, "the new agent's workers hold snapshots"
    finally:
        os.kill(old.pid, signal.SIGCONT)
    old.wait(timeout=60)  # fenced: it stops by itself
    assert run.status().state == JobState.RUNNING
    assert all(psutil.pid_exists(pid) for pid in new_workers | {new_agent.pid})
    assert segments <= _segments(run.job_id, 1), "the old agent removed its replacement's segments"
    result = run.wait(progress=False, timeout_s=180)
    assert result.state == JobState.SUCCEEDED, result.reason
    log_text = "".join(p.read_text() for p in Path(result.log_dir).glob("node_1*.log"))
    assert "agent_fenced" in log_text
    assert PosixStorage(str(tmp_path / "ck")).latest_step() == 159
    check_committed_steps(tmp_path / "ck")
