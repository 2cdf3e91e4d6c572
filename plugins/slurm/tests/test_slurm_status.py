"""Reading Slurm: recorded squeue / sacct / sinfo output parsed into states, retries of
transient controller errors, and where ``relaunch_node`` puts an agent — without a cluster.

The recorded outputs below are what Slurm 22.05.8 printed on a two-node test cluster for the
exact commands the backend runs (``squeue --noheader --states=all --jobs=ID --format=%i|%T|%r|%S|%N``,
``sacct --completion --noheader --parsable2 --jobs=ID --format=JobID,State,ExitCode,Start,NodeList``,
``sinfo --noheader --Node --format=%N|%T``); the unknown state is a made-up word standing in
for a state a future Slurm might add.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from dlrover_core import Job
from dlrover_core.errors import SchedulerError
from dlrover_core.protocol import JobState, NodeRelaunch
from dlrover_core.scheduler_backend import JobHandle, Submission
from dlrover_plugin_slurm import SLURM_JOB_STATES, SlurmCli, SlurmScheduler, map_state, parse_sacct, parse_squeue
from dlrover_plugin_slurm._commands import parse_node_states, slurm_env
from dlrover_plugin_slurm._scheduler import SbatchRequest

SQUEUE_ALL = """\
6|COMPLETED|None|2026-11-29T18:56:27|n[1-2]
7|COMPLETED|None|2026-11-29T18:56:49|n[1-2]
8|COMPLETING|None|2026-11-29T18:57:38|n[1-2]
10|PENDING|Resources|N/A|
11|PENDING|PartitionNodeLimit|N/A|
9|RUNNING|None|2026-11-29T18:58:28|n[1-2]
12|CANCELLED|None|2026-11-29T18:59:02|n[1-2]
"""
#: squeue right after ``scontrol requeue``: pending until the requeue delay has passed.
SQUEUE_REQUEUED = "5|PENDING|BeginTime|2026-11-29T18:53:17|\n"
#: a state this plugin does not know.
SQUEUE_UNKNOWN = "13|WIBBLING|None|2026-11-29T19:00:00|n1\n"
#: a requeued job in the job completion log: one record per run, the latest last.
SACCT_REQUEUED = """\
8|PENDING|0:0|2026-11-29T18:57:38|n[1-2]
8|COMPLETED|0:0|2026-11-29T18:57:50|n[1-2]
"""
SACCT_CANCELLED_PENDING = "10|CANCELLED|0:0|2026-11-29T18:58:29|(null)\n"
SACCT_CANCELLED_BY = "14|CANCELLED by 0|0:15|2026-11-29T19:01:00|n[1-2]\n"
SINFO = "n1|allocated\nn2|idle*\nn3|drained\nn4|mixed\nn4|down\n"


def test_squeue_states_map_to_job_states():
    """Each recorded squeue line maps to the lifecycle state a runner expects; a pending job
    says why it waits."""
    expect = {"6": JobState.SUCCEEDED, "8": JobState.RUNNING, "9": JobState.RUNNING, "10": JobState.PENDING,
              "12": JobState.CANCELLED}
    for native, state in expect.items():
        assert parse_squeue(SQUEUE_ALL, native).state == state, native
    pending = parse_squeue(SQUEUE_ALL, "11")
    assert pending.reason == "PartitionNodeLimit" and "PartitionNodeLimit" in pending.message
    assert pending.start_epoch_s is None and pending.nodelist == ""
    running = parse_squeue(SQUEUE_ALL, "9")
    assert running.nodelist == "n[1-2]"
    assert running.start_epoch_s == time.mktime(time.strptime("2026-11-29T18:58:28", "%Y-%m-%dT%H:%M:%S"))
    assert parse_squeue(SQUEUE_ALL, "99") is None  # not listed: the caller asks sacct


def test_requeued_job_is_pending():
    """A requeued job (pending on its BeginTime) reads as PENDING, not as ended."""
    job = parse_squeue(SQUEUE_REQUEUED, "5")
    assert job.state == JobState.PENDING and "BeginTime" in job.message


def test_unknown_state_is_unknown_with_slurms_word():
    """A state missing from the table is UNKNOWN, and the message carries Slurm's word."""
    job = parse_squeue(SQUEUE_UNKNOWN, "13")
    assert job.state == JobState.UNKNOWN
    assert "WIBBLING" in job.message and job.raw_state == "WIBBLING"
    assert map_state("") == (JobState.UNKNOWN, "unknown Slurm job state ''")


