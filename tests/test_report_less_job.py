"""A job whose script never calls ``train.report``: the summary and ``dlrover status`` show
what is known (wall time, restarts, worker exit codes) and say that step and goodput need
``train.report``, instead of "final step -1" and "goodput 0.0%"."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import pytest

from dlrover_core import JobState
from dlrover_core.protocol.result import NO_STEPS_NOTE, FailureRecord, JobResult, format_exit_codes

DLROVER = [sys.executable, "-m", "dlrover_core.cli"]


def result(**fields) -> JobResult:
    base = dict(job_id="j-1", state=JobState.SUCCEEDED, reason="", final_step=-1, restarts=0, wall_time_s=12.34,
                productive_s=0.0, goodput=0.0, checkpoint_stall_s=0.0, restore_s=0.0, recomputed_s=0.0, detection_s=0.0,
                restart_s=0.0, rendezvous_s=0.5, startup_s=0.0, failures=(), metrics={}, log_dir="runs/j-1",
                worker_exit_codes={0: 0, 1: 0, 2: 0})
    return JobResult(**{**base, **fields})


def assert_no_unmeasured_numbers(text: str) -> None:
    assert "final step" not in text and "step -1" not in text and "0.0%" not in text and "goodput 0" not in text, text


def test_the_summary_says_what_is_known_and_what_train_report_would_add():
    text = result().summary()
    assert text.splitlines() == [
        "job j-1: SUCCEEDED",
        "  wall time 12.3 s, restarts 0",
        "  worker exit codes: ranks 0-2: 0",
        f"  {NO_STEPS_NOTE}",
        "  logs: runs/j-1",
    ]
    assert "train.report(step, ...)" in NO_STEPS_NOTE
    assert_no_unmeasured_numbers(text)
    record = result().to_record()
    assert record["event"] == "result" and record["note"] == NO_STEPS_NOTE


def test_a_failure_before_any_report_is_not_at_step_minus_one():
    failure = FailureRecord(time_s=3.2, round=0, node_id=0, rank=1, local_rank=1, exit_code=3, signal=None, step=-1,
                            last_committed_step=None, action="stopped: max_restarts=0 used")
    text = result(state=JobState.FAILED, reason="restart budget used", failures=(failure,),
                  worker_exit_codes={1: 3}).summary()
    assert "worker exit codes: rank 1: 3" in text
    assert "failure at 3.2 s, before any reported step: rank 1 exit code 3 → stopped" in text
    assert_no_unmeasured_numbers(text)


def test_a_job_that_reported_keeps_its_summary():
    text = result(final_step=99, total_steps=100, productive_s=6.0, goodput=0.5).summary()
    assert "final step 99 of 100, restarts 0, wall time 12.3 s" in text and "goodput 50.0%" in text
    assert NO_STEPS_NOTE not in text and "exit codes" not in text
    assert "note" not in result(final_step=0).to_record()


def test_exit_codes_read_as_runs_of_ranks_with_signal_names():
    assert format_exit_codes({0: 0, 1: 0, 2: -9, 3: 0, 5: 1}) == "ranks 0-1: 0, rank 2: -9 (SIGKILL), rank 3: 0, rank 5: 1"


def test_a_result_written_before_exit_codes_existed_still_reads():
    data = result().to_dict()
    del data["worker_exit_codes"], data["total_steps"]
    old = JobResult.from_dict(json.loads(json.dumps(data)))
    assert old.worker_exit_codes == {} and "exit codes" not in old.summary()
    assert JobResult.from_dict(json.loads(json.dumps(result().to_dict()))).worker_exit_codes == {0: 0, 1: 0, 2: 0}


# ----- real `dlrover run` jobs -----------------------------------------------------------------

NO_REPORT = textwrap.dedent("""
    import os, sys, time
    print(f"rank {os.environ['RANK']} works without train.report", flush=True)
    time.sleep(0.5)
    if os.environ["RANK"] == os.environ.get("FAIL_RANK"):
        sys.exit(3)
""")


def run(tmp_path, *args: str, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*DLROVER, "run", *args], cwd=tmp_path, capture_output=True, text=True, timeout=180,
                          env={**os.environ, "DLROVER_LOG_FORMAT": "console", **(env_extra or {})})


@pytest.mark.timeout(240)
def test_dlrover_run_without_train_report_ends_with_what_is_known(tmp_path):
    (tmp_path / "plain.py").write_text(NO_REPORT)
    proc = run(tmp_path, "--nproc-per-node", "2", "--log-dir", "runs", "plain.py")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[rank 0] rank 0 works without train.report" in proc.stdout  # the console format as it was
    summary = proc.stdout[proc.stdout.index("job plain-"):]
    job_id = re.match(r"job (\S+): SUCCEEDED\n", summary).group(1)
    lines = summary.splitlines()
    assert re.fullmatch(r"  wall time \d+\.\d s, restarts 0", lines[1]), summary
    assert lines[2] == "  worker exit codes: ranks 0-1: 0" and lines[3] == f"  {NO_STEPS_NOTE}", summary
    assert_no_unmeasured_numbers(summary)

    status = subprocess.run([*DLROVER, "status", job_id, "--log-dir", "runs"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    assert "SUCCEEDED" in status.stdout and "worker exit codes: ranks 0-1: 0" in status.stdout
    assert NO_STEPS_NOTE in status.stdout and "│ goodput" not in status.stdout and "productive" not in status.stdout
    assert re.search(r"\n  succeeded \| restarts 0 \| \d+ s\n", status.stdout), status.stdout
    data = json.loads(subprocess.run([*DLROVER, "status", job_id, "--log-dir", "runs", "--json"], cwd=tmp_path,
                                     capture_output=True, text=True, timeout=60).stdout)
    assert data["note"] == NO_STEPS_NOTE and data["progress"]["step"] is None and data["progress"]["goodput"] is None
    assert data["result"]["worker_exit_codes"] == {"0": 0, "1": 0}


@pytest.mark.timeout(240)
def test_a_failed_report_less_job_shows_the_exit_code_that_ended_it(tmp_path):
    (tmp_path / "plain.py").write_text(NO_REPORT)
    proc = run(tmp_path, "--nproc-per-node", "2", "--max-restarts", "0", "--log-dir", "runs", "plain.py",
               env_extra={"FAIL_RANK": "1"})
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = proc.stdout[proc.stdout.index("job plain-"):]
    assert summary.startswith("job plain-") and ": FAILED" in summary.splitlines()[0], summary
    assert "worker exit codes: rank 1: 3" in summary, summary
    assert re.search(r"failure at \d+\.\d s, before any reported step: rank 1 exit code 3 → ", summary), summary
    assert NO_STEPS_NOTE in summary
    assert_no_unmeasured_numbers(summary)
