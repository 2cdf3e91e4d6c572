"""`dlrover plot`: the picture of a real job shows what the job's own files say.

The counts the tests expect are read here from ``events.jsonl``, ``result.json`` and the
progress files, independently of ``dlrover_core.jobplot``; what is on the figure is read
from its matplotlib artists (each mark carries its kind as its ``gid``), not from pixels.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner
from helpers import SCRIPTS

from dlrover_core import Checkpoint, Failure, Job, JobResult, JobState, Nodes, jobplot
from dlrover_core.cli import main
from dlrover_core.testing import kill_worker_at_step

pytest.importorskip("matplotlib", reason="the plot needs matplotlib: pip install 'dlrover-core[plot]'")
from matplotlib.collections import PathCollection  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def killed_job(tmp_path_factory) -> tuple[Path, JobResult]:
    """A real 2-node job (tiny_train.py, 30 steps) whose rank 1 is SIGKILLed at step 12;
    every worker restarts and resumes. Returns (its directory, its result)."""
    tmp = tmp_path_factory.mktemp("plot")
    job = Job(name="plotted", entrypoint=str(SCRIPTS / "tiny_train.py"), args=["--steps", "30", "--step-sleep", "0.05"],
              nodes=Nodes(min=2, max=2), accelerator="cpu",
              checkpoint=Checkpoint(dir=str(tmp / "ck"), persist_every_steps=5),
              failure=Failure(max_restarts=1, stop_grace_s=5), log_dir=str(tmp / "runs"))
    run = job.submit()
    kill = kill_worker_at_step(run, step=12, rank=1, sig=signal.SIGKILL, timeout_s=120)
    result = run.wait(progress=False)
    assert kill.done.wait(5) and kill.pid is not None, "the chaos thread sent no SIGKILL"
    assert result.state == JobState.SUCCEEDED, result.reason
    return Path(result.log_dir), result


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines() if line.strip()]


def _rank0_steps(run_dir: Path) -> list[dict]:
    records = []
    for path in run_dir.glob("node_*/round_*/progress_*.jsonl"):
        for line in path.read_text().splitlines():
            r = json.loads(line)
            if r.get("type") == "step" and r.get("rank") == 0:
                records.append(r)
    return sorted(records, key=lambda r: r["t"])


def _marks(fig, gid: str, kind: type) -> list:
    return [a for a in fig.findobj(kind) if a.get_gid() == gid]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_plot_marks_every_failure_detection_recovery_and_commit_of_a_real_job(killed_job):
    """A job with a SIGKILLed worker: the figure has one failure line and one detection line per
    `worker_failed` event (each failure before its report, each report at the event's time),
    one recovery where rank 0's first step after the failure ended (the step after the one
    restored), one commit point per `checkpoint_committed` event at its time and step, the
    world size of every round and 0 while every worker restarts, every step and loss rank 0
    reported, and a goodput bar whose segments add up to result.json's wall time."""
    run_dir, result = killed_job
    events = _events(run_dir)
    failed = [e for e in events if e["kind"] == "worker_failed"]
    committed = [e for e in events if e["kind"] == "checkpoint_committed"]
    rounds = [e for e in events if e["kind"] == "rendezvous_completed"]
    restarted = [e for e in events if e["kind"] == "workers_restarted"]
    start_unix = events[0]["unix_time_s"] - events[0]["time_s"]
    rank0 = _rank0_steps(run_dir)
    assert failed and len(failed) == len(result.failures)
    assert committed and len(rounds) == 2 and len(restarted) == 1

    fig, summary = jobplot.draw(jobplot.read_job(run_dir))
    failure_lines = _marks(fig, "failure", Line2D)
    detection_lines = _marks(fig, "detection", Line2D)
    assert len(failure_lines) == len(detection_lines) == len(failed)
    for fail, detect, event in zip(failure_lines, detection_lines, failed, strict=True):
        assert detect.get_xdata()[0] == pytest.approx(event["time_s"], abs=1e-6)
        assert fail.get_xdata()[0] <= detect.get_xdata()[0]

    resumed = {next(r["step"] for r in rank0 if r["t"] - start_unix > e["time_s"]) for e in failed}
    (recovery_line,) = _marks(fig, "recovery", Line2D)
    (killed,) = [f for f in result.failures if f.signal == "SIGKILL"]
    assert resumed == {killed.restored_step + 1}
    first_after = next(r for r in rank0 if r["step"] == killed.restored_step + 1 and r["t"] - start_unix > killed.time_s)
    # (events.jsonl rounds both of its times to the millisecond)
    assert recovery_line.get_xdata()[0] == pytest.approx(first_after["t"] - start_unix, abs=0.005)

    (commit_points,) = _marks(fig, "commit", PathCollection)
    points = commit_points.get_offsets()
    assert list(points[:, 0]) == pytest.approx([e["time_s"] for e in committed])
    assert list(points[:, 1]) == [e["step"] for e in committed]

    (world,) = _marks(fig, "world_size", Line2D)
    sizes = list(world.get_ydata())
    assert sizes[0] == 2 and sizes[-1] == 2 and sizes.count(0) == len(restarted)

    # the step and loss lines are cut where the failure was reported: one piece per round here
    steps_lines = _marks(fig, "steps", Line2D)
    assert len(steps_lines) == len(rounds)
    drawn_steps = [y for line in steps_lines for y in line.get_ydata()]
    assert drawn_steps == [r["step"] for r in rank0]
    assert max(drawn_steps) == result.final_step == 29
    loss_lines = _marks(fig, "metric", Line2D)
    assert [y for line in loss_lines for y in line.get_ydata()] == pytest.approx([r["metrics"]["loss"] for r in rank0])

    bars = [a for a in fig.findobj(Rectangle) if str(a.get_gid()).startswith("goodput:")]
    assert sum(b.get_width() for b in bars) == pytest.approx(result.wall_time_s, rel=1e-6)
    (productive,) = [b for b in bars if b.get_gid() == "goodput:productive_s"]
    assert productive.get_width() == pytest.approx(result.productive_s)

    # one startup (round formed -> first step) per round, one restart + rendezvous for the restart
    assert summary.phases["startup"] == len(rounds) and summary.phases["restart"] == 1
    assert summary.markers == {"failure": len(failed), "detection": len(failed), "recovery": 1,
                               "commit": len(committed)}
    assert (summary.steps, summary.metric, summary.world_size) == (len(rank0), len(rank0),
                                                                    len(rounds) + len(restarted))
    assert result.job_id in summary.title and f"goodput {result.goodput:.1%}" in summary.title
    assert fig.get_suptitle() == summary.title


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_dlrover_plot_writes_the_png_and_says_where(killed_job, tmp_path):
    """`dlrover plot JOB_ID -o PATH --log-dir DIR` writes a PNG and prints its path and counts;
    without -o it writes job.png in the job's directory."""
    run_dir, result = killed_job
    out = tmp_path / "pictures" / "job.png"
    done = CliRunner().invoke(main, ["plot", result.job_id, "-o", str(out), "--log-dir", str(run_dir.parent)])
    assert done.exit_code == 0, done.output
    assert out.read_bytes().startswith(PNG_MAGIC)
    failures = sum(1 for e in _events(run_dir) if e["kind"] == "worker_failed")
    assert f"wrote {out}" in done.output and f"{failures} failure(s)" in done.output

    done = CliRunner().invoke(main, ["plot", result.job_id, "--log-dir", str(run_dir.parent)])
    assert done.exit_code == 0, done.output
    assert (run_dir / "job.png").read_bytes().startswith(PNG_MAGIC)