def test_short_line_is_unknown_not_a_crash():
    """A line without the asked fields (a format Slurm did not honour) is UNKNOWN with the line."""
    job = parse_squeue("15|RUNNING\n", "15")
    assert job.state == JobState.UNKNOWN and "15|RUNNING" in job.message


def test_sacct_takes_the_latest_run():
    """sacct lists a requeued job once per run: the last record is the job's state."""
    assert parse_sacct(SACCT_REQUEUED, "8").state == JobState.SUCCEEDED
    cancelled = parse_sacct(SACCT_CANCELLED_PENDING, "10")
    assert cancelled.state == JobState.CANCELLED and cancelled.source == "sacct"
    by = parse_sacct(SACCT_CANCELLED_BY, "14")
    assert by.state == JobState.CANCELLED and "exit code 0:15" in by.message
    assert parse_sacct(SACCT_REQUEUED, "9") is None


def test_pending_state_of_a_job_out_of_the_queue_is_failed():
    """A job only sacct knows will not run again: a pending-like last state means it ended there."""
    assert map_state("PREEMPTED") == (JobState.PENDING, "")  # in the queue: it is requeued
    state, note = map_state("PREEMPTED", in_queue=False)
    assert state == JobState.FAILED and "PREEMPTED" in note


def test_every_documented_state_is_mapped():
    """The table covers every JOB STATE CODE of squeue(1) in Slurm 22.05."""
    codes = ("BOOT_FAIL CANCELLED COMPLETED CONFIGURING COMPLETING DEADLINE FAILED NODE_FAIL OUT_OF_MEMORY PENDING "
             "PREEMPTED RUNNING RESV_DEL_HOLD REQUEUE_FED REQUEUE_HOLD REQUEUED RESIZING REVOKED SIGNALING "
             "SPECIAL_EXIT STAGE_OUT STOPPED SUSPENDED TIMEOUT").split()
    assert sorted(codes) == sorted(SLURM_JOB_STATES)


def test_node_fitness():
    """A node can take a new step when allocated, mixed or idle and responding; a node listed
    in two partitions must be fit in both."""
    assert parse_node_states(SINFO) == {"n1": True, "n2": False, "n3": False, "n4": False}


# ----- running the tools ------------------------------------------------------------------


class FakeRun:
    """Stands in for subprocess.run: answers from a list of (returncode, stdout, stderr)."""

    def __init__(self, answers):
        self.answers = list(answers)
        self.calls: list[list[str]] = []

    def __call__(self, argv, **kwargs):
        self.calls.append(list(argv))
        code, out, err = self.answers.pop(0)
        return subprocess.CompletedProcess(argv, code, out, err)


def test_transient_errors_are_retried():
    """"Socket timed out" / "Unable to contact slurm controller" are retried (bounded); the
    answer after them is returned."""
    run = FakeRun([(1, "", "squeue: error: Socket timed out on send/recv operation"),
                   (1, "", "slurm_load_jobs error: Unable to contact slurm controller (connect failure)"),
                   (0, SQUEUE_ALL, "")])
    sleeps = []
    with capture_logs() as logs:
        job = SlurmCli(run=run, sleep=sleeps.append).job("9")
    assert job.state == JobState.RUNNING and len(run.calls) == 3 and len(sleeps) == 2
    assert [e["event"] for e in logs] == ["slurm_command_retry", "slurm_command_retry"]


def test_retries_are_bounded():
    """A controller that stays unreachable ends in SchedulerError with its message."""
    run = FakeRun([(1, "", "Unable to contact slurm controller (connect failure)")] * 3)
    with pytest.raises(SchedulerError, match="kept failing.*Unable to contact slurm controller"):
        SlurmCli(run=run, sleep=lambda s: None, attempts=3)(["squeue"])
    assert len(run.calls) == 3


def test_permanent_error_keeps_slurms_message():
    """A refusal is not retried; the error carries Slurm's words."""
    msg = "sbatch: error: Batch job submission failed: Requested node configuration is not available"
    run = FakeRun([(1, "", msg)])
    with pytest.raises(SchedulerError, match="Requested node configuration is not available"):
        SlurmCli(run=run, sleep=lambda s: None)(["sbatch", "--parsable", "job.sbatch"])
    assert len(run.calls) == 1


