"""Sharded training recovers live (docs/design.md §5a): an FSDP2 job whose worker is
SIGKILLed keeps its surviving processes; the replacement takes the dead rank's place and
shard, loads its shard from its node's memory snapshot (never from storage), every rank
resumes after one common step, and the job ends with the parameters and optimizer state of
a run without the kill, bit for bit. Real processes, real gloo, a real signal."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from helpers import SCRIPTS, job_processes, kill_node, wait_for

from dlrover_core import Checkpoint, Failure, Job, JobState, Nodes, Parallel

# one xdist worker runs the module, so each failure-free reference run below is made once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("sharded_live")]


def sharded_job(tmp: Path, name: str, *, steps: int = 40, sleep_s: float = 0.05, nodes: int = 1,
                extra: tuple[str, ...] = (), parallel: tuple = ("fsdp",), ranks: int = 2, memory_every_steps: int = 1,
                replicas: int | None = None, persist_every_steps: int = 0) -> Job:
    return Job(
        name=name, entrypoint=str(SCRIPTS / "sharded_live_train.py"),
        args=["--steps", str(steps), "--step-sleep", str(sleep_s), "--out", str(tmp / name), *extra],
        nodes=Nodes(min=nodes, max=nodes, nproc_per_node=ranks // nodes), accelerator="cpu", parallel=Parallel(list(parallel)),
        checkpoint=Checkpoint(dir=str(tmp / name / "ck"), persist_every_steps=persist_every_steps,
                              memory_every_steps=memory_every_steps,
                              replicas=replicas),
        failure=Failure(max_restarts=3, stop_grace_s=2, heartbeat_timeout_s=3.0),
        log_dir=str(tmp / "runs"),
    )


def restored_from(result) -> list[tuple[str, int]]:
    """``(source, step)`` of every worker's ``checkpoint_restored`` (its log line: a live
    replacement's restore is not a job event)."""
    import re

    text = "".join(p.read_text() for p in Path(result.log_dir).glob("node_*.log"))
    return [(m.group(2), int(m.group(3))) for m in re.finditer(r"checkpoint_restored .*?rank=(\d+) source=(\w+) step=(\d+)", text)]


def storage_bytes_read(result) -> int:
    """Bytes every worker's ``checkpoint_restored`` says it read from checkpoint storage."""
    import re

    text = "".join(p.read_text() for p in Path(result.log_dir).glob("node_*.log"))
    counts = [int(n) for n in re.findall(r"checkpoint_restored .*?storage_bytes=(\d+)", text)]
    assert counts, "no restore logged"
    return sum(counts)


def steps_by_pid(out: Path) -> dict[int, list[dict]]:
    return {int(p.stem.split("_")[1]): [json.loads(line) for line in p.read_text().splitlines()]
            for p in out.glob("steps_*.jsonl")}


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory):
    """``clean_run(steps, nodes=1, ranks=2, parallel=("fsdp",)) -> Path``: the output
    directory of that job run without a failure (``final.json``, ``steps_*.jsonl``), each
    configuration run once per module. The training does not depend on what the tests vary
    besides (step sleep, snapshot interval, replicas, persist interval): the parameters of a
    failure-free run are those of any of them."""
    done: dict[tuple, Path] = {}

    def run(steps: int, nodes: int = 1, ranks: int = 2, parallel: tuple = ("fsdp",)) -> Path:
        key = (steps, nodes, ranks, repr(parallel))
        if key not in done:
            tmp = tmp_path_factory.mktemp("clean")
            result = sharded_job(tmp, "clean", steps=steps, sleep_s=0.0, nodes=nodes, ranks=ranks,
                                 parallel=parallel).run(progress=False)
            assert result.state == JobState.SUCCEEDED, result.reason
            done[key] = tmp / "clean"
        return done[key]

    return run


@pytest.fixture(scope="module")
def clean_digest(clean_run):
    """``digest(parallel)``: the final state digest of the 60-step 2-rank job without a
    failure."""
    return lambda parallel: json.loads((clean_run(60, parallel=parallel) / "final.json").read_text())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("parallel", [("fsdp",), ("auto",)], ids=["fsdp", "auto-ddp"])
