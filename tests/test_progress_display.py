"""What a user sees of a running job: step/total, ETA, samples/s and tokens/s, loss, goodput,
nodes and restarts — on the live or plain progress line, in ``dlrover status`` and its
``--json`` — from what the script passes to ``train.report``."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from dlrover_core import Job, JobState, Nodes
from dlrover_core.cli import main
from dlrover_core.master.goodput import StepRate
from dlrover_core.master.job_master import JobMaster
from dlrover_core.protocol import Heartbeat, Join, MasterStatus, Poll, Register, encode
from dlrover_core.protocol.progress import RestoreRecord, StepRecord
from dlrover_core.protocol.status import JobStatus
from dlrover_core.runner import progress_fields, progress_line
from dlrover_core.train.progress import ProgressWriter


def step(n: int, t: float, *, dt: float = 0.5, gen: int = 0, **extra) -> StepRecord:
    return StepRecord(step=n, rank=0, dt_s=dt, unix_time_s=t, generation=gen, **extra)


# ----- the rate, from rank 0's records ----------------------------------------------------------


def test_rate_is_wall_clock_between_reports_job_wide_and_eta_counts_the_remaining_steps():
    """Step time is the wall-clock time between rank 0's reports (a checkpoint save between
    them counts), samples/s is the reported job-wide samples over that time, and the ETA is
    the steps left to total_steps - 1 times the median step time."""
    rate = StepRate()
    for n in range(10):
        # every 4th step takes 2 s (a save): the median ignores it, the throughput does not
        rate.add(step(n, t=100.0 + sum(2.0 if k % 4 == 3 else 1.0 for k in range(n + 1)), dt=1.0,
                      samples=64, tokens=64 * 128, total_steps=100))
    assert rate.total_steps == 100
    assert rate.step_time_s == pytest.approx(1.0)
    assert rate.eta_s == pytest.approx(90 * 1.0)  # steps 10..99
    # the first record has no predecessor: its own dt (1 s); then 9 spans of 11 s in all
    assert rate.samples_per_s == pytest.approx(640 / 12.0)
    assert rate.tokens_per_s == pytest.approx(640 * 128 / 12.0)


def test_reports_every_few_steps_count_seconds_per_step():
    rate = StepRate()
    rate.add(step(0, t=0.0, dt=0.2, total_steps=50))
    rate.add(step(10, t=2.0))
    rate.add(step(20, t=4.0))
    assert rate.step_time_s == pytest.approx(0.2)
    assert rate.eta_s == pytest.approx(29 * 0.2)
    assert rate.samples_per_s is None and rate.tokens_per_s is None  # the script reports none


def test_time_across_a_failure_is_not_step_time():
    """A restart that goes back to an older step, or a restore, starts the window again; a
    late record of an older live generation is left out."""
    rate = StepRate()
    for n in range(5):
        rate.add(step(n, t=float(n), dt=1.0, samples=10))
    rate.add(RestoreRecord(step=2))
    rate.add(step(3, t=600.0, dt=0.5, samples=10))  # 600 s later: the failure, not a step
    assert rate.step_time_s == pytest.approx(0.5)
    assert rate.samples_per_s == pytest.approx(20.0)
    rate.add(step(4, t=601.0, gen=1, dt=0.25, samples=10))  # the world re-formed
    rate.add(step(4, t=650.0, gen=0, dt=9.0, samples=10))  # a late record of generation 0
    assert rate.step_time_s == pytest.approx(0.25)
    rate.round_started()
    rate.add(step(5, t=700.0, dt=0.25))  # a new round: its first record's own dt
    assert rate.step_time_s == pytest.approx(0.25)


def test_the_master_serves_the_rate_and_keeps_the_total_over_its_restart(tmp_path):
    (tmp_path / "t.py").write_text("")
    job = Job(name="m", entrypoint=str(tmp_path / "t.py"), nodes=Nodes(min=1, max=1))
    ports = iter(range(5000, 6000))
    m = JobMaster(job, "job-1", store_host="127.0.0.1", store_factory=lambda: (next(ports), None), log_dir=tmp_path)
    m.register(Register(node_id=0, host="h", pid=100))
    m.join(Join(node_id=0, nproc=1))
    m.poll(Poll(node_id=0))
    records = tuple(step(n, t=10.0 + 0.5 * n, samples=32, tokens=32 * 64, total_steps=20, metrics={"loss": 1.0})
                    for n in range(6))
    m.heartbeat(Heartbeat(node_id=0, round=0, records=records))
    status = MasterStatus.from_wire(json.loads(json.dumps(encode(m.status()))))  # over the wire
    assert (status.total_steps, status.step_time_s, status.eta_s) == (20, 0.5, 7.0)
    assert status.samples_per_s == pytest.approx(32 * 6 / 3.0, rel=1e-3)  # first: its dt 0.5 s, then 5 x 0.5 s
    assert status.tokens_per_s == pytest.approx(64 * 32 * 6 / 3.0, rel=1e-3)
    js = status.to_job_status()
    assert (js.total_steps, js.eta_s, js.samples_per_s) == (20, 7.0, status.samples_per_s)
    restarted = JobMaster(job, "job-1", store_host="127.0.0.1", store_factory=lambda: (next(ports), None))
    restarted.restore(m.snapshot())
    assert restarted.status().total_steps == 20
    assert m.result().total_steps == 20


def test_old_masters_status_decodes_with_the_rate_unknown():
    status = MasterStatus.from_wire({"state": "RUNNING", "step": 3, "elapsed_s": 12.0, "nodes": 1, "max_nodes": 1})
    js = status.to_job_status()
    assert (js.total_steps, js.eta_s, js.samples_per_s, js.tokens_per_s) == (None, None, None, None)
    assert progress_line(js) == "running | step 3 | nodes 1/1 | restarts 0 | 12 s"


# ----- the line --------------------------------------------------------------------------------


def test_the_line_shows_total_eta_rates_loss_goodput_nodes_restarts():
    s = JobStatus(state=JobState.RUNNING, step=119, total_steps=300, eta_s=65.0, samples_per_s=512.0,
                  tokens_per_s=32768.0, metrics={"loss": 2.31, "lr": 0.1}, goodput={"goodput": 0.912}, nodes=2,
                  max_nodes=2, restarts=1, elapsed_s=45.2)
    assert progress_line(s) == ("running | step 119/300 (40%) | ETA 1m05s | 512 samples/s | 32.8k tokens/s | "
                                "loss 2.3100 | goodput 91% | nodes 2/2 | restarts 1 | 45 s")
    fields = progress_fields(s)
    assert fields["percent"] == 40.0 and fields["goodput"] == 0.912 and fields["eta_s"] == 65.0


def test_before_the_first_report_neither_step_nor_goodput_is_shown():
    s = JobStatus(state=JobState.RUNNING, goodput={"goodput": 0.0}, nodes=1, max_nodes=2)
    assert progress_line(s, 3.0) == "running | nodes 1/2 | restarts 0 | 3 s"
    assert progress_line(JobStatus(state=JobState.SUCCEEDED), 3.0) == "succeeded | restarts 0 | 3 s"
    assert progress_fields(s, 3.0)["goodput"] is None and progress_fields(s, 3.0)["step"] is None


@pytest.mark.parametrize(("step_", "text"), [(0, "step 0/300 (0%)"), (297, "step 297/300 (99%)"),
                                             (299, "step 299/300 (100%)"), (300, "step 300/300 (100%)")])
def test_the_percentage_reaches_100_only_with_the_last_step(step_, text):
    s = JobStatus(state=JobState.RUNNING, step=step_, total_steps=300)
    assert progress_line(s, 1.0).startswith(f"running | {text} |")


@pytest.mark.parametrize(("eta_s", "text"), [(7, "7s"), (65, "1m05s"), (7380, "2h03m"), (3 * 86400 + 4 * 3600, "3d04h")])
def test_eta_reads_as_a_duration(eta_s, text):
    s = JobStatus(state=JobState.RUNNING, step=1, total_steps=10, eta_s=float(eta_s))
    assert f"ETA {text} |" in progress_line(s, 1.0)


# ----- train.report ----------------------------------------------------------------------------


def test_report_writes_total_samples_and_tokens_and_remembers_the_total(tmp_path):
    path = tmp_path / "p.jsonl"
    w = ProgressWriter(str(path))
    w.step(0, {"loss": 1.0}, total_steps=10, samples=64, tokens=8192)
    w.step(1, {"loss": 0.5})
    first, second = (json.loads(line) for line in path.read_text().splitlines())
    assert (first["total_steps"], first["samples"], first["tokens"], first["metrics"]) == (10, 64, 8192, {"loss": 1.0})
    assert second["total_steps"] == 10 and "samples" not in second and "tokens" not in second


@pytest.mark.parametrize(("kwargs", "error", "names"), [
    ({"total_steps": 0}, ValueError, "total_steps=0"),
    ({"total_steps": 2.5}, TypeError, "total_steps=2.5"),
    ({"total_steps": True}, TypeError, "total_steps=True"),
    ({"samples": -1}, ValueError, "samples=-1"),
    ({"tokens": float("nan")}, ValueError, "tokens=nan"),
    ({"samples": "many"}, TypeError, "samples='many'"),
])
def test_bad_report_arguments_name_the_argument(tmp_path, kwargs, error, names):
    with pytest.raises(error, match=re.escape(names)):
        ProgressWriter(str(tmp_path / "p.jsonl")).step(0, {}, **kwargs)


# ----- a real job ------------------------------------------------------------------------------

RATE_SCRIPT = textwrap.dedent("""
    import time
    from dlrover_core import train

    info = train.init()
    for step in range(STEPS):
        time.sleep(0.15)
        train.report(step, total_steps=STEPS, samples=64, tokens=64 * 128, loss=1.0 / (step + 1))
