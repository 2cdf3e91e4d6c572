"""``DLROVER_LOG_FORMAT=json``: everything a job writes to the console is JSON Lines on stdout
(ISO-8601 UTC timestamps, the node and rank as fields), from ``Job.run()`` and from
``dlrover run``; the console format stays as it was."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import structlog

from dlrover_core.logging import as_record, bind_process, configure, get_logger


@pytest.fixture
def reset_logging():
    yield
    bind_process(node=None, rank=None)
    structlog.contextvars.clear_contextvars()
    configure(fmt="console")


def utc(timestamp: str) -> datetime.datetime:
    when = datetime.datetime.fromisoformat(timestamp.replace("Z", "+00:00"))
    assert when.utcoffset() == datetime.timedelta(0), timestamp
    return when


def test_json_mode_writes_one_object_a_line_to_stdout_with_utc_time_node_and_rank(capsys, monkeypatch, reset_logging):
    monkeypatch.setenv("DLROVER_NODE_ID", "2")
    monkeypatch.setenv("RANK", "5")
    configure(fmt="json")
    structlog.contextvars.bind_contextvars(round=3)
    get_logger().info("worker_restarted", exit_code=-9)
    out, err = capsys.readouterr()
    assert err == ""
    (line,) = out.splitlines()
    record = json.loads(line)
    assert {k: record[k] for k in ("event", "level", "exit_code", "node", "rank", "round")} == {
        "event": "worker_restarted", "level": "info", "exit_code": -9, "node": 2, "rank": 5, "round": 3}
    assert abs(utc(record["timestamp"]) - datetime.datetime.now(datetime.timezone.utc)) < datetime.timedelta(minutes=1)


def test_bound_process_fields_reach_every_thread(capsys, reset_logging):
    configure(fmt="json")
    bind_process(node=7)
    thread = threading.Thread(target=lambda: get_logger().warning("heartbeat_late", late_s=1.5))
    thread.start()
    thread.join()
    record = json.loads(capsys.readouterr().out)
    assert (record["event"], record["node"], record["level"]) == ("heartbeat_late", 7, "warning")
    assert "rank" not in record


def test_console_mode_is_unchanged(capsys, reset_logging):
    configure(fmt="console")
    get_logger().info("job_submitted", job_id="j-1")
    out, err = capsys.readouterr()
    assert out == ""
    assert err.endswith("[info     ] job_submitted job_id=j-1\n") and err[2] == ":" and err[5] == ":", err


def test_an_unknown_format_names_the_variable_and_the_choices(monkeypatch, reset_logging):
    monkeypatch.setenv("DLROVER_LOG_FORMAT", "xml")
    with pytest.raises(ValueError, match=r"DLROVER_LOG_FORMAT='xml' is not a log format; set it to one of console, json"):
        configure()


def test_output_lines_become_objects_with_their_node_and_rank():
    printed = as_record("loss is 0.5\n", node=1, rank=3)
    assert (printed["event"], printed["text"], printed["node"], printed["rank"]) == ("output", "loss is 0.5", 1, 3)
    utc(printed["timestamp"])
    logged = as_record('{"event": "saved", "rank": 0, "timestamp": "2026-01-01T00:00:00Z"}', node=1, rank=3)
    assert logged == {"event": "saved", "rank": 0, "timestamp": "2026-01-01T00:00:00Z", "node": 1}
    for text in ("[1, 2]", "{not json", ""):
        assert as_record(text, node=0)["text"] == text


# ----- real jobs -------------------------------------------------------------------------------

SCRIPT = textwrap.dedent("""
    import time
    from dlrover_core import train
    from dlrover_core.logging import get_logger

    info = train.init()
    print(f"plain text from rank {info.rank}", flush=True)
    get_logger().info("script_event", answer=42)
    for step in range(STEPS):
        time.sleep(0.1)
        train.report(step, total_steps=STEPS, samples=8, loss=1.0)