def test_a_killed_fsdp_worker_is_replaced_live_from_memory_and_the_result_is_bit_identical(tmp_path, parallel,
                                                                                           clean_digest):
    """``auto`` picks ddp for this small model: a strategy the spec cannot know to be
    replicated, so the world is a sharded one, with DDP on its reconfigurable groups."""
    run = sharded_job(tmp_path, "killed", steps=60, parallel=parallel).submit()
    wait_for(lambda: run.status().step >= 12, 90, "step 12")
    pids = wait_for(lambda: run.status().worker_pids if len(run.status().worker_pids) == 2 else None, 30, "both ranks")
    survivor, victim = pids[0], pids[1]
    os.kill(victim, signal.SIGKILL)
    result = run.wait(progress=False, timeout_s=150)
    assert result.state == JobState.SUCCEEDED, result.reason
    (failure,) = result.failures
    assert failure.recovery == "live" and failure.signal == "SIGKILL", failure
    out = tmp_path / "killed"
    by_pid = steps_by_pid(out)
    assert survivor in by_pid and victim in by_pid
    finals = {json.loads(p.read_text())["pid"]: json.loads(p.read_text()) for p in out.glob("final_*.json")}
    assert set(finals) - {victim} and survivor in finals, "the survivor's process trained to the end"
    (replacement,) = set(finals) - {survivor}
    assert finals[replacement]["rank"] == 1
    resumed_after = finals[replacement]["start"] - 1
    assert resumed_after >= 0, "the replacement restored a step from memory"
    killed_at = max(r["step"] for r in by_pid[victim])
    assert killed_at - 1 <= resumed_after <= killed_at, (resumed_after, killed_at)
    # the survivor never restarted: one process from step 0 to the last
    survivor_steps = [r["step"] for r in by_pid[survivor]]
    assert survivor_steps[0] == 0 and survivor_steps[-1] == 59
    assert restored_from(result) == [("memory", resumed_after)], "the replacement's shard came from memory"
    assert storage_bytes_read(result) == 0
    # bit for bit the parameters and optimizer state of the same job without the kill
    assert json.loads((out / "final.json").read_text()) == clean_digest(parallel)
    assert job_processes(result.job_id) == []


