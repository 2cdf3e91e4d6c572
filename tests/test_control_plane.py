"""The control plane described once (dlrover_core.control_plane), the run directory's names
(dlrover_core.rundir) and the typed submission every backend reads back (Submission)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlrover_core import Job, Nodes, control_plane, env, rundir
from dlrover_core.errors import SchedulerError
from dlrover_core.scheduler_backend import JobHandle, Plan, ProcessSpec, Submission
from dlrover_core.schedulers.docker._request import DockerRequest
from dlrover_core.schedulers.local import LocalRequest, LocalScheduler
from dlrover_core.spec import JobSpec


def _job(**kw) -> Job:
    return Job(name="tiny", entrypoint="train.py", **kw)


def _spec(**kw) -> JobSpec:
    """The Job as every process decodes it (a plain JobSpec)."""
    return JobSpec.from_dict(_job(**kw).to_dict())


def test_the_job_spec_round_trips():
    """What encode_job writes, decode_job and job_from_environ read back as the same Job."""
    job = _spec(nodes="1:3", env={"A": "1"})
    text = control_plane.encode_job(job)
    assert control_plane.decode_job(text) == job
    assert control_plane.decode_job(control_plane.encode_job(job, sort_keys=True)) == job
    assert control_plane.job_from_environ({env.JOB_SPEC: text}) == job
    assert control_plane.job_from_environ({}) is None


def test_command_lines():
    """The master's and an agent's command lines, and an agent's for another node."""
    assert control_plane.master_argv("py", job_id="j", host="0.0.0.0", port=80, store_host="m", log_dir="/l") == (
        "py", "-m", "dlrover_core.master", "--job-id", "j", "--host", "0.0.0.0", "--port", "80",
        "--store-host", "m", "--log-dir", "/l")
    agent = control_plane.agent_argv("py", job_id="j", node_id=0, master_addr="m:80", log_dir="/l")
    assert agent == ("py", "-m", "dlrover_core.agent", "--job-id", "j", "--node-id", "0", "--master-addr", "m:80",
                     "--log-dir", "/l")
    assert control_plane.for_node(agent, 5)[6] == "5"
    assert control_plane.with_master_addr(agent, "n:81")[8] == "n:81"
    with pytest.raises(SchedulerError, match="--node-id"):
        control_plane.for_node(("py", "-m", "x"), 1)


def test_node_process_is_the_agent_of_another_node():
    """node_process changes the command line, the name and the log file, nothing else."""
    agent = control_plane.agent_process(python="py", job_id="j", node_id=0, master_addr="m:1", log_dir="/run",
                                        variables={"X": "1"}, cwd="/w")
    assert agent.log_file == "/run/node_0.log" and agent.name == "node-0"
    other = control_plane.node_process(agent, 7)
    assert (other.name, other.log_file, other.argv[6]) == ("node-7", "/run/node_7.log", "7")
    assert (other.env, other.cwd, other.role) == (agent.env, agent.cwd, "agent")
    master = control_plane.master_process(python="py", job_id="j", host="h", port=1, store_host="h", log_dir="/run",
                                          variables={}, cwd="/w")
    assert master.log_file == "/run/master.log"
    with pytest.raises(SchedulerError):
        control_plane.node_process(master, 1)


@pytest.mark.parametrize(("job_env", "environ", "nproc", "cores", "sharing", "expected"), [
    # local and docker: this machine's cores, split between every worker of every node
    ({}, {}, 2, 16, 2, "4"),
    ({}, {}, 4, 2, 2, "1"),                        # never below 1
    ({}, {"OMP_NUM_THREADS": "3"}, 2, 16, 2, None),  # the submitter's own setting is inherited
    ({"OMP_NUM_THREADS": "5"}, {}, 2, 16, 2, None),  # the Job's wins
    # k8s: the pod's CPU request between its workers (no environment is inherited)
    ({}, None, 2, 7.5, 1, "3"),
    ({}, None, 4, 0.5, 1, "1"),
    # an agent: "1" for several workers, as torchrun does; one worker keeps the default
    ({}, {}, 2, None, 1, "1"),
    ({}, {}, 1, None, 1, None),
    ({}, {"OMP_NUM_THREADS": "8"}, 2, None, 1, None),
])
def test_the_thread_rule(job_env, environ, nproc, cores, sharing, expected):
    """OMP_NUM_THREADS as each backend sets it today."""
    job = _job(env=job_env)
    assert control_plane.omp_num_threads(job, nproc=nproc, environ=environ, cores=cores,
                                         nodes_sharing=sharing) == expected


