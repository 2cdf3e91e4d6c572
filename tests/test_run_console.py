"""What a ``dlrover run`` user sees: on the job master's host the progress line ``Job.run()``
shows (live on a terminal, plain lines with ``--progress``), the result's summary at the end —
after Ctrl-C or SIGTERM too — and one exit code convention for ``dlrover run`` and the commands
built on ``Job.run()``: 0 succeeded, 1 failed, 128+N stopped by signal N (130, 143). A Ctrl-C in
the first moments of ``dlrover run``, before its job master or agent could handle signals,
still ends in a CANCELLED ``result.json`` that ``dlrover status`` reports, with nothing left
running. Real processes and real signals throughout.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import textwrap
import time
from pathlib import Path

import pytest
from helpers import job_processes, shm_entries, wait_for

from dlrover_core import JobState
from dlrover_core.display import exit_code
from dlrover_core.protocol import JobResult

DLROVER = [sys.executable, "-m", "dlrover_core.cli"]

#: A short job that reports its steps (no torch: it starts fast) and prints one line a step.
REPORTING = """
    import os, time
    from dlrover_core import train
    for step in range(8):
        time.sleep(float(os.environ.get("STEP_S", "0.2")))
        print(f"step {step} done", flush=True)
        train.report(step, total_steps=8, samples=16, loss=1.0 / (step + 1))
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DLROVER_LOG_FORMAT"}
    return {**env, **extra}