@pytest.mark.timeout(300)
def test_a_lost_node_of_an_fsdp_job_rejoins_live_from_its_buddys_replica(tmp_path, clean_run):
    """A 2-node FSDP2 job loses node 1 as a machine dies (its agent and worker SIGKILLed,
    its /dev/shm segments removed). The survivor on node 0 keeps its process and waits; the
    relaunched node fetches its rank's replica from node 0's memory, its worker joins the
    running world in rank 1's place and loads its shard from that replica; the job ends
    bit-identical to a run without the failure. The machine dies at a random moment: the
    replica pins keep every rank's snapshots within reach of the replicas, whatever the
    buddy's lag (``tests/test_replica_pins.py``)."""
    import random

    run = sharded_job(tmp_path, "lost", steps=40, sleep_s=0.1, nodes=2).submit()
    wait_for(lambda: run.status().step >= 10, 120, "step 10")
    time.sleep(random.Random(28).uniform(0.0, 1.0))
    survivor = wait_for(lambda: run.status().worker_pids.get(0), 30, "rank 0")
    kill_node(run, 1)
    result = run.wait(progress=False, timeout_s=200)
    assert result.state == JobState.SUCCEEDED, result.reason
    assert all(f.recovery == "live" for f in result.failures), [(f.recovery, f.action) for f in result.failures]
    out = tmp_path / "lost"
    finals = {json.loads(p.read_text())["pid"]: json.loads(p.read_text()) for p in out.glob("final_*.json")}
    assert survivor in finals and finals[survivor]["start"] == 0, "the survivor trained from step 0 to the end"
    assert "replicas_fetched" in (Path(result.log_dir) / "node_1.log").read_text()
    (restore,) = restored_from(result)
    assert restore[0] == "memory" and restore[1] == finals[next(p for p in finals if p != survivor)]["start"] - 1
    assert storage_bytes_read(result) == 0, "the lost node read its shard from storage"
    assert json.loads((out / "final.json").read_text()) == json.loads((clean_run(40, nodes=2) / "final.json").read_text())
    assert job_processes(result.job_id) == []


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("seed", "when"), [(1, "starting"), (2, "asked")])
def test_a_replacement_killed_while_it_joins_is_replaced_again_and_the_world_goes_on(tmp_path, seed, when,
                                                                                      clean_digest):
    """Seeded fault schedule: rank 1 is SIGKILLed at a random step; its replacement is
    SIGKILLed too, a random moment after it starts (``starting``: importing, building, asking)
    or after it asked to join (``asked``: connecting its groups while the survivor waits in
    its reconnection). The survivor's
    reconnection gives up on it within ``reconfigurable.CONNECT_TIMEOUT_S`` and asks again;
    the next replacement joins; the survivor's process trains to the end and the result is
    bit-identical to a run without failures."""
    import random

    rnd = random.Random(seed)
    run = sharded_job(tmp_path, "twice", steps=60).submit()
    wait_for(lambda: run.status().step >= rnd.randint(8, 20), 90, "the first kill's step")
    pids = wait_for(lambda: run.status().worker_pids if len(run.status().worker_pids) == 2 else None, 30, "both ranks")
    survivor, victim = pids[0], pids[1]
    os.kill(victim, signal.SIGKILL)
    node_log = Path(run.handle.log_dir) / "node_0.log"

    def replacement() -> int | None:
        for line in node_log.read_text().splitlines():
            if "worker_replaced" in line and f"old_pid={victim}" in line:
                return int(line.split(" pid=", 1)[1].split()[0])
        return None

    second = wait_for(replacement, 60, "a replacement", poll_s=0.02)  # (killed while it starts, below)
    if when == "asked":  # it asked to join: the world forms now, the survivor reconnects its groups
        wait_for(lambda: "live_join_waiting" in node_log.read_text(), 60, "the replacement's ask", poll_s=0.02)
        time.sleep(rnd.uniform(0.0, 0.3))
    else:  # anywhere from its start to its join
        time.sleep(rnd.uniform(0.0, 1.5))
    with contextlib.suppress(ProcessLookupError):
        os.kill(second, signal.SIGKILL)
    result = run.wait(progress=False, timeout_s=200)
    assert result.state == JobState.SUCCEEDED, result.reason
    assert all(f.recovery == "live" for f in result.failures), [(f.recovery, f.action) for f in result.failures]
    out = tmp_path / "twice"
    finals = {json.loads(p.read_text())["pid"]: json.loads(p.read_text()) for p in out.glob("final_*.json")}
    assert survivor in finals and finals[survivor]["start"] == 0
    assert second not in finals and victim not in finals
    assert json.loads((out / "final.json").read_text()) == clean_digest(("fsdp",))
    assert job_processes(result.job_id) == []


HSDP = (("mesh", [("data", 2), ("replicate", 2)]), "fsdp")


@pytest.mark.timeout(300)
def test_a_killed_hsdp_worker_is_replaced_live_and_the_result_is_bit_identical(tmp_path, clean_run):
    """A mesh job (data x replicate: HSDP, 4 ranks on 2 nodes; rank 3 shares its shard with
    rank 1 and its replica group with rank 2): rank 3 is SIGKILLed. The other three keep
    their processes, the mesh's sub-groups reconnect in place, the replacement loads its
    shard from its node's memory (or from rank 1), and the job ends bit-identical to a run
    without the kill."""
    run = sharded_job(tmp_path, "killed", steps=30, nodes=2, ranks=4, parallel=HSDP).submit()
    wait_for(lambda: run.status().step >= 8, 120, "step 8")
    pids = wait_for(lambda: run.status().worker_pids if len(run.status().worker_pids) == 4 else None, 30, "4 ranks")
    victim = pids[3]
    survivors = {pids[r] for r in range(3)}
    os.kill(victim, signal.SIGKILL)
    result = run.wait(progress=False, timeout_s=200)
    assert result.state == JobState.SUCCEEDED, result.reason
    (failure,) = result.failures
    assert failure.recovery == "live", failure
    out = tmp_path / "killed"
    finals = {json.loads(p.read_text())["pid"]: json.loads(p.read_text()) for p in out.glob("final_*.json")}
    assert survivors <= set(finals) and all(finals[p]["start"] == 0 for p in survivors), "a survivor restarted"
    (replacement,) = set(finals) - survivors
    assert finals[replacement]["rank"] == 3 and finals[replacement]["start"] >= 1
    # its node's snapshot of the survivors' step; or, killed between its update and its
    # snapshot, the same step from rank 1, which holds the same shard
    assert restored_from(result) in ([("memory", finals[replacement]["start"] - 1)],
                                     [("peer", finals[replacement]["start"] - 1)])
    assert storage_bytes_read(result) == 0
    clean = clean_run(30, nodes=2, ranks=4, parallel=HSDP)
    shards = {(r["rank"], r["step"]): r["shard"] for rows in steps_by_pid(clean).values() for r in rows}
    assert shards[0, 5] == shards[2, 5] != shards[1, 5] == shards[3, 5], "HSDP: ranks 0 and 2 hold one shard"
    assert json.loads((out / "final.json").read_text()) == json.loads((clean / "final.json").read_text())
    assert job_processes(result.job_id) == []