def _job_dir(tmp_path: Path, job_id: str = "j-1", events: list[dict] | None = None) -> Path:
    run_dir = tmp_path / job_id
    run_dir.mkdir(parents=True)
    (run_dir / "job.json").write_text(json.dumps({"scheduler": "local", "job_id": job_id, "log_dir": str(run_dir)}))
    if events is not None:
        (run_dir / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    return run_dir


def test_plot_of_an_unknown_job_names_it_and_the_log_dir_option(tmp_path):
    """No such job: the error names the job, the directory searched and --log-dir."""
    done = CliRunner().invoke(main, ["plot", "no-such-job", "--log-dir", str(tmp_path)])
    assert done.exit_code == 1
    assert "no job 'no-such-job'" in done.output and "--log-dir" in done.output


def test_plot_of_a_job_without_events_names_the_file(tmp_path):
    """A job directory without events.jsonl (its master never started) is refused by name."""
    _job_dir(tmp_path)
    done = CliRunner().invoke(main, ["plot", "j-1", "--log-dir", str(tmp_path)])
    assert done.exit_code == 1 and "events.jsonl does not exist" in done.output


def test_events_without_unix_time_are_refused_naming_the_field(tmp_path):
    """Events that cannot be lined up with the progress records (no unix_time_s) are refused,
    naming the field; a malformed time_s names that field."""
    run_dir = _job_dir(tmp_path, events=[{"kind": "rendezvous_completed", "job_id": "j-1", "time_s": 1.0,
                                          "world_size": 2}])
    with pytest.raises(jobplot.JobPlotError, match="unix_time_s"):
        jobplot.read_job(run_dir)
    (run_dir / "events.jsonl").write_text(json.dumps({"kind": "job_finished", "time_s": "soon"}) + "\n")
    with pytest.raises(jobplot.JobPlotError, match="'time_s' is 'soon'"):
        jobplot.read_job(run_dir)


def test_plot_without_matplotlib_says_how_to_install_it(tmp_path, monkeypatch):
    """Without matplotlib the data is still read, and drawing says `pip install 'dlrover-core[plot]'`."""
    run_dir = _job_dir(tmp_path, events=[
        {"kind": "rendezvous_completed", "job_id": "j-1", "time_s": 1.0, "unix_time_s": 101.0, "world_size": 2},
        {"kind": "job_finished", "job_id": "j-1", "time_s": 3.0, "unix_time_s": 103.0, "state": "FAILED",
         "restarts": 0}])
    data = jobplot.read_job(run_dir)
    assert (data.state, data.world_sizes, data.end_s) == ("FAILED", ((1.0, 2),), 3.0)
    for name in ("matplotlib", "matplotlib.figure"):  # importing them now raises ImportError
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(jobplot.JobPlotError, match=r"pip install 'dlrover-core\[plot\]'"):
        jobplot.render(data, tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def test_steps_trained_again_after_a_restore_are_marked_lost_and_shaded_as_recomputed(tmp_path):
    """Rank 0 trained steps 0-5, rank 1 died after step 5, the job restored step 3 from storage
    and trained 4-7 again: the first 4 and 5 are lost (their time shaded as recomputed), the
    failure is placed at rank 1's last progress, and training resumed at the second step 4."""
    start = 1000.0
    run_dir = _job_dir(tmp_path, events=[
        {"kind": "rendezvous_completed", "time_s": 1.0, "unix_time_s": start + 1.0, "round": 0, "world_size": 2},
        {"kind": "worker_failed", "time_s": 9.0, "unix_time_s": start + 9.0, "round": 0, "node_id": 1, "rank": 1,
         "step": 5, "detail": "SIGKILL", "recovery": "restart_all"},
        {"kind": "workers_restarted", "time_s": 9.0, "unix_time_s": start + 9.0, "round": 1},
        {"kind": "rendezvous_completed", "time_s": 10.0, "unix_time_s": start + 10.0, "round": 1, "world_size": 2},
        {"kind": "job_finished", "time_s": 20.0, "unix_time_s": start + 20.0, "state": "SUCCEEDED", "restarts": 1}])

    def progress(node: int, rnd: int, rank: int, steps: list[tuple[int, float]]) -> None:
        d = run_dir / f"node_{node}" / f"round_{rnd}"
        d.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps({"type": "step", "step": s, "rank": rank, "dt": 1.0, "t": start + t,
                             "metrics": {"loss": 10.0 - s}}) for s, t in steps]
        (d / f"progress_rank{rank}.jsonl").write_text("\n".join(lines) + "\n")

    progress(0, 0, 0, [(s, 3.0 + s) for s in range(6)])           # steps 0-5 end at 3..8 s
    progress(1, 0, 1, [(s, 3.0 + s) for s in range(5)])           # rank 1's last step (4) ends at 7 s
    progress(0, 1, 0, [(s, 12.0 + s) for s in range(4, 8)])       # steps 4-7 again, at 16..19 s
    data = jobplot.read_job(run_dir)

    assert [(p.step, p.lost) for p in data.steps if p.lost] == [(4, True), (5, True)]
    assert [(p.kind, p.start_s, p.end_s) for p in data.phases if p.kind == "recomputed"] == [("recomputed", 6.0, 8.0)]
    (failure,) = data.failures
    assert (failure.failed_s, failure.failed_from, failure.reported_s) == (7.0, "progress", 9.0)
    assert [(r.time_s, r.step) for r in data.recoveries] == [(16.0, 4)]
    assert data.world_sizes == ((1.0, 2), (9.0, 0), (10.0, 2))
    kinds = {p.kind: (p.start_s, p.end_s) for p in data.phases}
    assert kinds["detection"] == (7.0, 9.0) and kinds["restart"] == (9.0, 10.0)
