"""Recovery without stopping (docs/design.md §5a), with real processes, real gloo and real signals.

Each job runs ``tests/scripts/live_train.py`` (a linear model, an ``ElasticSampler``,
``train.steps``), which logs every applied step: pid, rank, world size, sampler position,
sample ids, parameter checksum. Every case checks the same invariants: the job succeeds;
the survivors' processes never change; every step is applied exactly once in the job's
lineage, with the same parameters and data position on every rank that applied it; each
step's samples are its global batch (no sample twice, none lost); every rank ends with the
same parameters; nothing leaks (processes, shared memory).
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import defaultdict
from pathlib import Path

import pytest
from helpers import SCRIPTS, check_committed_steps, job_events, job_processes, shm_entries, wait_for

from dlrover_core import Checkpoint, Failure, Job, JobState, Nodes
from dlrover_core.train import ElasticSampler

pytestmark = pytest.mark.slow

SAMPLES, BATCH = 96, 4


def live_job(tmp: Path, name: str, *, steps: int = 150, nodes: int = 2, nproc: int = 1, sleep_s: float = 0.1,
             max_restarts: int = 5, hang_timeout_s: float | None = None, persist_every: int = 10,
             extra: tuple[str, ...] = (), virtual_local_rank: bool = False) -> Job:
    return Job(
        name=name, entrypoint=str(SCRIPTS / "live_train.py"),
        args=["--steps", str(steps), "--samples", str(SAMPLES), "--batch", str(BATCH), "--step-sleep", str(sleep_s),
              "--out", str(tmp / "out"), "--pace-file", str(tmp / "pace"), *extra],
        nodes=Nodes(min=nodes, max=nodes, nproc_per_node=nproc, virtual_local_rank=virtual_local_rank),
        accelerator="cpu",
        checkpoint=Checkpoint(dir=str(tmp / "ck"), persist_every_steps=persist_every),
        failure=Failure(max_restarts=max_restarts, stop_grace_s=2, hang_timeout_s=hang_timeout_s),
        log_dir=str(tmp / "runs"),
    )


def expected_windows(steps: int, global_batch: int) -> list[list[int]]:
    """Each step's global batch, as one rank of a one-rank world would take it."""
    sampler = ElasticSampler(SAMPLES, global_batch, seed=7, rank=0, world_size=1)
    windows = []
    for _ in range(steps):
        ids = sampler.next_batch()
        if ids is None:
            ids = sampler.next_batch()
        windows.append(ids)
    return windows


def check_lineage(tmp: Path, *, steps: int, world_size: int, survivors: set[int]) -> dict[int, list[dict]]:
    """The invariants of the module docstring, from the workers' step logs."""
    by_step: dict[int, list[dict]] = defaultdict(list)
    pids_steps: dict[int, list[int]] = defaultdict(list)
    for path in (tmp / "out").glob("steps_*.jsonl"):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            by_step[r["step"]].append(r)
            pids_steps[r["pid"]].append(r["step"])
    assert sorted(by_step) == list(range(steps)), "every step applied, none skipped"
    for pid, done in pids_steps.items():
        assert done == sorted(set(done)), f"pid {pid} applied a step twice or went back: {done}"
    windows = expected_windows(steps, BATCH * world_size)
    for step, records in by_step.items():
        assert len({(r["epoch"], r["consumed"]) for r in records}) == 1, (step, records)
        assert len({r["params"] for r in records}) == 1, f"step {step}: ranks applied different updates"
        ranks = [r["rank"] for r in records]
        assert len(ranks) == len(set(ranks)), (step, records)
        seen = [i for r in records for i in r["ids"]]
        assert len(seen) == len(set(seen)), f"step {step}: a sample taken twice"
        assert set(seen) <= set(windows[step]), f"step {step}: samples outside its global batch"
        if len(records) == records[0]["world_size"]:
            assert sorted(seen) == sorted(windows[step]), f"step {step}: samples lost"
    finals = [json.loads(p.read_text()) for p in (tmp / "out").glob("final_*.json")]
    assert len(finals) == world_size and len({f["params"] for f in finals}) == 1, finals
    finished = {int(p.stem.split("_")[1]) for p in (tmp / "out").glob("final_*.json")}
    assert survivors <= finished, f"survivors {survivors} did not all finish in their own process ({finished})"
    for pid in survivors:
        assert pids_steps[pid][-1] == steps - 1 and pids_steps[pid][0] == 0, f"survivor {pid} restarted"
    return by_step