def applied_steps(out: Path) -> dict[int, list[int]]:
    """Per rank, every step its processes logged as applied, in time order."""
    rows = sorted((r for rows in steps_by_pid(out).values() for r in rows), key=lambda r: r["t"])
    by_rank: dict[int, list[int]] = {}
    for r in rows:
        by_rank.setdefault(r["rank"], []).append(r["step"])
    return by_rank


@pytest.mark.timeout(300)
def test_an_hsdp_replacement_whose_snapshot_lags_takes_its_shard_from_its_replica_peer_with_no_rollback(tmp_path,
                                                                                                       clean_run):
    """HSDP (data x replicate, 4 ranks on 2 nodes) snapshotting rarely (step 0 only in this
    run): rank 3 is SIGKILLed at step 10 inside its backward, after its last reduce-scatter
    and before its last all-reduce with rank 1 (which holds the same shard). Ranks 0 and 2
    no longer need it to finish their backward, rank 1 does: the vote before the optimizer
    step keeps 0 and 2 from applying step 10, so every survivor holds step 9. Its node's
    memory holds only step 0, which would send every survivor back to step 0; instead rank
    1 sends the replacement its state of step 9. No survivor goes back or restarts, no step
    is trained twice, nothing is read from storage, and the job ends bit-identical to a run
    without the kill."""
    run = sharded_job(tmp_path, "lag", steps=30, nodes=2, ranks=4, parallel=HSDP, memory_every_steps=100,
                      extra=("--die-before-last-replicate-all-reduce", "3:10")).submit()
    pids = wait_for(lambda: run.status().worker_pids if len(run.status().worker_pids) == 4 else None, 120, "4 ranks")
    survivors = {pids[r] for r in range(3)}
    result = run.wait(progress=False, timeout_s=200)
    assert result.state == JobState.SUCCEEDED, result.reason
    (failure,) = result.failures
    assert failure.recovery == "live", failure
    out = tmp_path / "lag"
    finals = {json.loads(p.read_text())["pid"]: json.loads(p.read_text()) for p in out.glob("final_*.json")}
    assert survivors <= set(finals) and all(finals[p]["start"] == 0 for p in survivors), "a survivor restarted"
    (replacement,) = set(finals) - survivors
    resumed_after = finals[replacement]["start"] - 1
    assert resumed_after == 9
    assert restored_from(result) == [("peer", resumed_after)], "the replacement's shard came from its replica peer"
    assert storage_bytes_read(result) == 0
    # every step applied once: the survivors trained each step once, none twice; the killed
    # rank's process got no further than the survivors' step, and its replacement went on from it
    applied = applied_steps(out)
    for rank in range(3):
        assert applied[rank] == list(range(30)), f"rank {rank} applied {applied[rank]}"
    rows = steps_by_pid(out)
    (killed_pid,) = set(rows) - survivors - {replacement}
    killed = [r["step"] for r in rows[killed_pid]]
    assert killed == list(range(10)), killed  # (it died in step 10)
    assert [r["step"] for r in rows[replacement]] == list(range(resumed_after + 1, 30))
    logs = "".join(p.read_text() for p in Path(result.log_dir).glob("node_*.log"))
    assert "live_state_sent" in logs and "checkpoint_went_back" not in logs
    # it keeps what it received as its snapshot of that step, as if restored from memory (its
    # node's replicas are of a step every rank of the node holds)
    assert f"checkpoint_peer_state_kept rank=3 step={resumed_after}" in logs
    clean = clean_run(30, nodes=2, ranks=4, parallel=HSDP)
    assert json.loads((out / "final.json").read_text()) == json.loads((clean / "final.json").read_text())
    assert job_processes(result.job_id) == []