def test_missing_tool_says_what_to_install():
    def missing(argv, **kwargs):
        raise FileNotFoundError(argv[0])

    with pytest.raises(SchedulerError, match="not on PATH.*slurm-client"):
        SlurmCli(run=missing)(["squeue"])


def test_purged_job_is_looked_up_in_sacct():
    """squeue forgets a job some minutes after it ended; then sacct (-c without slurmdbd) answers."""
    run = FakeRun([(1, "", "slurm_load_jobs error: Invalid job id specified"),
                   (1, "", "Slurm accounting storage is disabled"),
                   (0, SACCT_REQUEUED, "")])
    job = SlurmCli(run=run, sleep=lambda s: None).job("8")
    assert job.state == JobState.SUCCEEDED and job.source == "sacct"
    assert "--completion" in run.calls[2]


def test_lost_sbatch_answer_does_not_submit_twice(tmp_path):
    """sbatch timed out but queued the job: the retry finds it by its name instead of
    submitting a second one."""
    run = FakeRun([(1, "", "sbatch: error: Socket timed out on send/recv operation"), (0, "42\n", "")])
    backend = SlurmScheduler(SlurmCli(run=run, sleep=lambda s: None))
    script = tmp_path / "job.sbatch"
    script.write_text("#!/bin/bash\n")
    request = SbatchRequest(script="#!/bin/bash\n", script_path=str(script), python="/py",
                            argv=("sbatch", "--parsable", str(script)))
    assert backend._sbatch("tiny-1", request) == "42"
    assert run.calls[0] == ["sbatch", "--parsable", str(script)]
    assert run.calls[1][:2] == ["squeue", "--noheader"] and "--name=tiny-1" in run.calls[1]


# ----- state kept in files ----------------------------------------------------------------


class FakeCli:
    """A SlurmCli whose answers are set by the test."""

    def __init__(self, job=None, hosts=("n1", "n2"), fit=None):
        self.slurm_job = job
        self.hosts = list(hosts)
        self.fit = fit if fit is not None else {h: True for h in hosts}
        self.calls: list[list[str]] = []

    def job(self, native_id):
        return self.slurm_job

    def hostnames(self, nodelist):
        return self.hosts

    def node_fitness(self, nodes):
        return {n: self.fit.get(n, False) for n in nodes}

    def steps(self, native_id):
        return []

    def __call__(self, argv, **kwargs):
        self.calls.append(list(argv))
        return ""


def _handle(tmp_path: Path, *, elastic: bool = False) -> JobHandle:
    (tmp_path / "slurm").mkdir(parents=True, exist_ok=True)
    (tmp_path / "slurm" / "submit.json").write_text(json.dumps({"job_id": "tiny-1", "native_id": "7"}))
    job = Job(name="tiny", entrypoint="train.py", nodes="1:2" if elastic else 2, scheduler="slurm")
    request = SbatchRequest(script="", script_path=str(tmp_path / "job.sbatch"), argv=("sbatch",), python="python3")
    submission = Submission(scheduler="slurm", job_id="tiny-1", log_dir=str(tmp_path), job=job, request=request)
    (tmp_path / "request.json").write_text(submission.to_json())
    return JobHandle(scheduler="slurm", job_id="tiny-1", log_dir=str(tmp_path))


def _in_place(node_id: int) -> NodeRelaunch:
    return NodeRelaunch(node_id=node_id, replaces=node_id, reason=f"node {node_id} was lost")


@pytest.fixture
def placed(monkeypatch):
    """Where relaunch_node would start its srun step: [(node_id, target, exclude)]."""
    calls = []
    monkeypatch.setattr(SlurmScheduler, "_start_agent_step",
                        lambda self, handle, native, info, node_id, target, *, exclude:
                        calls.append((node_id, target, exclude)))
    return calls


RUNNING = parse_squeue(SQUEUE_ALL, "9")


def test_lost_agent_goes_back_to_its_healthy_node(tmp_path, placed):
    """The agent died, the node did not: the agent is started again on the same Slurm node."""
    handle = _handle(tmp_path)
    SlurmScheduler(FakeCli(RUNNING)).relaunch_node(handle, _in_place(1))
    assert placed == [(1, "n2", None)]
    assert json.loads((tmp_path / "slurm" / "nodes.json").read_text()) == {"0": "n1", "1": "n2"}


