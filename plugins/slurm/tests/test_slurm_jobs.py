"""Jobs on a real Slurm cluster (slurmctld and two slurmd on this machine, see conftest.py):
a 2-node job to SUCCEEDED, an agent killed and relaunched as a new srun step, scancel, and
the time-limit warning that requeues the job and resumes it from its breakpoint checkpoint.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest

from dlrover_core import Job
from dlrover_core.checkpoint.shm import SHM_DIR, SnapshotSlot
from dlrover_core.protocol import JobState
from dlrover_core.runner import JobRun
from dlrover_core.scheduler_backend import JobHandle
from dlrover_core.spec import Checkpoint, Failure
from dlrover_plugin_slurm import SlurmScheduler

pytestmark = pytest.mark.slow

TINY = Path(__file__).resolve().parents[3] / "tests" / "scripts" / "tiny_train.py"


def _job(tmp_path: Path, *, steps: int, step_sleep: float = 0.1, persist_every: int = 5, **overrides) -> Job:
    fields = dict(
        name="tiny", entrypoint=str(TINY), args=["--steps", str(steps), "--step-sleep", str(step_sleep)], nodes=2,
        accelerator="cpu", scheduler="slurm", workdir=str(tmp_path), log_dir=str(tmp_path / "runs"),
        checkpoint=Checkpoint(dir=str(tmp_path / "ckpt"), persist_every_steps=persist_every),
        failure=Failure(heartbeat_timeout_s=4.0, stop_grace_s=3.0), env={"OMP_NUM_THREADS": "1"},
    )
    fields.update(overrides)
    return Job(**fields)


def _job_processes(job_id: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter():
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.environ().get("DLROVER_JOB_ID") == job_id:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _segments(job_id: str) -> list[str]:
    try:
        return sorted(n for n in SHM_DIR.iterdir() if n.name.startswith(f"dlrover-{job_id}-"))
    except FileNotFoundError:
        return []


def _events(run: JobRun) -> list[dict]:
    path = Path(run.handle.log_dir) / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _newest_snapshots(job_id: str) -> dict[int, int]:
    """rank -> the step of its newest complete snapshot in this host's shared memory (its own
    slots and the replicas of it the buddy holds, never newer than its own)."""
    newest: dict[int, int] = {}
    for path in _segments(job_id):
        slot = SnapshotSlot.open(path.name, create=False)
        if slot is None:
            continue
        try:
            h = slot.header()
        finally:
            slot.close()
        if h is not None and h.valid:
            newest[h.rank] = max(h.step, newest.get(h.rank, -1))
    return newest


def _wait_step(run: JobRun, step: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while run.status().step < step:
        assert time.monotonic() < deadline, f"no step {step} within {timeout_s} s: {run.status()}"
        time.sleep(0.3)


@pytest.fixture
def submitted(slurm_cluster):
    """Submit jobs through this; whatever a test leaves is cancelled, and nothing of it may remain."""
    runs: list[JobRun] = []

    def submit(job: Job) -> JobRun:
        run = job.submit()
        runs.append(run)
        return run

    yield submit
    for run in runs:
        run.cancel()
        deadline = time.monotonic() + 30
        while _job_processes(run.job_id) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _job_processes(run.job_id) == [], f"processes of {run.job_id} outlived it"
        assert _segments(run.job_id) == [], f"shared memory of {run.job_id} outlived it"


@pytest.mark.timeout(60)
def test_sbatch_accepts_the_script(slurm_cluster, tmp_path):
    """The real controller accepts every #SBATCH option of a dry run (``sbatch --test-only``)."""
    plan = _job(tmp_path, steps=5).dryrun()
    script = tmp_path / "job.sbatch"
    script.write_text(plan.files["job.sbatch"])
    out = slurm_cluster.run("sbatch", "--test-only", str(script), check=False)
    assert out.returncode == 0 and "to start at" in out.stderr, out.stderr


@pytest.mark.timeout(60)
def test_job_slurm_cannot_start_stays_pending_until_cancelled(submitted, tmp_path):
    """A job asking for more nodes than the partition has stays PENDING with Slurm's reason;
    cancel() ends it, and since no master ever ran, its result says it was cancelled."""
    run = submitted(_job(tmp_path, steps=5, nodes=3))
    status = run.status()
    assert status.state == JobState.PENDING and "(Partition" in status.message, status  # its reason
    run.cancel()
    result = run.backend.result(run.handle)
    assert result.state == JobState.CANCELLED and "before the master wrote a result" in result.reason
    assert run.status().state == JobState.CANCELLED


@pytest.mark.timeout(120)
def test_two_node_job_succeeds(submitted, slurm_cluster, tmp_path):
    """A 2-node job trains to SUCCEEDED: the master runs in the batch script on the first node,
    srun starts one agent per node, each node writes its log, and Slurm records COMPLETED."""
    run = submitted(_job(tmp_path, steps=12, step_sleep=0.0))
    result = run.wait(progress=False, timeout_s=100)
    assert result.state == JobState.SUCCEEDED, result.summary()
    assert result.final_step == 11 and result.restarts == 0
    log_dir = Path(run.handle.log_dir)
    for node in (0, 1):
        assert "agent_started" in (log_dir / f"node_{node}.log").read_text()
    assert "master_started" in (log_dir / "master.log").read_text()
    # a new process, given only the job's id and log directory, finds the same job
    handle = JobHandle(scheduler="slurm", job_id=run.job_id, log_dir=run.handle.log_dir)
    fresh = SlurmScheduler()
    assert fresh.result(handle).state == JobState.SUCCEEDED
    assert fresh.status(handle).state == JobState.SUCCEEDED
    deadline = time.monotonic() + 30
    while slurm_cluster.run("squeue", "--noheader", "--states=all", f"--jobs={run.handle.native_id}",
                            "--format=%T").stdout.strip() != "COMPLETED":
        assert time.monotonic() < deadline, "Slurm did not record the job COMPLETED"
        time.sleep(0.5)
    lines = list(fresh.logs(handle))
    assert any(line.startswith("[node-1] ") and "workers_succeeded" in line for line in lines)