@pytest.mark.timeout(300)
def test_a_lost_node_of_an_hsdp_job_without_replicas_rejoins_live_from_the_other_replica_group(tmp_path, clean_run):
    """HSDP, 4 ranks on 2 nodes, ``Checkpoint(replicas=0)``: node 1 (ranks 2 and 3, one
    replica of each shard) dies as a machine does. No snapshot of its ranks survives
    anywhere, yet ranks 0 and 1 hold the same shards: they keep their processes and each
    sends its shard to the relaunched node's worker of its replica group. Nothing is read
    from storage, no step is trained twice, the result is bit-identical to a run without
    the failure."""
    run = sharded_job(tmp_path, "lost", steps=30, nodes=2, ranks=4, parallel=HSDP, replicas=0).submit()
    wait_for(lambda: run.status().step >= 8, 120, "step 8")
    pids = wait_for(lambda: run.status().worker_pids if len(run.status().worker_pids) == 4 else None, 30, "4 ranks")
    survivors = {pids[0], pids[1]}
    kill_node(run, 1)
    result = run.wait(progress=False, timeout_s=200)
    assert result.state == JobState.SUCCEEDED, result.reason
    assert result.failures and all(f.recovery == "live" for f in result.failures), [
        (f.recovery, f.action) for f in result.failures]
    out = tmp_path / "lost"
    finals = {json.loads(p.read_text())["pid"]: json.loads(p.read_text()) for p in out.glob("final_*.json")}
    assert survivors <= set(finals) and all(finals[p]["start"] == 0 for p in survivors), "a survivor restarted"
    new = {finals[p]["rank"]: finals[p]["start"] - 1 for p in set(finals) - survivors}
    assert set(new) == {2, 3} and len(set(new.values())) == 1, new
    (resumed_after,) = set(new.values())
    assert sorted(restored_from(result)) == [("peer", resumed_after)] * 2
    assert storage_bytes_read(result) == 0
    logs = "".join(p.read_text() for p in Path(result.log_dir).glob("node_*.log"))
    assert logs.count("checkpoint_peer_state_kept") == 2
    applied = applied_steps(out)
    assert applied[0] == applied[1] == list(range(30)), "a survivor trained a step twice"
    clean = clean_run(30, nodes=2, ranks=4, parallel=HSDP)
    assert json.loads((out / "final.json").read_text()) == json.loads((clean / "final.json").read_text())
    assert job_processes(result.job_id) == []


@pytest.mark.timeout(300)
def test_a_lost_node_of_an_fsdp_job_without_replicas_restarts_every_worker_from_storage_and_says_why(tmp_path,
                                                                                                     clean_run):
    """FSDP2 on 2 nodes with ``Checkpoint(replicas=0)``: node 1 dies as a machine does, and
    rank 1's shard survives nowhere in memory (no replica, no replica group). The survivor
    cannot go on live, so every worker restarts at once (one failure, one restart counted:
    the master knows at the loss, not when the relaunched node asks to join; its
    ``recovery`` and ``action`` say why), rank 1 reads its shard of the last commit from
    storage, and the job still ends bit-identical to a run without the failure (the steps since the commit are trained
    again on the same seeded batches)."""
    from dlrover_core.storage.posix import PosixStorage

    run = sharded_job(tmp_path, "lost", steps=40, sleep_s=0.1, nodes=2, replicas=0, persist_every_steps=5).submit()
    storage = PosixStorage(str(tmp_path / "lost" / "ck"))
    wait_for(lambda: run.status().step >= 12 and (storage.latest_step() or -1) >= 10, 120, "step 12, a commit")
    assert run.status().step < 35, "the job ran past the kill's window (a commit came too late)"
    kill_node(run, 1)
    result = run.wait(progress=False, timeout_s=200)
    assert result.state == JobState.SUCCEEDED, result.reason
    (failure,) = result.failures
    assert failure.recovery == "restart_all", (failure.recovery, failure.action)
    assert failure.kind == "node_lost" and failure.rank is None, failure
    assert "rank(s) 1 of a sharded world died with node 1" in failure.action, failure.action
    assert failure.restored_from == "storage" and failure.restored_step is not None and failure.restored_step >= 10
    restores = dict((int(rank), (source, int(step))) for rank, source, step in re.findall(
        r"checkpoint_restored .*?rank=(\d+) source=(\w+) step=(\d+)",
        "".join(p.read_text() for p in Path(result.log_dir).glob("node_*.log"))))
    assert restores[1][0] == "storage" and restores[1][1] >= 10, restores  # (a commit at step 10 or later)
    assert storage_bytes_read(result) > 0
    assert json.loads((tmp_path / "lost" / "final.json").read_text()) == json.loads(
        (clean_run(40, nodes=2) / "final.json").read_text())
    assert job_processes(result.job_id) == []


