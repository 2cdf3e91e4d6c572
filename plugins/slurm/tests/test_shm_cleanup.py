"""A SIGKILLed agent's shared memory is removed on its own compute node, by the node's srun task
(:mod:`dlrover_plugin_slurm.node_task`).

The first tests run the task directly, with a stand-in agent and a private segment directory
(``DLROVER_SHM_DIR``), so nothing of /dev/shm is touched. The last one runs a job on the real
Slurm cluster of conftest.py: node 1's agent is SIGKILLed and, with ``max_node_failures=1``,
excluded and replaced under a new node id elsewhere, so no later agent of node 1 would ever
clean up after it; its segments must still be gone while the job goes on.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from dlrover_plugin_slurm._script import render_sbatch

#: A stand-in agent: creates its node's segments (and ones of another node and of another job,
#: which must stay), starts a "worker" that holds one open and does not die with it, writes the
#: worker's pid to argv[1], then ends as the test says (argv[2]: "kill", "exit", "wait-term").
FAKE_AGENT = textwrap.dedent('''
    import os, signal, subprocess, sys, time
    shm = os.environ["DLROVER_SHM_DIR"]
    for name in ("dlrover-jobx-n3-r0-s0", "dlrover-jobx-n3-r0-s1", "dlrover-jobx-n4-r1-s0", "dlrover-joby-n3-r0-s0"):
        with open(os.path.join(shm, name), "wb") as f:
            f.write(b"snapshot")
    worker = subprocess.Popen([sys.executable, "-c",
                               "import sys, time; f = open(sys.argv[1], 'rb'); time.sleep(600)",
                               os.path.join(shm, "dlrover-jobx-n3-r0-s0")], start_new_session=True)
    with open(sys.argv[1], "w") as f:
        f.write(str(worker.pid))
    time.sleep(0.3)  # the worker has opened its segment
    if sys.argv[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if sys.argv[2] == "wait-term":
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        print("ready", flush=True)
        time.sleep(60)
    worker.kill()
    worker.wait()
    sys.exit(3)
''')


def _run_task(tmp_path: Path, how: str, **popen) -> subprocess.Popen:
    """Start ``run_agent`` on the stand-in agent as the srun task would, in its own process."""
    shm = tmp_path / "shm"
    shm.mkdir(exist_ok=True)
    agent = tmp_path / "agent.py"
    agent.write_text(FAKE_AGENT)
    code = ("import sys; from dlrover_plugin_slurm.node_task import run_agent; "
            f"sys.exit(run_agent([sys.executable, {str(agent)!r}, {str(tmp_path / 'worker.pid')!r}, {how!r}], "
            "job_id='jobx', node_id='3'))")
    return subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "DLROVER_SHM_DIR": str(shm)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.timeout(60)
def test_a_sigkilled_agents_segments_are_removed_by_its_task(tmp_path):
    """The agent is SIGKILLed: the task kills its orphaned worker, removes node 3's segments of
    job ``jobx`` (only those), logs it, and exits 137 like the agent."""
    task = _run_task(tmp_path, "kill")
    out, _ = task.communicate(timeout=50)
    assert task.returncode == 128 + signal.SIGKILL, out
    assert sorted(p.name for p in (tmp_path / "shm").iterdir()) == ["dlrover-jobx-n4-r1-s0", "dlrover-joby-n3-r0-s0"]
    assert _gone(int((tmp_path / "worker.pid").read_text()))  # the worker that outlived the agent
    assert "slurm_node_segments_removed" in out and "dlrover-jobx-n3-r0-s1" in out and "SIGKILL" in out, out


@pytest.mark.timeout(60)
def test_segments_a_live_process_holds_are_kept(tmp_path):
    """A segment of the same node that another live process (say a replacement agent on the
    same machine) has open is not removed."""
    shm = tmp_path / "shm"
    shm.mkdir()
    held = shm / "dlrover-jobx-n3-r0-s9"
    held.write_bytes(b"live")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1]); time.sleep(60)",
                               str(held)])
    try:
        deadline = time.monotonic() + 10
        while not any(f.path == str(held) for f in psutil.Process(holder.pid).open_files()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        task = _run_task(tmp_path, "kill")
        out, _ = task.communicate(timeout=50)
    finally:
        holder.kill()
        holder.wait()
    assert task.returncode == 137, out
    assert held.exists() and not (shm / "dlrover-jobx-n3-r0-s0").exists()
    assert "kept_in_use" in out and "dlrover-jobx-n3-r0-s9" in out, out


@pytest.mark.timeout(60)
def test_an_agent_that_exits_by_itself_keeps_its_code_and_cleans_up_itself(tmp_path):
    """An agent that exits by itself has removed its own segments: the task removes nothing,
    and passes the exit code on."""
    task = _run_task(tmp_path, "exit")
    out, _ = task.communicate(timeout=50)
    assert task.returncode == 3, out
    assert (tmp_path / "shm" / "dlrover-jobx-n3-r0-s1").exists()
    assert "slurm_node_segments_removed" not in out


@pytest.mark.timeout(60)
def test_signals_to_the_task_reach_the_agent(tmp_path):
    """SIGTERM to the task (Slurm's scancel, a requeue) is passed on to the agent, whose own
    exit code (143 after a clean stop) the task returns."""
    task = _run_task(tmp_path, "wait-term")
    assert task.stdout.readline().strip() == "ready"
    task.send_signal(signal.SIGTERM)
    out, _ = task.communicate(timeout=50)
    assert task.returncode == 143, out


def test_srun_runs_the_node_task(tmp_path):
    """The batch script's srun starts the node task (not the bare agent), with the node id
    Slurm gives each task."""
    from dlrover_core import Job

    job = Job(name="tiny", entrypoint="json.tool", nodes=2, accelerator="cpu", workdir=str(tmp_path))
    script = render_sbatch(job, job_id="tiny-1", log_dir=str(tmp_path / "runs" / "tiny-1"), python="/py", gres=None)
    srun = next(line for line in script.splitlines() if "-m dlrover_plugin_slurm.node_task" in line)
    assert srun.strip().startswith("bash -c 'exec /py -m dlrover_plugin_slurm.node_task --job-id tiny-1 --node-id "
                                   '"$SLURM_NODEID" --master-addr "$DLROVER_MASTER_ADDR"'), srun
    assert "dlrover_core.agent" not in script


# ----- on the real Slurm cluster ----------------------------------------------------------------


def _node_segments(job_id: str, node: int) -> list[str]:
    from dlrover_core.checkpoint.shm import SHM_DIR

    return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(f"dlrover-{job_id}-n{node}-"))


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_on_slurm_a_sigkilled_agents_memory_is_removed_on_its_node(slurm_cluster, tmp_path):
    """SIGKILL of node 1's agent in a running 2-node job: node 1's segments disappear at once,
    by node 1's own srun task (its event is in node 1's log), before the master has even
    declared the node lost (heartbeat timeout 8 s), so not by a relaunched agent of node 1,
    nor by anything on the submitting side. The relaunched agent runs under the task too."""
    from dlrover_core import Job
    from dlrover_core.protocol import JobState
    from dlrover_core.spec import Checkpoint, Failure

    tiny = Path(__file__).resolve().parents[3] / "tests" / "scripts" / "tiny_train.py"
    job = Job(name="tiny", entrypoint=str(tiny), args=["--steps", "400", "--step-sleep", "0.1"], nodes=2,
              accelerator="cpu", scheduler="slurm", workdir=str(tmp_path), log_dir=str(tmp_path / "runs"),
              checkpoint=Checkpoint(dir=str(tmp_path / "ckpt"), persist_every_steps=5),
              failure=Failure(heartbeat_timeout_s=8.0, stop_grace_s=3.0), env={"OMP_NUM_THREADS": "1"})
    run = job.submit()
    log_dir = Path(run.handle.log_dir)

    def events() -> list[dict]:
        path = log_dir / "events.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []

    try:
        deadline = time.monotonic() + 90
        while run.status().step < 5 or not _node_segments(run.job_id, 1):
            assert time.monotonic() < deadline, f"no step 5 with node 1's snapshots: {run.status()}"
            time.sleep(0.3)
        agents = []
        for p in psutil.process_iter():
            try:
                cmd = p.cmdline()
                if (p.environ().get("DLROVER_JOB_ID") == run.job_id and "dlrover_core.agent" in cmd
                        and cmd[cmd.index("--node-id") + 1] == "1"):
                    agents.append(p)
            except (psutil.Error, ValueError, IndexError):
                continue
        assert len(agents) == 1, agents
        agents[0].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        while _node_segments(run.job_id, 1):
            assert time.monotonic() - killed_at < 6, f"node 1's segments outlived its agent: {_node_segments(run.job_id, 1)}"
            time.sleep(0.1)
        assert not [e for e in events() if e["kind"] in ("node_lost", "node_relaunched")], events()
        assert run.status().state == JobState.RUNNING
        log = (log_dir / "node_1.log").read_text()
        assert "slurm_node_segments_removed" in log and "SIGKILL" in log, log[-3000:]
        relaunch_log = log_dir / "slurm" / "relaunch_node_1.log"
        deadline = time.monotonic() + 60
        while not (relaunch_log.exists() and relaunch_log.read_text().strip()):
            assert time.monotonic() < deadline, f"the master did not relaunch node 1: {events()}"
            time.sleep(0.3)
        srun = relaunch_log.read_text().splitlines()[0]
        assert "-m dlrover_plugin_slurm.node_task" in srun and "--node-id 1" in srun, srun
    finally:
        run.cancel()