def _handles_sigterm(pid: int) -> bool:
    """Whether ``pid`` has a SIGTERM handler (``SigCgt`` in /proc: Python alone installs none,
    so this says that ``dlrover run``'s first instruction, arming its stop latch, has run)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(caught >> (signal.SIGTERM - 1) & 1)


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)


def _status(tmp: Path, *args: str) -> str:
    done = subprocess.run([*DLROVER, "status", *args], cwd=tmp, capture_output=True, text=True, timeout=60, env=_env())
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_exit_code_is_0_1_or_128_plus_the_stopping_signal():
    def result(state: JobState) -> JobResult:
        return JobResult(job_id="j", state=state, reason="", final_step=-1, restarts=0, wall_time_s=1.0,
                         productive_s=0.0, goodput=0.0, checkpoint_stall_s=0.0, restore_s=0.0, recomputed_s=0.0,
                         detection_s=0.0, restart_s=0.0, rendezvous_s=0.0, startup_s=0.0, failures=(), metrics={},
                         log_dir="")

    assert exit_code(result(JobState.SUCCEEDED)) == 0
    assert exit_code(result(JobState.SUCCEEDED), signal.SIGINT) == 0  # it finished as the signal came
    assert exit_code(result(JobState.FAILED)) == 1
    assert exit_code(result(JobState.FAILED), signal.SIGTERM) == 1  # it had failed already
    assert exit_code(result(JobState.CANCELLED)) == 1  # cancelled from elsewhere (dlrover cancel)
    assert exit_code(result(JobState.CANCELLED), signal.SIGINT) == 130
    assert exit_code(result(JobState.CANCELLED), signal.SIGTERM) == 143
    assert exit_code(None, signal.SIGINT) == 130 and exit_code(None) == 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("delay_s", [0.05, 0.3, 1.0])
def test_a_ctrl_c_in_the_first_moments_of_dlrover_run_ends_in_a_cancelled_result(tmp_path, delay_s):
    """SIGINT to ``dlrover run``'s process group ``delay_s`` after it started (0.05 s: it is
    still importing; 0.3 s: loading plugins or forking; 1 s: its master and agent are starting
    or started): exit 130, the summary, ``result.json`` CANCELLED naming SIGINT, ``dlrover
    status`` (by run directory and by job id) says CANCELLED, no process and no shared memory
    of the job is left. (The wait for the first instruction: a signal before Python runs a
    line of dlrover is the interpreter's, ~30 ms, and no launcher's to handle.)"""
    shm_before = shm_entries()
    job_id = f"early{int(delay_s * 100)}"
    (tmp_path / "wait.py").write_text("import time\ntime.sleep(60)\n")
    started = time.monotonic()
    proc = subprocess.Popen([*DLROVER, "run", "--nproc-per-node", "1", "--accelerator", "cpu", "--log-dir", "runs",
                             "--rdzv-id", job_id, "wait.py"], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        wait_for(lambda: proc.poll() is not None or _handles_sigterm(proc.pid), 30, "dlrover run's first instruction",
                 poll_s=0.002)
        time.sleep(max(0.0, delay_s - (time.monotonic() - started)))
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=90)
    finally:
        _end(proc)
    assert proc.returncode == 130, out[-3000:]
    result = json.loads((tmp_path / "runs" / job_id / "result.json").read_text())
    assert result["state"] == "CANCELLED" and "SIGINT" in result["reason"], result
    assert f"job {job_id}: CANCELLED" in out, out[-3000:]  # the summary
    assert _status(tmp_path, f"runs/{job_id}").startswith(f"job {job_id} (local://{job_id}): CANCELLED")
    assert "CANCELLED" in _status(tmp_path, job_id, "--log-dir", "runs").splitlines()[0]
    assert job_processes(job_id) == []
    assert {e for e in shm_entries() - shm_before if job_id in e} == set()


@pytest.mark.timeout(120)
def test_job_run_cancelled_by_sigterm_exits_143_with_its_summary_as_dlrover_run_does(tmp_path):
    """``dlrover run --simulate-nodes`` runs ``Job.run()``: SIGTERM while it runs cancels the
    job, prints the summary and exits 143, as ``dlrover run`` on a host does (it used to die
    at once, leaving the summary out; Ctrl-C gave 1 there and 130 here)."""
    (tmp_path / "wait.py").write_text("import time\ntime.sleep(60)\n")
    proc = subprocess.Popen([*DLROVER, "run", "--simulate-nodes", "1", "--nproc-per-node", "1", "--accelerator", "cpu",
                             "--log-dir", "runs", "wait.py"], cwd=tmp_path, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # Job.run()'s plain progress line, once the job runs
            lines.append(line)
            if line.startswith("progress: running"):
                break
        os.killpg(proc.pid, signal.SIGTERM)
        out = "".join(lines) + proc.communicate(timeout=90)[0]
    finally:
        _end(proc)
    assert proc.returncode == 143, out[-3000:]
    assert "interrupted: SIGTERM: cancelling the job" in out
    summary = re.search(r"^job (\S+): CANCELLED", out, re.MULTILINE)
    assert summary is not None, out[-3000:]
    job_id = summary.group(1)
    assert json.loads((tmp_path / "runs" / job_id / "result.json").read_text())["state"] == "CANCELLED"
    assert job_processes(job_id) == []


def _read_all(fd: int, proc: subprocess.Popen, timeout_s: float) -> bytes:
    chunks, deadline = [], time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 0.2)
        if ready:
            try:
                data = os.read(fd, 65536)
            except OSError:  # EIO: the terminal's other side closed (every writer exited)
                break
            if not data:
                break
            chunks.append(data)
        elif proc.poll() is not None:
            break
    return b"".join(chunks)


@pytest.mark.timeout(120)
def test_on_a_terminal_dlrover_run_draws_job_runs_live_line_with_the_workers_output_above_it(tmp_path):
    """stdout a terminal: the live progress line (step/total, percent) is drawn as ``Job.run()``
    draws it, the workers' lines still come (through the launcher, above the line), and the
    summary closes it."""
    (tmp_path / "report.py").write_text(textwrap.dedent(REPORTING))
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 220, 0, 0))  # wide: no wrapped lines
    proc = subprocess.Popen([*DLROVER, "run", "--nproc-per-node", "1", "--accelerator", "cpu", "--log-dir", "runs",
                             "--rdzv-id", "tty", "report.py"], cwd=tmp_path, env=_env(TERM="xterm"),
                            stdin=subprocess.DEVNULL, stdout=follower, stderr=follower, start_new_session=True)
    os.close(follower)
    try:
        text = _read_all(leader, proc, 90).decode(errors="replace")
        proc.wait(timeout=30)
    finally:
        os.close(leader)
        _end(proc)
    assert proc.returncode == 0, text[-3000:]
    assert re.search(r"(running|succeeded) \| step \d/8 \(\d+%\)", text), text[-3000:]
    assert all(f"[rank 0] step {step} done" in text for step in range(8)), text[-3000:]
    assert "job tty: SUCCEEDED" in text and "final step 7 of 8" in text, text[-3000:]


@pytest.mark.timeout(120)
def test_piped_it_prints_progress_lines_when_asked(tmp_path):
    """Not a terminal: ``--progress`` prints Job.run()'s plain ``progress:`` lines (by default
    none: the output is torchrun's, as the other tests of ``dlrover run`` check; in JSON mode
    none either, tests/test_json_logs.py), then the summary."""
    (tmp_path / "report.py").write_text(textwrap.dedent(REPORTING))
    asked = subprocess.run([*DLROVER, "run", "--progress", "--nproc-per-node", "1", "--accelerator", "cpu",
                            "--log-dir", "runs", "--rdzv-id", "piped", "report.py"], cwd=tmp_path, env=_env(STEP_S="0.1"),
                           capture_output=True, text=True, timeout=90)
    assert asked.returncode == 0, asked.stdout[-3000:] + asked.stderr[-3000:]
    assert re.search(r"^progress: \w+ \| .*restarts 0 \| \d+ s$", asked.stdout, re.MULTILINE), asked.stdout
    assert "job piped: SUCCEEDED" in asked.stdout and "final step 7 of 8" in asked.stdout


def test_only_a_dlrover_run_process_keeps_its_stop_signals_from_its_first_line():
    from dlrover_core.stoplatch import _is_dlrover_run

    assert _is_dlrover_run(["/venv/bin/dlrover", "run", "train.py"], [])
    assert _is_dlrover_run([".../dlrover_core/cli.py", "run"], ["python", "-u", "-m", "dlrover_core.cli", "run", "t.py"])
    assert not _is_dlrover_run(["/venv/bin/dlrover", "status", "job"], [])  # Ctrl-C stops `dlrover status` at once
    assert not _is_dlrover_run(["-m"], ["python", "-m", "dlrover_core.cli", "logs", "-f", "job"])
    assert not _is_dlrover_run(["train.py", "run"], ["python", "train.py", "run"])  # a worker: its signals are its own
    assert not _is_dlrover_run([".../pytest", "run"], ["python", "-m", "pytest", "run"])
