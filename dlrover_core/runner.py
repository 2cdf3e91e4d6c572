"""``Job.run()``: resolve plugins → dry-run → submit → wait → JobResult.

:func:`submit` starts a job and gives its :class:`JobRun` (also found again later with
:func:`find_job`); :meth:`JobRun.wait` sees it to its end: the supervision is
:class:`~dlrover_core.supervision.Supervisor`'s, what the user sees meanwhile (logs, progress,
the summary) :class:`~dlrover_core.display.ProgressDisplay`'s, which observes it.
``exit_code``, ``log_record``, ``progress_fields`` and ``progress_line`` are
:mod:`dlrover_core.display`'s, named here too for the scripts that import them from here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import attrs

from dlrover_core import env, rundir
from dlrover_core.agent.launch import check_placement
from dlrover_core.display import (
    PLAIN_PROGRESS_EVERY_S,
    ProgressDisplay,
    exit_code,
    log_record,
    progress_fields,
    progress_line,
)
from dlrover_core.errors import JobSpecError, SchedulerError
from dlrover_core.fileio import write_atomic
from dlrover_core.logging import get_logger
from dlrover_core.plugins import get_host
from dlrover_core.protocol import JobResult, JobStatus
from dlrover_core.scheduler_backend import JobHandle, Plan, SchedulerBackend
from dlrover_core.spec import JobSpec
from dlrover_core.supervision import Supervisor
from dlrover_core.validation import validate_job

__all__ = ["HANDLE_FILE", "PLAIN_PROGRESS_EVERY_S", "JobRun", "check_checkpoint_storage", "check_worker_placement",
           "dryrun", "exit_code", "find_job", "log_record", "progress_fields", "progress_line", "save_handle", "submit"]

log = get_logger()


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
    if backend.capabilities.devices_on_submit_host:
        check_worker_placement(job)
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


def check_worker_placement(job: JobSpec) -> None:
    """With ``nodes.numa_binding`` or ``nodes.virtual_local_rank``: place each local rank's
    worker on this machine's devices now (:func:`~dlrover_core.agent.launch.check_placement`),
    so a binding that cannot apply here (no device with a NUMA node: cpu) refuses the job
    before anything starts, as torchrun fails before its workers run. For ``dlrover run``
    (each host checks its own) and schedulers whose nodes use this machine's devices.

    Raises:
        DeviceError: names the option and why it cannot apply.
    """
    if job.nodes.numa_binding is None and not job.nodes.virtual_local_rank:
        return
    accelerator = get_host().create_accelerator(job.accelerator)
    nproc = job.nodes.nproc_per_node
    check_placement(job, accelerator, accelerator.default_nproc_per_node() if nproc == "auto" else int(nproc))


#: The file in a job's log directory that lets a later process find the job again.
HANDLE_FILE = rundir.JOB


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


class JobRun:
    """A submitted job: ask its status, stream its logs, cancel it, or wait for its result.

    :meth:`wait` also supervises the job (:class:`~dlrover_core.supervision.Supervisor`, which
    calls ``SchedulerBackend.supervise``): on the ``local``
    scheduler it restarts a master that died and tells the master at once of an agent
    process that exited. :meth:`status` only reads; a caller that polls it instead of
    waiting leaves a killed agent to ``Failure.heartbeat_timeout_s`` and a dead master dead.
    """

    def __init__(self, *, backend: SchedulerBackend, plan: Plan | None, handle: JobHandle) -> None:
        self.backend = backend
        self.plan = plan
        self.handle = handle
        #: The signal (SIGINT, SIGTERM) that made :meth:`wait` cancel the job, if one did.
        self.stop_signal: int | None = None

    @property
    def job_id(self) -> str:
        return self.handle.job_id

    def status(self) -> JobStatus:
        """The job's status now (reads only: :meth:`wait` supervises)."""
        return self.backend.status(self.handle)

    def cancel(self) -> None:
        self.backend.cancel(self.handle)

    def logs(self, *, follow: bool = False) -> Any:
        return self.backend.logs(self.handle, follow=follow)

    def wait(self, *, progress: bool = True, timeout_s: float | None = None, poll_s: float = 0.5,
             progress_every_s: float = PLAIN_PROGRESS_EVERY_S) -> JobResult:
        """Block until the job ends; return its :class:`JobResult`.

        With ``progress``, stream the job's logs (prefixed by node and rank) and show a live
        line (:func:`progress_line`: step/total, ETA, samples/s, loss, goodput, nodes,
        restarts) on a terminal, else a plain ``progress: ...`` line every
        ``progress_every_s`` seconds and when the state, nodes or restarts change; then
        the result's summary (:class:`~dlrover_core.display.ProgressDisplay`). With
        ``DLROVER_LOG_FORMAT=json`` every line written to stdout is a JSON object instead: the
        logs (``node``/``rank`` fields, a non-JSON line as ``{"event": "output", "text": ...}``),
        ``{"event": "progress", ...}`` (:func:`progress_fields`) at the plain line's pace, and
        ``{"event": "result", ...}`` (``JobResult.to_record()``).

        Ctrl-C (SIGINT) or SIGTERM cancels the job (called from the main thread, where those
        signals have their default handling; it is given back at the end): the result is then
        CANCELLED and :attr:`stop_signal` names the signal, for :func:`exit_code` (130, 143).
        Every process the job started is gone when this returns. The waiting, the signals and
        the cancelling are :class:`~dlrover_core.supervision.Supervisor`'s; the display
        observes it.

        Raises:
            TimeoutError: ``timeout_s`` passed (the job is cancelled first).
            SchedulerError: the job ended without a result.
            ValueError: ``progress_every_s`` is not positive.
        """
        display = ProgressDisplay(self.job_id, progress=progress, every_s=progress_every_s)
        pump = display.follow(lambda: self.backend.logs(self.handle, follow=True)) if progress else None
        supervisor = Supervisor(self.backend, self.handle, observer=display)
        try:
            result = supervisor.run(timeout_s=timeout_s, poll_s=poll_s)
        finally:
            if supervisor.stop_signal is not None:
                self.stop_signal = supervisor.stop_signal
            if pump is not None:
                pump.join(timeout=10)
        if progress:
            display.result(result)
        return result
