"""torchrun's error file (``TORCHELASTIC_ERROR_FILE``) and the root cause of a failure.

Each worker gets its own file, per incarnation; a script decorated with torch's ``@record``
writes the exception it dies of there; the agent reads it back, and the first failure of an
incident by the time it happened — not by the order the reports came in — is the root cause
that the summary, ``dlrover status`` and ``result.json`` name. The same ``@record`` script
runs under ``torchrun`` and ``dlrover run`` side by side.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import SCRIPTS, job_processes

from dlrover_core.agent.progress import exception_from_error_file
from dlrover_core.master.failures import mark_root_causes
from dlrover_core.protocol.result import FailureRecord

BIN = Path(sys.executable).parent


def test_the_error_file_of_torchs_record_is_read_with_its_time(tmp_path):
    """Both forms torch reads (``ProcessFailure._get_error_data``); the file's modification
    time, finer than the whole-second timestamp, when it falls in that second."""
    new = tmp_path / "error.json"
    stamp = int(time.time())
    new.write_text(json.dumps({"message": {"message": "ValueError: boom", "extraInfo": {
        "py_callstack": "Traceback (most recent call last):\n  ...\nValueError: boom\n", "timestamp": str(stamp)}}}))
    os.utime(new, (stamp + 0.25, stamp + 0.25))
    exc = exception_from_error_file(new, step=4)
    assert (exc.exc_type, exc.message, exc.step, exc.unix_time_s) == ("ValueError", "boom", 4, stamp + 0.25)
    assert exc.traceback.endswith("ValueError: boom\n") and not exc.before_first_step
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"message": "a worker's own words", "timestamp": stamp - 100}))
    exc = exception_from_error_file(old, step=-1)
    assert (exc.exc_type, exc.message, exc.unix_time_s, exc.before_first_step) == (
        "Exception", "a worker's own words", stamp - 100, True)  # (the file is newer than its second)
    assert exception_from_error_file(tmp_path / "missing.json", step=0) is None
    (tmp_path / "torn.json").write_text('{"message": {"mess')
    assert exception_from_error_file(tmp_path / "torn.json", step=0) is None


def rec(rank, round_index, t, recovery="", time_s=1.0):
    return FailureRecord(time_s=time_s, round=round_index, node_id=rank, rank=rank, local_rank=0, exit_code=1,
                         signal=None, step=3, last_committed_step=None, action="", recovery=recovery, unix_time_s=t)


@pytest.mark.parametrize(("records", "roots"), [
    # the consequence was reported first (it restarted every worker); the cause failed earlier
    ([rec(0, 0, 10.5, "restart_all"), rec(1, 0, 10.2)], [1]),
    # one per round
    ([rec(0, 0, 10.0, "restart_all"), rec(1, 0, 10.1), rec(1, 1, 20.0, "restart_all"), rec(0, 1, 19.9)], [0, 3]),
    # a live recovery is its own incident; a later restart-all incident in the same round too
    ([rec(1, 0, 5.0, "live"), rec(0, 0, 9.0, "restart_all"), rec(1, 0, 8.5)], [0, 2]),
    # no time known: the first reported
    ([rec(0, 0, None, "restart_all"), rec(1, 0, None)], [0]),
])
def test_the_root_cause_is_each_incidents_first_failure_by_time(records, roots):
    marked = mark_root_causes(records)
    assert [i for i, r in enumerate(marked) if r.root_cause] == roots
    assert mark_root_causes(marked) == marked  # marking again changes nothing


def launch(kind: str, cwd: Path) -> subprocess.CompletedProcess:
    argv = [str(BIN / kind), *(["run"] if kind == "dlrover" else []), "--nproc-per-node", "2", "--max-restarts", "0", str(SCRIPTS / "record_train.py")]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DLROVER_", "TORCHELASTIC_"))}
    # (TMPDIR: torchrun's torchelastic_* log directory, which it leaves behind, stays in the test's)
    return subprocess.run(argv, cwd=cwd, env={**env, "OMP_NUM_THREADS": "1", "TMPDIR": str(cwd)}, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_a_record_script_names_the_same_root_cause_under_torchrun_and_dlrover_run(tmp_path):
    """Rank 1 raises ValueError; rank 0, waiting for it in an all-reduce, fails with gloo's
    error. Both launchers give each rank an error file, read both back and name rank 1's
    ValueError, with its traceback, as the root cause (dlrover: the summary, ``dlrover
    status`` and ``result.json``), not rank 0's collective error."""
    (tmp_path / "t").mkdir()
    (tmp_path / "d").mkdir()
    torchrun = launch("torchrun", tmp_path / "t")
    assert torchrun.returncode == 1, torchrun.stderr[-3000:]
    root = torchrun.stderr.split("Root Cause (first observed failure):", 1)[1]
    assert re.search(r"rank\s+: 1 \(local_rank: 1\)", root) and "ValueError: boom on rank 1 at step 3" in root
    assert re.search(r"error_file: \S+/error\.json", root)

    dlrover = launch("dlrover", tmp_path / "d")
    assert dlrover.returncode == 1, dlrover.stdout[-3000:] + dlrover.stderr[-3000:]
    summary = dlrover.stdout.split("root cause (first observed failure):", 1)[1]
    assert re.search(r"rank\s+: 1 \(node 0, local_rank 1\)", summary), summary
    assert "ValueError: boom on rank 1 at step 3" in summary and 'raise ValueError(f"boom' in summary
    assert "Connection closed by peer" not in summary
    (run_dir,) = (tmp_path / "d" / "dlrover-runs").iterdir()
    result = json.loads((run_dir / "result.json").read_text())
    (cause,) = [f for f in result["failures"] if f["root_cause"]]
    assert (cause["rank"], cause["node_id"]) == (1, 0)
    assert cause["error_file"] == str(run_dir / "node_0" / "round_0" / "error_rank1.json")
    assert "ValueError: boom on rank 1 at step 3" in cause["traceback"]
    assert json.loads(Path(cause["error_file"]).read_text())["message"]["message"].startswith("ValueError")
    assert "root cause: rank 1 on node 0, ValueError: boom" in result["reason"]
    others = [f for f in result["failures"] if not f["root_cause"]]
    assert all(f["rank"] == 0 and "Connection closed by peer" in f["traceback"] for f in others), others
    status = subprocess.run([str(BIN / "dlrover"), "status", run_dir.name], cwd=tmp_path / "d", capture_output=True,
                            text=True, timeout=60)
    assert status.returncode == 0, status.stderr
    shown = status.stdout.split("root cause of the failure (first observed failure):", 1)[1]
    assert re.search(r"rank\s+: 1 \(node 0, local_rank 1\)", shown) and "ValueError: boom on rank 1" in shown
    assert job_processes(run_dir.name) == []