""")


@pytest.mark.timeout(240)
def test_a_real_job_shows_total_eta_and_throughput_on_the_plain_line_and_in_status(tmp_path):
    """Not on a terminal, the run prints a plain progress line each interval; mid-run it has
    step/total with the percentage, the ETA, samples/s and tokens/s; `dlrover status` shows
    the same line and its --json the same numbers."""
    (tmp_path / "train.py").write_text(RATE_SCRIPT.replace("STEPS", "60"))
    driver = tmp_path / "driver.py"
    driver.write_text(textwrap.dedent(f"""
        import json
        from dlrover_core import Job

        job = Job(name="rate", entrypoint={str(tmp_path / 'train.py')!r}, nodes=1, accelerator="cpu",
                  log_dir={str(tmp_path / 'runs')!r})
        run = job.submit()
        result = run.wait(progress_every_s=1.0)
        print("RESULT", json.dumps(result.to_dict()))
    """))
    proc = subprocess.run([sys.executable, str(driver)], cwd=tmp_path, capture_output=True, text=True, timeout=200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("progress: running | step")]
    mid = [line for line in lines if "ETA" in line and int(re.search(r"step (\d+)", line).group(1)) < 50]
    assert mid, proc.stdout[-3000:]
    line = mid[-1]
    match = re.search(r"step (\d+)/60 \((\d+)%\) \| ETA (\d+)s \| (\d+) samples/s \| ([\d.]+)k tokens/s \| "
                      r"loss [\d.]+ \| goodput \d+% \| nodes 1/1 \| restarts 0 \| \d+ s$", line)
    assert match, line
    step_, percent, eta, samples = (int(g) for g in match.groups()[:4])
    assert percent == 100 * (step_ + 1) // 60
    assert 0 < eta <= (60 - step_) * 1.0  # about 0.15 s a step (and never a step time of a second)
    assert 64 <= samples <= 64 / 0.15 * 1.05  # job-wide: 64 samples a step of 0.15 s (up to 1 s when loaded)
    assert float(match.group(5)) == pytest.approx(samples * 128 / 1000, rel=0.05)
    summary = proc.stdout[proc.stdout.index("job rate-"):]
    assert "final step 59 of 60" in summary

    result = json.loads(proc.stdout.split("RESULT ", 1)[1])
    run_dir = Path(result["log_dir"])
    st = CliRunner().invoke(main, ["status", result["job_id"], "--log-dir", str(run_dir.parent)])
    assert st.exit_code == 0, st.output
    assert "succeeded | step 59/60 (100%) |" in st.output and "loss 0.0167" in st.output
    data = json.loads(CliRunner().invoke(main, ["status", result["job_id"], "--log-dir", str(run_dir.parent),
                                                "--json"]).stdout)
    assert data["progress"]["step"] == 59 and data["progress"]["percent"] == 100.0
    assert data["result"]["total_steps"] == 60 and "note" not in data


@pytest.mark.timeout(240)
def test_status_of_a_running_job_has_the_rate_fields(tmp_path):
    (tmp_path / "train.py").write_text(RATE_SCRIPT.replace("STEPS", "400"))
    job = Job(name="st", entrypoint=str(tmp_path / "train.py"), nodes=1, accelerator="cpu",
              log_dir=str(tmp_path / "runs"))
    run = job.submit()
    try:
        deadline = time.monotonic() + 120
        while True:
            out = CliRunner().invoke(main, ["status", run.job_id, "--log-dir", str(tmp_path / "runs"), "--json"])
            assert out.exit_code == 0, out.output
            data = json.loads(out.stdout)
            if data["step"] >= 5 and data["samples_per_s"] is not None:
                break
            assert time.monotonic() < deadline, data
            time.sleep(0.5)
        assert data["state"] == "RUNNING" and data["total_steps"] == 400
        assert 0 < data["eta_s"] <= (400 - data["step"]) * 1.0
        assert data["tokens_per_s"] == pytest.approx(data["samples_per_s"] * 128, rel=1e-3)
        assert data["progress"]["total_steps"] == 400 and data["progress"]["samples_per_s"] == data["samples_per_s"]
        text = CliRunner().invoke(main, ["status", run.job_id, "--log-dir", str(tmp_path / "runs")]).output
        assert re.search(r"running \| step \d+/400 \(\d+%\) \| ETA \S+ \| \d+ samples/s \| [\d.]+k tokens/s \| "
                         r"loss [\d.]+ \| goodput \d+% \| nodes 1/1 \| restarts 0 \| \d+ s \| round 0", text), text
    finally:
        run.cancel()


@pytest.mark.parametrize("seed", range(50))
def test_late_records_of_an_older_generation_do_not_change_the_rate(seed):
    """The agents forward records independently: an older live generation's last steps may
    reach the master after the newer generation's. Whatever the interleaving (seeded), the
    rate, the ETA and the last step are those of the in-order delivery."""
    import random

    from dlrover_core.master.goodput import StepRate

    old = [StepRecord(step=s, unix_time_s=100.0 + 0.5 * s, dt_s=0.4, samples=8, total_steps=40) for s in range(12)]
    new = [StepRecord(step=s, generation=1, unix_time_s=100.0 + 0.5 * s + 1.0, dt_s=0.4, samples=8, total_steps=40)
           for s in range(10, 30)]
    ordered = StepRate()
    for r in old + new:
        ordered.add(r)
    rng = random.Random(seed)
    cut = rng.randrange(0, len(old))  # old[cut:] arrive late, each after a random newer record
    delivery = list(old[:cut]) + list(new)
    for r in old[cut:]:
        delivery.insert(rng.randrange(cut + 1, len(delivery) + 1), r)
    shuffled = StepRate()
    for r in delivery:
        shuffled.add(r)
    assert shuffled.last_step == ordered.last_step == 29
    assert shuffled.step_time_s == pytest.approx(ordered.step_time_s)
    assert shuffled.eta_s == pytest.approx(ordered.eta_s)
    assert shuffled.samples_per_s == pytest.approx(ordered.samples_per_s)
