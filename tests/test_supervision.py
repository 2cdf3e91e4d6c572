"""Supervision apart from display (``dlrover_core.supervision.Supervisor``): against a fake
scheduler backend, it supervises the job each poll, tells its observer each status, ends on the
result, on a stop signal or a timeout, and cancels the job however it ends; ``JobRun.wait``
shows what it observed."""

from __future__ import annotations

import signal
import threading

import pytest

from dlrover_core.errors import SchedulerError
from dlrover_core.protocol import JobResult, JobState, JobStatus
from dlrover_core.runner import JobRun
from dlrover_core.scheduler_backend import JobHandle
from dlrover_core.supervision import Supervisor

HANDLE = JobHandle(scheduler="fake", job_id="j-1", log_dir="/nowhere")


def _result(state: JobState = JobState.SUCCEEDED) -> JobResult:
    return JobResult(job_id="j-1", state=state, reason="", final_step=4, restarts=0, wall_time_s=1.0,
                     productive_s=0.0, goodput=0.0, checkpoint_stall_s=0.0, restore_s=0.0, recomputed_s=0.0,
                     detection_s=0.0, restart_s=0.0, rendezvous_s=0.0, startup_s=0.0, failures=(), metrics={},
                     log_dir="/nowhere")


class FakeBackend:
    """A job that runs ``polls`` polls (step = poll), then has ``result`` (None: never); once
    cancelled, ``cancelled`` is its result."""

    def __init__(self, polls: int = 3, result: JobResult | None = None, on_poll=None,
                 cancelled: JobResult | None = None) -> None:
        self.polls, self.final, self.on_poll, self.cancelled = polls, result, on_poll, cancelled
        self.calls: list[str] = []
        self.step = -1

    def result(self, handle):
        if "cancel" in self.calls:
            return self.cancelled or self.final
        return self.final if self.step >= self.polls - 1 else None

    def supervise(self, handle):
        self.calls.append("supervise")

    def status(self, handle):
        self.step += 1
        if self.on_poll is not None:
            self.on_poll(self.step)
        return JobStatus(state=JobState.RUNNING, step=self.step)

    def cancel(self, handle):
        self.calls.append("cancel")

    def logs(self, handle, follow=False):
        yield "[node-0] hello"


class Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple] = []

    def start(self):
        self.seen.append(("start",))

    def update(self, status, elapsed_s):
        self.seen.append(("update", status.step))

    def note(self, event, text):
        self.seen.append(("note", event, text))

    def stop(self):
        self.seen.append(("stop",))


def _in_thread(fn):
    """Run ``fn`` off the main thread (no stop signals are armed there): its value, or raise
    what it raised."""
    box = {}

    def call():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            box["error"] = exc

    thread = threading.Thread(target=call)
    thread.start()
    thread.join(30)
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_the_observer_hears_each_status_then_the_job_is_cancelled_and_its_result_returned():
    backend, seen = FakeBackend(polls=3, result=_result()), Recorder()
    supervisor = Supervisor(backend, HANDLE, observer=seen)
    result = _in_thread(lambda: supervisor.run(poll_s=0))
    assert result.state == JobState.SUCCEEDED and supervisor.stop_signal is None
    assert seen.seen == [("start",), ("update", 0), ("update", 1), ("update", 2), ("stop",)]
    assert backend.calls == ["supervise"] * 3 + ["cancel"]


def test_without_an_observer_it_supervises_the_same():
    backend = FakeBackend(polls=2, result=_result())
    assert _in_thread(lambda: Supervisor(backend, HANDLE).run(poll_s=0)).final_step == 4
    assert backend.calls == ["supervise", "supervise", "cancel"]


def test_a_timeout_cancels_the_job_and_raises():
    backend, seen = FakeBackend(polls=10**9), Recorder()
    with pytest.raises(TimeoutError, match="j-1 did not finish within 0.0 s"):
        _in_thread(lambda: Supervisor(backend, HANDLE, observer=seen).run(timeout_s=0.0, poll_s=0))
    assert backend.calls[-1] == "cancel" and seen.seen[-1] == ("stop",)


def test_a_job_without_a_result_is_a_scheduler_error():
    def interrupt(step):
        raise KeyboardInterrupt  # a caller's handler raising it: stops as SIGINT

    backend, seen = FakeBackend(polls=10**9, on_poll=interrupt), Recorder()
    supervisor = Supervisor(backend, HANDLE, observer=seen)
    with pytest.raises(SchedulerError, match="ended without a result; see /nowhere"):
        _in_thread(lambda: supervisor.run(poll_s=0))
    assert supervisor.stop_signal == signal.SIGINT  # known even though it raised
    assert ("note", "interrupted", "cancelling the job") in seen.seen and backend.calls[-1] == "cancel"


def test_ctrl_c_cancels_and_names_the_signal():
    """In the main thread SIGINT's default handling is taken over while it runs and given back."""
    before = signal.getsignal(signal.SIGINT)
    backend = FakeBackend(polls=10**9, cancelled=_result(JobState.CANCELLED),
                          on_poll=lambda step: step == 1 and signal.raise_signal(signal.SIGINT))
    seen = Recorder()
    supervisor = Supervisor(backend, HANDLE, observer=seen)
    if before is not signal.default_int_handler:
        pytest.skip("SIGINT is not Python's default here")
    result = supervisor.run(poll_s=0.01)
    assert result.state == JobState.CANCELLED and supervisor.stop_signal == signal.SIGINT
    assert ("note", "interrupted", "SIGINT: cancelling the job") in seen.seen
    assert backend.calls[-1] == "cancel" and signal.getsignal(signal.SIGINT) is before


def test_job_run_wait_shows_the_logs_and_the_summary_and_keeps_the_stop_signal(capsys):
    backend = FakeBackend(polls=2, result=_result())
    run = JobRun(backend=backend, plan=None, handle=HANDLE)
    result = _in_thread(lambda: run.wait(poll_s=0))
    out = capsys.readouterr().out
    assert result.state == JobState.SUCCEEDED and run.stop_signal is None
    assert "[node-0] hello" in out and "progress: running | step 0" in out and result.summary() in out
    assert backend.calls[-1] == "cancel"


def test_the_status_of_a_finished_job_keeps_what_its_result_knows():
    """Once the master has exited, the status comes from ``result.json``: the final progress
    line still has the run's length, its throughput, goodput and wall time (they were lost,
    so a JSON progress record after SUCCEEDED said ``total_steps: null``)."""
    from dlrover_core.display import progress_fields
    from dlrover_core.scheduler_backend import status_of_result

    result = JobResult(job_id="j", state=JobState.SUCCEEDED, reason="", final_step=29, restarts=0, wall_time_s=12.5,
                       productive_s=10.0, goodput=0.8, checkpoint_stall_s=0, restore_s=0, recomputed_s=0,
                       detection_s=0, restart_s=0, rendezvous_s=0, startup_s=0, failures=(), metrics={"loss": 1.0},
                       log_dir="", total_steps=30, samples_per_s=80.0, tokens_per_s=None)
    fields = progress_fields(status_of_result(result))
    assert (fields["state"], fields["step"], fields["total_steps"], fields["percent"]) == ("SUCCEEDED", 29, 30, 100.0)
    assert (fields["samples_per_s"], fields["goodput"], fields["elapsed_s"], fields["loss"]) == (80.0, 0.8, 12.5, 1.0)
    assert JobResult.from_dict({**result.to_dict(), "samples_per_s": None}).samples_per_s is None