@pytest.mark.timeout(300)
def test_a_node_and_then_the_buddy_holding_its_replica_lost_restart_every_worker_from_storage(tmp_path, clean_run):
    """FSDP2 on 2 nodes with replicas (each node holds the other's): node 1 dies as a
    machine does, and half a second later node 0 — the buddy holding node 1's replica, and
    whose own replica was on node 1. No copy of rank 0's shard survives in memory, so the
    second loss restarts every worker at once, saying why; the restore reads the last commit
    (from storage where memory has nothing), and the job still ends bit-identical to a run
    without the failures."""
    from dlrover_core.storage.posix import PosixStorage

    run = sharded_job(tmp_path, "lost", steps=40, sleep_s=0.1, nodes=2, persist_every_steps=5).submit()
    storage = PosixStorage(str(tmp_path / "lost" / "ck"))
    wait_for(lambda: run.status().step >= 12 and (storage.latest_step() or -1) >= 10, 120, "step 12, a commit")
    assert run.status().step < 35, "the job ran past the kills' window (a commit came too late)"
    kill_node(run, 1)
    time.sleep(0.5)
    kill_node(run, 0)
    result = run.wait(progress=False, timeout_s=200)
    assert result.state == JobState.SUCCEEDED, result.reason
    lost = [f for f in result.failures if f.kind == "node_lost"]
    assert {f.node_id for f in lost} == {0, 1}, [(f.node_id, f.kind, f.action) for f in result.failures]
    assert result.failures[-1].recovery == "restart_all", [(f.recovery, f.action) for f in result.failures]
    assert any("no other node holds" in f.action or "not live" in f.action for f in result.failures[1:]), [
        f.action for f in result.failures]
    assert storage_bytes_read(result) > 0, "rank 0's shard survived nowhere in memory: it must come from storage"
    assert json.loads((tmp_path / "lost" / "final.json").read_text()) == json.loads(
        (clean_run(40, nodes=2) / "final.json").read_text())
    assert job_processes(result.job_id) == []


@pytest.mark.timeout(240)
def test_a_state_sharded_behind_the_specs_back_restarts_every_worker_and_says_why(tmp_path, clean_digest):
    """The Job says ddp (replicated) but the script shards through ``train.prepare(parallel=
    ["fsdp"])``: the replicated live path would shrink the world and hand the replacement
    another rank's shard. The workers tell the master when their loop starts; the kill
    restarts every worker, with the reason, and the result is still the clean run's."""
    run = sharded_job(tmp_path, "undeclared", steps=60, parallel=("ddp",),
                      extra=("--prepare-parallel", "fsdp")).submit()
    wait_for(lambda: run.status().step >= 8, 90, "step 8")
    pids = wait_for(lambda: run.status().worker_pids if len(run.status().worker_pids) == 2 else None, 30, "both ranks")
    os.kill(pids[1], signal.SIGKILL)
    result = run.wait(progress=False, timeout_s=150)
    assert result.state == JobState.SUCCEEDED, result.reason
    (failure,) = result.failures
    assert failure.recovery == "restart_all" and "sharded DTensor" in failure.action, failure
    assert json.loads((tmp_path / "undeclared" / "final.json").read_text()) == clean_digest(("fsdp",))
    assert job_processes(result.job_id) == []