@pytest.mark.timeout(150)
def test_killed_agent_is_relaunched_as_a_new_srun_step(submitted, tmp_path, capsys):
    """SIGKILL of node 1's agent: the master declares the node lost, relaunches its agent as a
    new srun step of the same Slurm job (on the same, healthy Slurm node), the job restarts
    from its last checkpoint and finishes SUCCEEDED."""
    run = submitted(_job(tmp_path, steps=50))
    killed: list[int] = []

    def kill_node_1() -> None:
        _wait_step(run, 10, 90)
        for p in _job_processes(run.job_id):
            try:
                cmd = p.cmdline()
                if "dlrover_core.agent" in cmd and cmd[cmd.index("--node-id") + 1] == "1":
                    p.send_signal(signal.SIGKILL)
                    killed.append(p.pid)
            except psutil.Error:
                continue

    killer = threading.Thread(target=kill_node_1, daemon=True)
    killer.start()
    result = run.wait(progress=True, timeout_s=130)
    killer.join(5)
    assert len(killed) == 1
    assert result.state == JobState.SUCCEEDED, result.summary()
    assert result.final_step == 49 and result.restarts >= 1
    relaunched = [e for e in _events(run) if e["kind"] == "node_relaunched"]
    assert relaunched and relaunched[0]["node_id"] == 1
    log_dir = Path(run.handle.log_dir)
    srun = (log_dir / "slurm" / "relaunch_node_1.log").read_text().splitlines()[0]
    assert srun.startswith(f"$ srun --jobid={run.handle.native_id} --nodes=1 --ntasks=1 --overlap")
    assert "--nodelist=n2" in srun and "--node-id 1" in srun
    assert json.loads((log_dir / "slurm" / "nodes.json").read_text())["1"] == "n2"
    out = capsys.readouterr().out
    assert "node_relaunch" in out and "SUCCEEDED" in out
    with capsys.disabled():  # the run's own account, for whoever reads the test output
        print("\n" + "\n".join(line for line in out.splitlines() if "node_" in line or "job " in line
                                or "failure at" in line or "restored" in line or "goodput" in line))


@pytest.mark.timeout(90)
def test_scancel_cancels_and_leaves_nothing(submitted, slurm_cluster, tmp_path):
    """``scancel`` of a running job: it reads CANCELLED (from a new process too), no process
    of the job and no shared-memory segment of it remain, and cancel() is then a no-op."""
    run = submitted(_job(tmp_path, steps=400))
    _wait_step(run, 3, 60)
    assert _segments(run.job_id), "a running job holds snapshots in shared memory"
    slurm_cluster.run("scancel", run.handle.native_id)
    handle = JobHandle(scheduler="slurm", job_id=run.job_id, log_dir=run.handle.log_dir)
    fresh = SlurmScheduler()
    deadline = time.monotonic() + 60
    while fresh.status(handle).state != JobState.CANCELLED:
        assert time.monotonic() < deadline, fresh.status(handle)
        time.sleep(0.5)
    deadline = time.monotonic() + 30
    while (_job_processes(run.job_id) or _segments(run.job_id)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _job_processes(run.job_id) == []
    assert _segments(run.job_id) == []
    fresh.cancel(handle)  # idempotent
    assert fresh.result(handle).state == JobState.CANCELLED


@pytest.mark.timeout(150)
def test_time_limit_warning_requeues_and_resumes_from_the_breakpoint(submitted, slurm_cluster, tmp_path):
    """Slurm's warning signal before the time limit (B:USR1) requeues the job; every agent saves
    its newest snapshot at the breakpoint on the SIGTERM that follows, and the requeued run
    resumes from there (not from the last scheduled persist) and finishes SUCCEEDED."""
    run = submitted(_job(tmp_path, steps=60, persist_every=1000))
    native = run.handle.native_id

    def warn_then_release() -> None:
        _wait_step(run, 15, 90)
        # and every rank's newest snapshot is of step 15 or later: with two nodes the
        # snapshots are replicated, and a rank snapshots at its replicas' pace, not every step
        deadline = time.monotonic() + 60
        while not ((newest := _newest_snapshots(run.job_id)) and len(newest) == 2 and min(newest.values()) >= 15):
            assert time.monotonic() < deadline, newest
            time.sleep(0.05)
        slurm_cluster.run("scancel", "--batch", "--signal=USR1", native)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            state = slurm_cluster.run("squeue", "--noheader", f"--jobs={native}", "--format=%T", check=False)
            if state.stdout.strip() == "PENDING":  # requeued; Slurm holds it a while: start it now
                slurm_cluster.run("scontrol", "update", f"JobId={native}", "StartTime=now")
                return
            time.sleep(0.3)

    driver = threading.Thread(target=warn_then_release, daemon=True)
    driver.start()
    result = run.wait(progress=False, timeout_s=130)
    driver.join(5)
    assert result.state == JobState.SUCCEEDED, result.summary()
    assert result.final_step == 59
    log_dir = Path(run.handle.log_dir)
    assert json.loads((log_dir / "run_0" / "result.json").read_text())["state"] == "CANCELLED"
    restored = [e for e in _events(run) if e["kind"] == "checkpoint_restored"]
    assert restored and restored[-1]["step"] >= 15, restored
    assert "requeueing job" in (log_dir / "slurm.out").read_text()
