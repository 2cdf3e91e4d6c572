"""``Job.run()``: resolve plugins → dry-run → submit → watch (logs, progress) → JobResult."""

from __future__ import annotations

import json
import math
import re
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
from dlrover_core.logging import as_record, get_logger, json_mode, write_record
from dlrover_core.plugins import get_host
from dlrover_core.protocol import JobResult, JobStatus
from dlrover_core.scheduler_backend import JobHandle, Plan, SchedulerBackend
from dlrover_core.spec import JobSpec
from dlrover_core.validation import validate_job

__all__ = ["HANDLE_FILE", "JobRun", "dryrun", "find_job", "log_record", "progress_fields", "progress_line", "save_handle", "submit"]

log = get_logger()

#: How long a terminal job may take to write its result (agents drain first).
_RESULT_WAIT_S = 60.0
#: Seconds between two plain progress lines (or JSON progress objects) when nothing changed.
PLAIN_PROGRESS_EVERY_S = 15.0


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


def _duration(seconds: float) -> str:
    """``45s``, ``1m05s``, ``2h03m``, ``3d04h``."""
    total = int(round(seconds))
    if total < 60:
        return f"{total}s"
    minutes, secs = divmod(total, 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def _rate(value: float) -> str:
    """``512``, ``3.4``, ``32.8k``, ``1.25M``."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def progress_fields(s: JobStatus, elapsed_s: float | None = None) -> dict[str, Any]:
    """The numbers of the progress line, as a JSON-ready dict (``None``: unknown): ``state``,
    ``step``, ``total_steps``, ``percent``, ``eta_s``, ``step_time_s``, ``samples_per_s``,
    ``tokens_per_s``, ``loss``, ``val_loss``, ``goodput`` (0..1, so far), ``nodes``,
    ``max_nodes``, ``restarts``, ``elapsed_s`` (``s.elapsed_s``, else ``elapsed_s``)."""
    reported = s.step >= 0
    percent = None
    if reported and s.total_steps:
        percent = round(min(100.0, 100.0 * (s.step + 1) / s.total_steps), 1)
    goodput = s.goodput.get("goodput") if reported else None
    elapsed = s.elapsed_s if s.elapsed_s is not None else elapsed_s
    return {
        "state": s.state.value, "step": s.step if reported else None, "total_steps": s.total_steps,
        "percent": percent, "eta_s": s.eta_s if reported else None, "step_time_s": s.step_time_s,
        "samples_per_s": s.samples_per_s, "tokens_per_s": s.tokens_per_s,
        "loss": s.metrics.get("loss"), "val_loss": s.metrics.get("val_loss"), "goodput": goodput,
        "nodes": s.nodes, "max_nodes": s.max_nodes, "restarts": s.restarts,
        "elapsed_s": None if elapsed is None else round(elapsed, 1),
    }


def progress_line(s: JobStatus, elapsed_s: float | None = None) -> str:
    """``running | step 120/300 (40%) | ETA 1m05s | 512 samples/s | 32.8k tokens/s | loss 2.3100 |
    goodput 91% | nodes 2/2 | restarts 1 | 45 s``; what is unknown is left out (the step and
    goodput before the first ``train.report``, the total and the ETA without ``total_steps``,
    the rates without ``samples``/``tokens``)."""
    f = progress_fields(s, elapsed_s)
    parts = [f["state"].lower()]
    if f["step"] is not None:
        done = f" ({math.floor(f['percent'])}%)" if f["percent"] is not None else ""  # 100% only at the end
        parts.append(f"step {f['step']}" + (f"/{f['total_steps']}{done}" if f["total_steps"] else ""))
    if f["eta_s"] is not None and not s.state.is_terminal:
        parts.append(f"ETA {_duration(f['eta_s'])}")
    for key, unit in (("samples_per_s", "samples/s"), ("tokens_per_s", "tokens/s")):
        if f[key] is not None:
            parts.append(f"{_rate(f[key])} {unit}")
    for key in ("loss", "val_loss"):
        if f[key] is not None:
            parts.append(f"{key} {f[key]:.4f}")
    if f["goodput"] is not None:
        parts.append(f"goodput {f['goodput']:.0%}")
    if s.max_nodes:  # (0: unknown, e.g. an ended job's status read from its result)
        parts.append(f"nodes {s.nodes}/{s.max_nodes}")
    parts.append(f"restarts {s.restarts}")
    if f["elapsed_s"] is not None:
        parts.append(f"{f['elapsed_s']:.0f} s")
    return " | ".join(parts)


_SOURCE = re.compile(r"^\[([^\]]+)\] ?(.*)$", re.DOTALL)


def log_record(line: str) -> dict[str, Any]:
    """A line of ``backend.logs()`` (``[node-0] text``, ``[master] {json}``) as a JSON Lines
    object: a JSON line as it is, any other wrapped (``as_record``), with the node it came
    from (``node``) or ``"process": "master"``."""
    match = _SOURCE.match(line)
    if match is None:
        return as_record(line)
    source, text = match.groups()
    node = re.fullmatch(r"node[-_](\d+)", source)
    tags: dict[str, Any] = {"node": int(node.group(1))} if node else {"process": source}
    return as_record(text, **tags)


class JobRun:
    """A submitted job: ask its status, stream its logs, cancel it, or wait for its result.

    :meth:`wait` also supervises the job (``SchedulerBackend.supervise``): on the ``local``
    scheduler it restarts a master that died and tells the master at once of an agent
    process that exited. :meth:`status` only reads; a caller that polls it instead of
    waiting leaves a killed agent to ``Failure.heartbeat_timeout_s`` and a dead master dead.
    """

    def __init__(self, *, backend: SchedulerBackend, plan: Plan | None, handle: JobHandle) -> None:
        self.backend = backend
        self.plan = plan
        self.handle = handle

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
        the result's summary. With ``DLROVER_LOG_FORMAT=json`` every line written to stdout
        is a JSON object instead: the logs (``node``/``rank`` fields, a non-JSON line as
        ``{"event": "output", "text": ...}``), ``{"event": "progress", ...}``
        (:func:`progress_fields`) at the plain line's pace, and ``{"event": "result", ...}``
        (``JobResult.to_record()``). Ctrl-C cancels the job. Every process the job started is
        gone when this returns.

        Raises:
            TimeoutError: ``timeout_s`` passed (the job is cancelled first).
            ValueError: ``progress_every_s`` is not positive.
        """
        if not progress_every_s > 0:
            raise ValueError(f"progress_every_s={progress_every_s!r} must be > 0 (seconds between plain progress "
                             f"lines; the default is {PLAIN_PROGRESS_EVERY_S:g})")
        as_json = json_mode()
        console = Console(highlight=False)
        start = time.monotonic()
        pump: threading.Thread | None = None
        if progress:
            def copy_logs() -> None:
                for line in self.backend.logs(self.handle, follow=True):
                    if as_json:
                        write_record(log_record(line))
                    else:
                        console.print(Text(line), soft_wrap=True)

            pump = threading.Thread(target=copy_logs, name="dlrover-logs", daemon=True)
            pump.start()
        last_plain = 0.0
        last_key: tuple[Any, ...] = ()
        timed_out = False
        live = (Live(console=console, auto_refresh=False, transient=True)
                if progress and console.is_terminal and not as_json else None)
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
                elapsed_s = time.monotonic() - start
                key = (status.state, status.nodes, status.restarts)
                if live is not None:
                    live.update(Text(progress_line(status, elapsed_s), style="bold"), refresh=True)
                elif progress and (time.monotonic() - last_plain > progress_every_s or key != last_key):
                    if as_json:
                        write_record({"event": "progress", "job_id": self.job_id, **progress_fields(status, elapsed_s)})
                    else:
                        console.print(Text("progress: " + progress_line(status, elapsed_s)), soft_wrap=True)
                    last_plain = time.monotonic()
                last_key = key
                if timeout_s is not None and time.monotonic() - start > timeout_s:
                    timed_out = True
                    break
                time.sleep(poll_s)
        except KeyboardInterrupt:
            if as_json:
                write_record({"event": "interrupted", "job_id": self.job_id, "text": "cancelling the job"})
            else:
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
            if as_json:
                write_record(result.to_record())
            else:
                console.print(Text(result.summary()), soft_wrap=True)
        return result