def test_job_env_order_and_agent_env():
    """job_env: the Job, its id, the run directory, unbuffered output, then the backend's."""
    base = control_plane.job_env(_job(), job_id="j", log_dir="/l", extra={"X": "1"})
    assert list(base) == [env.JOB_SPEC, env.JOB_ID, env.LOG_DIR, "PYTHONUNBUFFERED", "X"]
    agent = control_plane.agent_env(base, accelerator="cpu", master_addr="m:1")
    assert (agent[env.ACCELERATOR], agent[env.MASTER_ADDR]) == ("cpu", "m:1")


def test_the_local_plan_is_made_of_the_descriptions(tmp_path, monkeypatch):
    """The local backend's processes are the control plane's, one agent per node."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(control_plane, "host_cores", lambda: 8)
    (tmp_path / "train.py").write_text("")
    plan = _job(nodes=Nodes(min=2, max=2, nproc_per_node=2), accelerator="cpu", workdir=str(tmp_path),
                log_dir=str(tmp_path / "runs")).dryrun()
    master, *agents = plan.processes
    assert master.argv[2] == "dlrover_core.master" and master.log_file == str(Path(plan.log_dir) / "master.log")
    assert [a.argv[6] for a in agents] == ["0", "1"]
    assert master.env[control_plane.OMP_NUM_THREADS] == "2"  # 8 cores / (2 nodes x 2 workers)
    assert control_plane.decode_job(master.env[env.JOB_SPEC]).to_dict() == plan.job.to_dict()
    assert agents[1] == control_plane.node_process(agents[0], 1)


def test_submission_round_trips(tmp_path):
    """What submit persists reads back typed: the Job, the request, the processes."""
    job = _spec()
    proc = ProcessSpec(role="agent", name="node-0", argv=("a", "b"), env={"X": "1"}, cwd="/", log_file="/l")
    plan = Plan(scheduler="local", job_id="j", job=job, log_dir=str(tmp_path),
                request=LocalRequest(master_addr="h:1", addr_file="/f"), processes=(proc,))
    (tmp_path / rundir.REQUEST).write_text(Submission.of(plan).to_json())
    back = LocalScheduler().submission(JobHandle(scheduler="local", job_id="j", log_dir=str(tmp_path)))
    assert back == Submission.of(plan)
    docker = DockerRequest.parse('{"network": {"name": "n"}, "containers": []}', docker_host="unix:///x")
    text = Submission(scheduler="docker", job_id="j", log_dir="/", job=job, request=docker).to_json()
    assert Submission.from_json(text, DockerRequest).request == docker


def test_no_submission_is_an_error(tmp_path):
    """A run directory without request.json (or another backend's) is a SchedulerError."""
    handle = JobHandle(scheduler="local", job_id="j", log_dir=str(tmp_path))
    with pytest.raises(SchedulerError, match="request.json"):
        LocalScheduler().submission(handle)
    plan = Plan(scheduler="other", job_id="j", job=_job(), log_dir=str(tmp_path))
    (tmp_path / rundir.REQUEST).write_text(Submission.of(plan).to_json())
    with pytest.raises(SchedulerError, match="other"):
        LocalScheduler().submission(handle)


def test_run_directory_names():
    """Every file of a run directory, by name."""
    run = rundir.RunDir("/r")
    assert [p.name for p in (run.plan, run.request, run.job, run.handle, run.master_addr, run.master_log,
                             run.journal, run.journal_log, run.events, run.goodput, run.result)] == [
        "plan.txt", "request.json", "job.json", "handle.json", "master_addr", "master.log",
        "master_journal.json", "master_journal.log", "events.jsonl", "goodput.json", "result.json"]
    assert str(run.node_log(3)) == "/r/node_3.log"
    assert rundir.node_log(3, "2") == "node_3.log.2" and rundir.node_log(3, "0") == "node_3.log"
    assert str(run.rank_log(1, 4)) == "/r/node_1/rank_4.log"
    assert str(run.progress_file(1, 2, 4)) == "/r/node_1/round_2/progress_rank4.jsonl"
    assert str(run.progress_file(1, 2, 4, replacement=3)) == "/r/node_1/round_2/progress_rank4_r3.jsonl"
    assert str(run.error_file(1, 2, 4)) == "/r/node_1/round_2/error_rank4.json"
    assert str(run.stack_file(1, 2, 4)) == "/r/node_1/stacks_round2_rank4.txt"
    assert rundir.progress_glob() == "node_*/round_*/progress_*.jsonl"
    assert (rundir.node_of_dir("node_12"), rundir.node_of_dir("node_x"), rundir.round_of_dir("round_3")) == (12, None, 3)
    assert (rundir.node_of_log("node_2.log.1"), rundir.node_of_log("master.log")) == (2, None)
    assert rundir.slurm_relaunch_log(4) == "slurm/relaunch_node_4.log"
