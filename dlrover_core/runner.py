"""``Job.run()``: resolve plugins → dry-run → submit → watch (logs, progress) → JobResult."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

import attrs
from rich.console import Console
from rich.live import Live
from rich.text import Text

from dlrover_core import env
from dlrover_core.errors import JobSpecError, SchedulerError
from dlrover_core.fileio import write_atomic
from dlrover_core.logging import get_logger
from dlrover_core.plugins import get_host
from dlrover_core.protocol import JobResult, JobStatus
from dlrover_core.scheduler_backend import JobHandle, Plan, SchedulerBackend
from dlrover_core.spec import JobSpec
from dlrover_core.validation import validate_job

__all__ = ["HANDLE_FILE", "JobRun", "dryrun", "find_job", "save_handle", "submit"]

log = get_logger()

#: How long a terminal job may take to write its result (agents drain first).
_RESULT_WAIT_S = 60.0


def _backend(job: JobSpec) -> SchedulerBackend:
    return get_host().registries.scheduler.get(job.scheduler)()


def dryrun(job: JobSpec) -> Plan:
    """Validate ``job`` (:func:`~dlrover_core.validation.validate_job`) and return the plan
    it would run with, from its scheduler backend. No side effects."""
    validate_job(job)
    return _backend(job).dryrun(job)


def submit(job: JobSpec, *, detach: bool = False) -> JobRun:
    """Dry-run ``job``, submit the plan and return a :class:`JobRun` without waiting.

    A local job is cancelled when the process that submitted it exits (nothing is left
    running behind a crashed script); ``detach=True`` lets it outlive this process
    (``dlrover submit``), to be followed with ``dlrover status|logs|cancel``.
    """
    validate_job(job)
    backend = _backend(job)
    plan = backend.dryrun(job)
    if backend.capabilities.storage_on_submit_host:
        check_checkpoint_storage(job)
    if detach:
        plan = attrs.evolve(plan, processes=tuple(
            attrs.evolve(p, env={k: v for k, v in p.env.items() if k != env.WATCH_PID}) for p in plan.processes))
    handle = backend.submit(plan)
    save_handle(handle)
    log.info("job_submitted", job_id=handle.job_id, scheduler=backend.name, log_dir=handle.log_dir)
    return JobRun(backend=backend, plan=plan, handle=handle)


def check_checkpoint_storage(job: JobSpec) -> None:
    """Refuse a checkpoint storage this machine cannot write (a read-only or missing mount,
    no permission, a file where the directory should be) before anything starts.

    Raises:
        JobSpecError: names ``checkpoint.dir``, the storage's error and the fix.
    """
    storage = get_host().registries.storage.get(job.checkpoint.storage)(job.checkpoint.dir)
    try:
        storage.check_writable()
    except (OSError, ValueError) as exc:
        raise JobSpecError("checkpoint.dir", job.checkpoint.dir,
                           f"a location the job can write checkpoints to; {job.checkpoint.storage} storage "
                           f"failed a test write: {type(exc).__name__}: {exc}. Point Checkpoint(dir=...) at a "
                           "writable directory (or fix its permissions / mount)") from exc


#: The file in a job's log directory that lets a later process find the job again.
HANDLE_FILE = "job.json"


def save_handle(handle: JobHandle) -> None:
    """Write ``handle`` to ``<log_dir>/job.json`` (atomically), for ``dlrover status|logs|cancel``."""
    path = Path(handle.log_dir) / HANDLE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"scheduler": handle.scheduler, "job_id": handle.job_id, "log_dir": handle.log_dir,
                                   "native_id": handle.native_id}, indent=2))


def find_job(job_id: str, log_dir: str = "dlrover-runs") -> JobRun:
    """The :class:`JobRun` of a job submitted earlier, from ``<log_dir>/<job_id>/job.json``.

    Raises:
        SchedulerError: no such job under ``log_dir``, or its handle file is unreadable.
    """
    path = Path(log_dir) / job_id / HANDLE_FILE
    if not path.is_file():
        raise SchedulerError(f"no job {job_id!r} under {log_dir!r} ({path} does not exist); pass --log-dir "
                             "with the Job's log_dir")
    try:
        data = json.loads(path.read_text())
        handle = JobHandle(scheduler=data["scheduler"], job_id=data["job_id"], log_dir=data["log_dir"],
                           native_id=data.get("native_id", ""))
    except (ValueError, KeyError) as exc:
        raise SchedulerError(f"{path} is not a job handle: {exc}") from exc
    backend = get_host().registries.scheduler.get(handle.scheduler)()
    return JobRun(backend=backend, plan=None, handle=handle)


def _progress_text(s: JobStatus, elapsed_s: float) -> str:
    parts = [f"{s.state.value.lower()}", f"step {s.step if s.step >= 0 else '-'}"]
    for key in ("loss", "val_loss"):
        if key in s.metrics:
            parts.append(f"{key} {s.metrics[key]:.4f}")
    parts += [f"nodes {s.nodes}/{s.max_nodes}", f"restarts {s.restarts}", f"{elapsed_s:.0f} s"]
    return " | ".join(parts)


class JobRun:
    """A submitted job: ask its status, stream its logs, cancel it, or wait for its result."""

    def __init__(self, *, backend: SchedulerBackend, plan: Plan | None, handle: JobHandle) -> None:
        self.backend = backend
        self.plan = plan
        self.handle = handle

    @property
    def job_id(self) -> str:
        return self.handle.job_id

    def status(self) -> JobStatus:
        return self.backend.status(self.handle)

    def cancel(self) -> None:
        self.backend.cancel(self.handle)

    def logs(self, *, follow: bool = False) -> Any:
        return self.backend.logs(self.handle, follow=follow)

    def wait(self, *, progress: bool = True, timeout_s: float | None = None, poll_s: float = 0.5) -> JobResult:
        """Block until the job ends; return its :class:`JobResult`.

        With ``progress``, stream the job's logs (prefixed by node and rank) and show a live
        line (step, loss, nodes, restarts). Ctrl-C cancels the job. Every process the job
        started is gone when this returns.

        Raises:
            TimeoutError: ``timeout_s`` passed (the job is cancelled first).
        """
        console = Console(highlight=False)
        start = time.monotonic()
        pump: threading.Thread | None = None
        if progress:
            def copy_logs() -> None:
                for line in self.backend.logs(self.handle, follow=True):
                    console.print(Text(line), soft_wrap=True)

            pump = threading.Thread(target=copy_logs, name="dlrover-logs", daemon=True)
            pump.start()
        last_plain = 0.0
        last_key: tuple[Any, ...] = ()
        timed_out = False
        live = Live(console=console, auto_refresh=False, transient=True) if progress and console.is_terminal else None
        try:
            if live is not None:
                live.start()
            terminal_since: float | None = None
            while True:
                if self.backend.result(self.handle) is not None:
                    break
                self.backend.supervise(self.handle)
                status = self.status()
                if status.state.is_terminal:
                    # the result follows once agents have drained; a dead master never writes one
                    terminal_since = terminal_since or time.monotonic()
                    if time.monotonic() - terminal_since > _RESULT_WAIT_S:
                        break
                else:
                    terminal_since = None  # e.g. a requeued job runs again
                line = _progress_text(status, time.monotonic() - start)
                key = (status.state, status.nodes, status.restarts)
                if live is not None:
                    live.update(Text(line, style="bold"), refresh=True)
                elif progress and (time.monotonic() - last_plain > 15 or key != last_key):
                    console.print(Text("progress: " + line), soft_wrap=True)
                    last_plain = time.monotonic()
                last_key = key
                if timeout_s is not None and time.monotonic() - start > timeout_s:
                    timed_out = True
                    break
                time.sleep(poll_s)
        except KeyboardInterrupt:
            console.print(Text("interrupted: cancelling the job"))
        finally:
            if live is not None:
                live.stop()
            self.backend.cancel(self.handle)  # idempotent: ends the job, removes every process
            if pump is not None:
                pump.join(timeout=10)
        if timed_out:
            raise TimeoutError(f"job {self.job_id} did not finish within {timeout_s} s; it was cancelled")
        result = self.backend.result(self.handle)
        if result is None:
            raise SchedulerError(f"job {self.job_id} ended without a result; see {self.handle.log_dir}")
        if progress:
            console.print(Text(result.summary()), soft_wrap=True)
        return result