""")


def json_lines(stdout: str) -> list[dict]:
    records = []
    for line in stdout.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            pytest.fail(f"not a JSON line on stdout: {line!r}\n{stdout[-3000:]}")
        assert isinstance(record, dict) and "event" in record, line
        utc(record["timestamp"])
        records.append(record)
    return records


def json_env() -> dict[str, str]:
    return {**os.environ, "DLROVER_LOG_FORMAT": "json", "PYTHONUNBUFFERED": "1"}


@pytest.mark.timeout(240)
def test_job_run_prints_only_json_lines(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT.replace("STEPS", "30"))
    (tmp_path / "driver.py").write_text(textwrap.dedent(f"""
        from dlrover_core import Job
        job = Job(name="jl", entrypoint={str(tmp_path / 'train.py')!r}, nodes=2, accelerator="cpu",
                  log_dir={str(tmp_path / 'runs')!r})
        job.submit().wait(progress_every_s=1.0)
    """))
    proc = subprocess.run([sys.executable, "driver.py"], cwd=tmp_path, capture_output=True, text=True, timeout=200,
                          env=json_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[info" not in proc.stderr, proc.stderr[-2000:]
    records = json_lines(proc.stdout)
    # (a node's own processes may print a plain line too, e.g. a C++ warning of torch's c10d
    # under load: an output record of the node without a rank)
    outputs = {(r.get("node"), r.get("rank"), r["text"]) for r in records if r["event"] == "output"}
    assert {(0, 0, "plain text from rank 0"), (1, 1, "plain text from rank 1")} <= outputs, outputs
    script_events = {(r["node"], r["rank"], r["answer"]) for r in records if r["event"] == "script_event"}
    assert script_events == {(0, 0, 42), (1, 1, 42)}
    assert {r["node"] for r in records if r["event"] == "agent_started"} == {0, 1}
    assert any(r["event"] == "rendezvous_completed" and r.get("process") == "master" for r in records)
    progress = [r for r in records if r["event"] == "progress" and r["step"] is not None]
    assert progress and progress[-1]["total_steps"] == 30 and progress[-1]["samples_per_s"] > 0, progress[-1:]
    assert records[-1]["event"] == "result" and records[-1]["state"] == "SUCCEEDED"
    assert records[-1]["final_step"] == 29 and "note" not in records[-1]
    # `dlrover logs` of the ended job: the same objects
    logs = subprocess.run([sys.executable, "-m", "dlrover_core.cli", "logs", records[-1]["job_id"], "--log-dir",
                           str(tmp_path / "runs")], capture_output=True, text=True, timeout=60, env=json_env())
    assert logs.returncode == 0, logs.stderr[-2000:]
    later = json_lines(logs.stdout)
    assert {(r.get("node"), r.get("rank"), r["text"]) for r in later if r["event"] == "output"} >= {
        (0, 0, "plain text from rank 0"), (1, 1, "plain text from rank 1")}


@pytest.mark.timeout(240)
def test_dlrover_run_prints_only_json_lines(tmp_path):
    (tmp_path / "train.py").write_text(SCRIPT.replace("STEPS", "5"))
    proc = subprocess.run(
        [sys.executable, "-m", "dlrover_core.cli", "run", "--nproc-per-node", "2", "--log-dir", str(tmp_path / "runs"),
         "train.py"], cwd=tmp_path, capture_output=True, text=True, timeout=200, env=json_env())
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stderr == "", proc.stderr[-2000:]
    records = json_lines(proc.stdout)
    # (a node's own processes may print a plain line too, e.g. a C++ warning of torch's c10d
    # under load: an output record of the node without a rank)
    outputs = {(r.get("node"), r.get("rank"), r["text"]) for r in records if r["event"] == "output"}
    assert {(0, 0, "plain text from rank 0"), (0, 1, "plain text from rank 1")} <= outputs, outputs
    assert {(r["node"], r["rank"]) for r in records if r["event"] == "script_event"} == {(0, 0), (0, 1)}
    assert any(r["event"] == "workers_started" and r["node"] == 0 for r in records)
    assert not any(r["event"] == "progress" for r in records)  # (only with --progress)
    assert records[-1]["event"] == "result" and records[-1]["state"] == "SUCCEEDED"
    assert Path(records[-1]["log_dir"]).is_dir()
