"""`dlrover submit JOB_FILE`, then `dlrover status|logs|cancel JOB_ID` from other processes,
as a user drives a job from a shell (local scheduler here; the same commands serve every
backend through the job's `job.json` handle)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import SCRIPTS, job_processes, shm_entries

DLROVER = [sys.executable, "-m", "dlrover_core.cli"]


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*DLROVER, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(240)
def test_submit_status_logs_cancel_from_the_command_line(tmp_path):
    shm_before = shm_entries()
    (tmp_path / "job.py").write_text(
        "from dlrover_core import Job, Failure\n"
        f"job = Job(name='clijob', entrypoint={str(SCRIPTS / 'tiny_train.py')!r}, args=['--steps', '100000'],\n"
        "          nodes=2, accelerator='cpu', failure=Failure(stop_grace_s=2), log_dir='runs')\n"
    )
    out = cli("submit", "job.py", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    job_id = re.search(r"submitted local://(\S+)", out.stdout).group(1)
    try:
        deadline = time.monotonic() + 120
        while True:
            st = cli("status", job_id, "--log-dir", "runs", "--json", cwd=tmp_path)
            assert st.returncode == 0, st.stderr
            data = json.loads(st.stdout)
            if data["step"] >= 3:
                break
            assert time.monotonic() < deadline, data
            time.sleep(0.5)
        assert data["state"] == "RUNNING" and data["scheduler"] == "local" and data["nodes"] == 2
        logs = cli("logs", job_id, "--log-dir", "runs", cwd=tmp_path)
        assert logs.returncode == 0 and "[rank 0]" in logs.stdout or "rank=0" in logs.stdout, logs.stdout[-2000:]
    finally:
        done = cli("cancel", job_id, "--log-dir", "runs", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "CANCELLED" in done.stdout
    assert json.loads(cli("status", job_id, "--log-dir", "runs", "--json", cwd=tmp_path).stdout)["state"] == "CANCELLED"
    assert job_processes(job_id) == []
    assert {e for e in shm_entries() - shm_before if job_id in e} == set()  # other jobs may run meanwhile


def test_unknown_job_and_bad_job_file_say_what_to_do(tmp_path):
    out = cli("status", "nope", "--log-dir", "runs", cwd=tmp_path)
    assert out.returncode != 0 and "no job 'nope' under 'runs'" in out.stderr
    (tmp_path / "empty.py").write_text("x = 1\n")
    out = cli("submit", "empty.py", cwd=tmp_path)
    assert out.returncode != 0 and "must define `job = Job(...)`" in out.stderr
    (tmp_path / "job.py").write_text("from dlrover_core import Job\njob = Job(name='j', entrypoint='json.tool')\n")
    out = cli("submit", "job.py", "--scheduler", "nosuch", cwd=tmp_path)
    assert out.returncode != 0 and "scheduler" in out.stderr and "local" in out.stderr


def test_submit_dryrun_prints_the_native_request(tmp_path):
    (tmp_path / "job.py").write_text("from dlrover_core import Job\njob = Job(name='j', entrypoint='json.tool', nodes=2)\n")
    out = cli("submit", "job.py", "--dryrun", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "# plan: scheduler=local" in out.stdout and "dlrover_core.agent" in out.stdout