def reformed(run) -> list[tuple[str, int]]:
    """``(reason, world_size)`` of each generation formed so far."""
    path = Path(run.handle.log_dir) / "events.jsonl"
    events = [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
    return [(e["reason"], e["world_size"]) for e in events if e["kind"] == "live_reformed"]


def hurry_once_whole(tmp: Path, run, world_size: int, gone: set[int]) -> None:
    """Once ``world_size`` workers run again, none of them one of the ``gone`` pids, and each
    has trained a step (the replacements rejoined), let the remaining steps run without
    their sleep: nothing is left to watch but that they end well (``--pace-file`` of
    ``live_train.py``; it changes no step). Watches on a thread of its own, since the test
    goes on to ``run.wait()``, which supervises the job as a user's would. Until then the
    steps go slower (0.3 s), so that a cold replacement on a slow or loaded machine joins
    before the survivors run out of steps."""
    (tmp / "pace").write_text("0.3")

    def whole() -> bool:
        pids = set(run.status().worker_pids.values())
        logs = [tmp / "out" / f"steps_{pid}.jsonl" for pid in pids]
        return len(pids) == world_size and not pids & gone and all(p.exists() and p.stat().st_size for p in logs)

    def watch() -> None:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not run.status().state.is_terminal:
            if whole():
                (tmp / "pace").write_text("0.005")
                return
            time.sleep(0.1)

    threading.Thread(target=watch, name="hurry", daemon=True).start()


def finish(run, shm_before: set[str]):
    result = run.wait(progress=False, timeout_s=180)
    assert result.state == JobState.SUCCEEDED, result.reason
    assert job_processes(result.job_id) == []
    assert {e for e in shm_entries() - shm_before if result.job_id in e} == set()  # (other jobs may run meanwhile)
    return result


def first_pids(run, ranks: int) -> dict[int, int]:
    wait_for(lambda: len((s := run.status()).worker_pids) == ranks and s.step >= 3, 120, "training")
    return dict(run.status().worker_pids)


@pytest.mark.timeout(240)
def test_sigkilled_worker_is_replaced_while_the_survivor_keeps_training(tmp_path):
    """The state is written as the README says, with a plain object that keeps the step the
    loop gives it (``self.step = step``: the repro live-grow-state, where sending it to the
    replacement killed the survivor and the job then waited for ever)."""
    shm_before = shm_entries()
    run = live_job(tmp_path, "live1", extra=("--probe",)).submit()
    pids = first_pids(run, 2)
    wait_for(lambda: run.status().step >= 10, 60, "step 10")
    os.kill(pids[1], signal.SIGKILL)
    hurry_once_whole(tmp_path, run, 2, gone={pids[1]})
    result = finish(run, shm_before)
    assert result.restarts == 1
    (failure,) = result.failures
    assert failure.recovery == "live" and failure.signal == "SIGKILL" and failure.action.startswith("live:")
    assert result.recomputed_s == 0
    events = job_events(result)
    reformed = [(e["reason"], e["world_size"]) for e in events if e["kind"] == "live_reformed"]
    # the survivor goes on alone and the replacement grows the world back; or, where the
    # replacement (forked warm by its node's standby) asks to join before the survivor's
    # failed all-reduce has ended, the generation formed after the error includes it at once
    assert reformed in ([("error", 1), ("grow", 2)], [("error", 2)]), reformed
    assert not any(e["kind"] == "rendezvous_completed" and e["round"] > 0 for e in events)
    check_lineage(tmp_path, steps=150, world_size=2, survivors={pids[0]})
    check_committed_steps(tmp_path / "ck")
    assert {json.loads(p.read_text())["probe"] for p in (tmp_path / "out").glob("final_*.json")} == {149}


@pytest.mark.timeout(300)
def test_the_holder_killed_while_it_sends_the_state_makes_every_worker_restart(tmp_path):
    """Rank 1 is SIGKILLed; its replacement joins; rank 0, the only worker holding the
    training state, is SIGKILLed while it sends it (128 MiB). No one left can give the
    replacement the state: the master restarts every worker from the newest checkpoint and
    says why, instead of forming a world of replacements that waits for ever."""
    shm_before = shm_entries()
    run = live_job(tmp_path, "live8", steps=150, extra=("--ballast-mb", "128")).submit()
    pids = first_pids(run, 2)
    wait_for(lambda: run.status().step >= 10, 60, "step 10")
    (tmp_path / "pace").write_text("0.3")  # the survivor trains on until the replacement joins, even on a loaded machine
    killed_at = time.time()
    os.kill(pids[1], signal.SIGKILL)
    sending = tmp_path / "out" / f"sending_{pids[0]}"  # (also written when the loop checked the state at start)

    def sends() -> bool:
        try:
            return float(sending.read_text()) > killed_at
        except (OSError, ValueError):
            return False

    wait_for(sends, 90, "rank 0 sending its state to the replacement", poll_s=0.002)
    os.kill(pids[0], signal.SIGKILL)
    (tmp_path / "pace").write_text("0.005")  # what is left to watch is that every worker restarts and ends well
    result = finish(run, shm_before)
    assert [f.recovery for f in result.failures[:2]] == ["live", "restart_all"], result.failures
    second = result.failures[1]
    assert second.rank == 0 and second.signal == "SIGKILL", second
    assert "no surviving worker holds the training state" in second.action, second.action
    events = job_events(result)
    assert any(e["kind"] == "live_recovery_unavailable" and "holds the training state" in e["reason"] for e in events)
    assert any(e["kind"] == "rendezvous_completed" and e["round"] == 1 for e in events)
    finals = [json.loads(p.read_text()) for p in (tmp_path / "out").glob("final_*.json")]
    assert len(finals) == 2 and len({f["params"] for f in finals}) == 1, finals
    assert check_committed_steps(tmp_path / "ck")[-1] == 149


@pytest.mark.timeout(300)
def test_two_workers_killed_in_quick_succession_on_a_three_worker_node(tmp_path):
    """With ``--virtual-local-rank`` (every worker sees LOCAL_RANK=0): the live world tells the
    node's workers apart by their real local rank (DLROVER_LOCAL_RANK)."""
    shm_before = shm_entries()
    run = live_job(tmp_path, "live2", nodes=1, nproc=3, steps=200, virtual_local_rank=True).submit()
    pids = first_pids(run, 3)
    wait_for(lambda: run.status().step >= 10, 60, "step 10")
    os.kill(pids[1], signal.SIGKILL)
    # the second kill comes while the world re-forms without the first, as a separate
    # failure: both killed before the agent saw either make one report (one restart)
    wait_for(lambda: run.status().restarts >= 1, 30, "the first failure reported")
    os.kill(pids[2], signal.SIGKILL)
    hurry_once_whole(tmp_path, run, 3, gone={pids[1], pids[2]})
    result = finish(run, shm_before)
    assert result.restarts == 2 and all(f.recovery == "live" for f in result.failures), result.failures
    sizes = [e["world_size"] for e in job_events(result) if e["kind"] == "live_reformed"]
    # it shrank (to 2, or to 1 when the second died after the world re-formed without the
    # first) and came back whole
    assert sizes[-1] == 3 and min(sizes) < 3, sizes
    check_lineage(tmp_path, steps=200, world_size=3, survivors={pids[0]})


@pytest.mark.timeout(300)
def test_replacement_killed_while_it_joins(tmp_path):
    """Rank 1 is SIGKILLed; its replacement is SIGKILLed in the middle of its join: it has
    received the live state and is about to load it (``--hold-load`` holds it there, so the
    kill lands in the join whatever the machine's load), while the survivor waits for it at
    the next step. The survivor goes on, a second replacement joins live, and the killed one
    never trained a step."""
    shm_before = shm_entries()
    hold = tmp_path / "hold_load"
    hold.write_text("")
    run = live_job(tmp_path, "live3", steps=200, extra=("--ballast-mb", "8", "--hold-load", str(hold))).submit()
    pids = first_pids(run, 2)
    wait_for(lambda: run.status().step >= 10, 60, "step 10")
    (tmp_path / "pace").write_text("0.3")  # the survivor trains on until a replacement joins, even on a loaded machine
    os.kill(pids[1], signal.SIGKILL)
    out = tmp_path / "out"
    loading = wait_for(lambda: sorted(out.glob("loading_*")), 90, "the replacement loading the state it received")
    replacement = int(loading[0].name.split("_")[1])
    assert replacement not in pids.values()
    os.kill(replacement, signal.SIGKILL)
    hold.unlink()  # the next replacement loads at once
    hurry_once_whole(tmp_path, run, 2, gone={pids[1], replacement})
    result = finish(run, shm_before)
    assert result.restarts == 2 and [f.recovery for f in result.failures] == ["live", "live"], result.failures
    by_step = check_lineage(tmp_path, steps=200, world_size=2, survivors={pids[0]})
    assert all(r["pid"] != replacement for records in by_step.values() for r in records)


@pytest.mark.timeout(300)
def test_stopped_worker_is_replaced_after_the_hang_timeout(tmp_path):
    """SIGSTOP: the survivor blocks in the collective with the frozen worker; the agent's hang
    detection finds it stopped, kills it and replaces it; the survivor goes on."""
    shm_before = shm_entries()
    run = live_job(tmp_path, "live4", hang_timeout_s=3.0).submit()
    pids = first_pids(run, 2)
    wait_for(lambda: run.status().step >= 10, 60, "step 10")
    os.kill(pids[1], signal.SIGSTOP)
    hurry_once_whole(tmp_path, run, 2, gone={pids[1]})
    result = finish(run, shm_before)
    (failure,) = result.failures
    assert failure.kind == "hang" and failure.recovery == "live", failure
    check_lineage(tmp_path, steps=150, world_size=2, survivors={pids[0]})


@pytest.mark.timeout(300)
def test_kill_during_checkpoint_persists_keeps_every_commit_whole(tmp_path):
    """Persist every 2 steps, kill at random moments around them: the commits stay whole and
    the final step is committed."""
    shm_before = shm_entries()
    run = live_job(tmp_path, "live5", steps=400, persist_every=2, sleep_s=0.05).submit()
    pids = first_pids(run, 2)
    killed = set()
    for i, at in enumerate((8, 50)):
        wait_for(lambda at=at, i=i: run.status().step >= at and len(reformed(run)) == 2 * i, 90,
                 f"step {at} at full size")
        killed.add(run.status().worker_pids[1])
        os.kill(run.status().worker_pids[1], signal.SIGKILL)
    hurry_once_whole(tmp_path, run, 2, gone=killed)
    result = finish(run, shm_before)
    assert result.restarts == 2
    steps = check_committed_steps(tmp_path / "ck")
    assert steps[-1] == 399
    check_lineage(tmp_path, steps=400, world_size=2, survivors={pids[0]})


@pytest.mark.timeout(120)
def test_a_state_that_cannot_be_sent_to_a_replacement_fails_the_job_at_the_start(tmp_path):
    """A ``state_dict()`` value that cannot be pickled would only show when a replacement
    needs the state; the loop checks at its start, and the job fails there, naming it."""
    result = live_job(tmp_path, "live9", steps=20, extra=("--unsendable",)).run(progress=False)
    assert result.state == JobState.FAILED
    assert "LiveRecoveryError: state['probe'].state_dict()['hook'] is a builtins.function" in result.reason, \
        result.reason
    assert "live_recovery=False" in result.reason and result.final_step < 0


@pytest.mark.timeout(240)
def test_script_without_train_steps_restarts_every_worker_and_says_why(tmp_path):
    job = Job(name="notlive", entrypoint=str(SCRIPTS / "tiny_train.py"), args=["--steps", "20", "--fail-at", "8"],
              nodes=2, accelerator="cpu", checkpoint=Checkpoint(dir=str(tmp_path / "ck"), persist_every_steps=5),
              failure=Failure(max_restarts=2, stop_grace_s=2), log_dir=str(tmp_path / "runs"))
    result = job.run(progress=False)
    assert result.state == JobState.SUCCEEDED, result.reason
    failure = next(f for f in result.failures if f.recovery)
    assert failure.recovery == "restart_all"
    assert "not live" in failure.action and "train.steps()" in failure.action, failure.action
    assert any(e["kind"] == "live_recovery_unavailable" for e in job_events(result))


@pytest.mark.timeout(300)
def test_killed_agent_node_is_relaunched_and_rejoins_while_the_other_keeps_training(tmp_path):
    """SIGKILL node 1's agent (its worker dies with it): the local scheduler tells the master
    at once, the survivor goes on alone, the relaunched node's worker rejoins live."""
    shm_before = shm_entries()
    run = live_job(tmp_path, "live6", steps=200).submit()
    pids = first_pids(run, 2)
    wait_for(lambda: run.status().step >= 10, 60, "step 10")
    handle = json.loads((Path(run.handle.log_dir) / "handle.json").read_text())
    os.kill(handle["agents"]["node-1"], signal.SIGKILL)
    hurry_once_whole(tmp_path, run, 2, gone={pids[1]})
    result = finish(run, shm_before)
    failure = next(f for f in result.failures if f.kind == "node_lost")
    assert failure.recovery == "live" and "local scheduler" in failure.detail, failure
    events = job_events(result)
    assert [(e["reason"], e["world_size"]) for e in events if e["kind"] == "live_reformed"] == [("error", 1), ("grow", 2)]
    assert not any(e["kind"] == "rendezvous_completed" and e["round"] > 0 for e in events)
    check_lineage(tmp_path, steps=200, world_size=2, survivors={pids[0]})


@pytest.mark.timeout(240)
def test_a_worker_that_crashes_while_exiting_after_the_last_step_is_restarted_not_awaited(tmp_path):
    """Rank 0 finishes the last step, then dies of SIGABRT in interpreter teardown (what a
    native library's exit can do). Its peer has finished too, so no replacement can join a
    running world: every worker restarts instead, restores the final commit, trains no step
    again, and the job succeeds (it used to wait for a replacement that never came)."""
    shm_before = shm_entries()
    run = live_job(tmp_path, "live7", steps=30, sleep_s=0.02,
                   extra=("--abort-at-exit-once", str(tmp_path / "aborted"))).submit()
    result = finish(run, shm_before)
    assert (tmp_path / "aborted").exists()
    (failure,) = result.failures
    assert failure.signal == "SIGABRT" and failure.recovery == "restart_all", failure
    assert "finished the last step" in failure.action, failure.action
    assert result.restarts == 1 and result.final_step == 29
    for rank in (0, 1):
        steps = [json.loads(line)["step"] for path in (tmp_path / "out").glob("steps_*.jsonl")
                 for line in path.read_text().splitlines() if json.loads(line)["rank"] == rank]
        assert sorted(steps) == list(range(30)), f"rank {rank} trained a step twice or skipped one"
    assert check_committed_steps(tmp_path / "ck")[-1] == 29