def test_agent_of_a_down_node_moves_to_a_fit_one(tmp_path, placed):
    """A node Slurm no longer finds fit is excluded; the agent goes to a fit node of the allocation."""
    handle = _handle(tmp_path)
    SlurmScheduler(FakeCli(RUNNING, fit={"n1": True, "n2": False})).relaunch_node(handle, _in_place(1))
    assert placed == [(1, "n1", "n2")]


def test_replacement_of_an_excluded_node_avoids_it(tmp_path, placed):
    """A new node id that replaces a node the master excluded (``NodeRelaunch.replaces``, no
    events file read) never lands on the excluded node."""
    handle = _handle(tmp_path)
    assert not (tmp_path / "events.jsonl").exists()
    SlurmScheduler(FakeCli(RUNNING)).relaunch_node(handle, NodeRelaunch(node_id=2, replaces=0, reason="excluded"))
    assert placed == [(2, "n2", "n1")]


def test_no_fit_node_left_requeues_a_fixed_size_job(tmp_path, placed):
    """With no fit node left, a job with a fixed node count is requeued (it resumes from its
    latest checkpoint on a new allocation)."""
    cli = FakeCli(RUNNING, fit={"n1": False, "n2": False})
    with capture_logs() as logs:
        SlurmScheduler(cli).relaunch_node(_handle(tmp_path), _in_place(1))
    assert placed == [] and cli.calls == [["scontrol", "requeue", "7"]]
    assert logs[-1]["event"] == "slurm_job_requeued"


def test_no_fit_node_left_lets_an_elastic_job_shrink(tmp_path, placed):
    """An elastic job is not requeued: the relaunch fails and the master goes on with fewer nodes."""
    cli = FakeCli(RUNNING, fit={"n1": False, "n2": False})
    with pytest.raises(SchedulerError, match="fewer nodes"):
        SlurmScheduler(cli).relaunch_node(_handle(tmp_path, elastic=True), _in_place(1))
    assert cli.calls == []


def test_relaunch_needs_a_running_job(tmp_path, placed):
    with pytest.raises(SchedulerError, match="not running"):
        SlurmScheduler(FakeCli(parse_squeue(SQUEUE_ALL, "10"))).relaunch_node(_handle(tmp_path), _in_place(1))


def _result(tmp_path: Path, state: str) -> None:
    data = {"job_id": "tiny-1", "state": state, "reason": "", "final_step": 5, "restarts": 0, "wall_time_s": 1.0,
            "productive_s": 1.0, "goodput": 1.0, "checkpoint_stall_s": 0.0, "restore_s": 0.0, "recomputed_s": 0.0,
            "detection_s": 0.0, "restart_s": 0.0, "rendezvous_s": 0.0, "startup_s": 0.0, "failures": [],
            "metrics": {}, "log_dir": str(tmp_path)}
    (tmp_path / "result.json").write_text(json.dumps(data))


def test_result_of_a_requeued_run_is_not_final(tmp_path):
    """While Slurm has the job pending again (requeued), the previous run's result.json is
    not the job's result; a CANCELLED one written while Slurm still runs the job waits for
    Slurm's word; once Slurm says the job ended, result.json is the result."""
    handle = _handle(tmp_path)
    _result(tmp_path, "CANCELLED")
    assert SlurmScheduler(FakeCli(parse_squeue(SQUEUE_REQUEUED, "5"))).result(handle) is None
    assert SlurmScheduler(FakeCli(RUNNING)).result(handle) is None
    assert SlurmScheduler(FakeCli(parse_squeue(SQUEUE_ALL, "12"))).result(handle).state == JobState.CANCELLED
    _result(tmp_path, "SUCCEEDED")
    assert SlurmScheduler(FakeCli(RUNNING)).result(handle).state == JobState.SUCCEEDED  # written after the start


def test_commands_ignore_the_variables_of_an_enclosing_job():
    """Inside the allocation (the master) srun must not read the batch job's SLURM_* as options;
    the cluster (SLURM_CONF) and the user's SBATCH_* options are kept."""
    env = slurm_env({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "2", "SRUN_CPUS_PER_TASK": "4", "SLURM_CONF": "/c",
                     "SBATCH_PARTITION": "gpu", "PATH": "/bin"})
    assert env == {"SLURM_CONF": "/c", "SBATCH_PARTITION": "gpu", "PATH": "/bin"}
