"""Errors that are the script's, not a node's: an exception at import or before the first
step, the same on every rank, stops the job after its first occurrence with the exception's
type and message, and no node is excluded for it. A restart budget used up by several
nodes names each of them with its count."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from helpers import SCRIPTS, job_processes

from dlrover_core import Checkpoint, Failure, Job, JobState, Nodes
from dlrover_core.agent.progress import exception_from_output
from dlrover_core.master.job_master import JobMaster
from dlrover_core.protocol import FailureReport, Heartbeat, Join, Poll, Register, WorkerException, WorkerFailure


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def master(workdir: Path, nodes=2, **failure) -> JobMaster:
    (workdir / "t.py").write_text("")
    job = Job(name="m", entrypoint="t.py", nodes=nodes,
              failure=Failure(**{"max_restarts": 3, "heartbeat_timeout_s": 30, **failure}))
    ports = iter(range(5000, 6000))
    m = JobMaster(job, "job-1", store_host="127.0.0.1", store_factory=lambda: (next(ports), None), clock=Clock())
    return m


def form(m: JobMaster, nodes=(0, 1), nproc=1) -> int:
    for n in nodes:
        m.register(Register(node_id=n, host="h", pid=100 + n))
        m.join(Join(node_id=n, nproc=nproc))
    m.tick()
    rounds = {m.poll(Poll(node_id=n)).round for n in nodes}
    assert len(rounds) == 1
    return rounds.pop()


def import_error(rank: int) -> WorkerFailure:
    return WorkerFailure.exited(rank=rank, local_rank=0, exit_code=1, exception=WorkerException(
        exc_type="ModuleNotFoundError", message="No module named 'datasets'", step=-1, before_first_step=True,
        traceback="Traceback ...\nModuleNotFoundError: No module named 'datasets'"))


def fail(m: JobMaster, node_id: int, round_index: int, *failures: WorkerFailure):
    return m.failure(FailureReport(node_id=node_id, round=round_index, failures=failures))


def sigkill(rank: int) -> WorkerFailure:
    return WorkerFailure.exited(rank=rank, local_rank=0, exit_code=-9)


# ----- fast ------------------------------------------------------------------------------------


def test_the_same_error_before_the_first_step_on_every_rank_stops_at_once(workdir):
    m = master(workdir, max_node_failures=1)
    form(m)
    first = fail(m, 0, 0, import_error(0))
    assert first.action == "none"  # the restart waits for the other rank's report
    assert m.heartbeat(Heartbeat(node_id=1, round=0)).action == "none"
    fail(m, 1, 0, import_error(1))
    assert m.state == JobState.FAILED
    assert "ModuleNotFoundError: No module named 'datasets'" in m.reason
    assert "before its first step" in m.reason and "not of a node" in m.reason
    assert m.required_round == 0  # no second round was ever ordered
    assert all(n.state != "excluded" and n.failures == 0 for n in m.nodes.values())


def test_all_ranks_of_one_report_stop_without_a_restart(workdir):
    m = master(workdir, nodes=1)
    form(m, nodes=(0,), nproc=2)
    fail(m, 0, 0, import_error(0), import_error(1))
    assert m.state == JobState.FAILED and m.restarts == 0 and m.nodes[0].failures == 0
    assert "ModuleNotFoundError" in m.reason


def test_an_early_error_on_one_rank_only_restarts_after_the_wait(workdir):
    """Only one rank raised: not (provably) the script's. The restart waits for the other
    ranks, then goes ahead, and the node is blamed."""
    m = master(workdir)
    form(m)
    fail(m, 0, 0, import_error(0))
    assert m.heartbeat(Heartbeat(node_id=1, round=0)).action == "none"
    m.clock.t += 11  # past _SCRIPT_ERROR_WAIT_S
    m.heartbeat(Heartbeat(node_id=0, round=0)), m.heartbeat(Heartbeat(node_id=1, round=0))
    m.tick()
    assert m.heartbeat(Heartbeat(node_id=1, round=0)).action == "restart"
    assert m.restarts == 1 and m.nodes[0].failures == 1 and m.state == JobState.RUNNING


def test_an_early_error_then_another_failure_restarts_at_once(workdir):
    """The restart held for an early error goes ahead as soon as another rank fails
    differently (not the script's error after all), without costing a second restart."""
    m = master(workdir)
    form(m)
    fail(m, 0, 0, import_error(0))
    assert m.heartbeat(Heartbeat(node_id=1, round=0)).action == "none"  # held
    fail(m, 1, 0, sigkill(1))
    assert m.heartbeat(Heartbeat(node_id=1, round=0)).action == "restart" and m.restarts == 1


def test_exhausted_budget_names_every_node_and_its_count(workdir):
    m = master(workdir, max_restarts=2, max_node_failures=10)
    for node in (0, 1, 0):
        rnd = form(m)
        fail(m, node, rnd, sigkill(node))
    assert m.state == JobState.FAILED
    assert m.reason.startswith("restart budget exhausted (failure.max_restarts=2) by 3 failures: node 0 (2), "
                               "node 1 (1); root cause: rank 0 on node 0, SIGKILL"), m.reason


# ----- slow: real jobs ---------------------------------------------------------------------------


def events(result) -> list[dict]:
    return [json.loads(line) for line in (Path(result.log_dir) / "events.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("script, args, expected", [
    ("import_error.py", [], "ModuleNotFoundError: No module named 'dlrover_test_no_such_module'"),
    ("tiny_train.py", ["--raise-at", "0"], "ValueError: bad batch at step 0: shape mismatch"),
], ids=["at-import", "before-first-step"])
def test_a_script_error_stops_the_job_after_its_first_occurrence(tmp_path, script, args, expected):
    """Before: every rank failing the same way at import was restarted (twice, or until the
    budget ran out) and the nodes blamed; with max_node_failures=1, excluded and replaced."""
    job = Job(name="script-error", entrypoint=str(SCRIPTS / script), args=args, nodes=Nodes(min=2, max=2),
              accelerator="cpu", log_dir=str(tmp_path / "runs"), checkpoint=Checkpoint(dir=str(tmp_path / "ck")),
              failure=Failure(max_restarts=3, max_node_failures=1, stop_grace_s=2))
    t0 = time.monotonic()
    result = job.run(progress=False)
    assert result.state == JobState.FAILED
    assert expected in result.reason, result.reason
    assert "before its first step" in result.reason
    kinds = [e["kind"] for e in events(result)]
    assert kinds.count("rendezvous_completed") == 1, kinds  # no second round
    assert "node_excluded" not in kinds and "node_relaunched" not in kinds
    assert result.restarts <= 1
    assert time.monotonic() - t0 < 90
    assert job_processes(result.job_id) == []


def test_an_exception_is_read_from_the_traceback_a_worker_printed(tmp_path):
    """A worker that died before importing dlrover_core.train (an error at import) recorded
    nothing: its agent reads the exception from the traceback at the end of its output."""
    log = tmp_path / "rank_0.log"
    log.write_text("starting\nTraceback (most recent call last):\n  File \"t.py\", line 1, in <module>\n"
                   "    import nope\nModuleNotFoundError: No module named 'nope'\n")
    exc = exception_from_output(log, step=-1)
    assert exc is not None and exc.exc_type == "ModuleNotFoundError" and exc.message == "No module named 'nope'"
    assert exc.raised_before_first_step() and "import nope" in exc.traceback
    chained = tmp_path / "rank_1.log"
    chained.write_text("Traceback (most recent call last):\n  x\nKeyError: 'a'\n\nDuring handling of the above "
                       "exception, another exception occurred:\n\nTraceback (most recent call last):\n  y\n"
                       "torch.distributed.DistBackendError: boom\n")
    last = exception_from_output(chained, step=7)
    assert last is not None and (last.exc_type, last.message, last.step) == ("torch.distributed.DistBackendError",
                                                                           "boom", 7)
    assert not last.raised_before_first_step()
    (tmp_path / "clean.log").write_text("done\n")
    assert exception_from_output(tmp_path / "clean.log", step=3) is None
    assert exception_from_output(tmp_path / "missing.log", step=3) is None
