"""Seeing a submitted job to its end: :class:`Supervisor` waits for the job's result while the
scheduler backend supervises it (``SchedulerBackend.supervise``: the ``local`` scheduler
restarts a master that died and tells the master at once of an agent process that exited),
cancels it on a stop signal (Ctrl-C, SIGTERM) or a timeout, makes sure every process it
started is gone, and returns its :class:`~dlrover_core.protocol.JobResult` (the signal that
stopped it, if one did, is its ``stop_signal``).

What a user sees meanwhile is not decided here: an :class:`Observer` (the progress display,
:class:`~dlrover_core.display.ProgressDisplay`) is told each status and each stop, and shows
them as it likes. ``JobRun.wait`` (:mod:`dlrover_core.runner`) puts the two together.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Protocol

from dlrover_core import rundir
from dlrover_core.errors import SchedulerError
from dlrover_core.protocol import JobResult, JobStatus
from dlrover_core.scheduler_backend import JobHandle, SchedulerBackend
from dlrover_core.stoplatch import StopLatch, process_latch

__all__ = ["RESULT_WAIT_S", "Observer", "Supervisor"]

#: Seconds a job seen in a terminal state may take to write its result (agents drain first);
#: after them supervision ends without waiting longer (a dead master never writes one).
RESULT_WAIT_S = 60.0
#: How often the wait between two supervision passes looks for the job's result file
#: (``<log_dir>/result.json``, a file check, no request): a job that ends is seen at once,
#: not up to a whole ``poll_s`` later (seconds).
RESULT_FILE_POLL_S = 0.05


class Observer(Protocol):
    """What a :class:`Supervisor` tells about the job while it waits (all on the calling thread)."""

    def start(self) -> object:
        """Supervision begins (before the first status)."""

    def update(self, status: JobStatus, elapsed_s: float) -> None:
        """The job's status, each poll; ``elapsed_s``: seconds since supervision began."""

    def note(self, event: str, text: str) -> None:
        """Supervision stops the job: ``event`` is ``"interrupted"``, ``text`` why
        (``"SIGTERM: cancelling the job"``)."""

    def stop(self) -> None:
        """Supervision ends (before the job is cancelled and its processes removed)."""


class Supervisor:
    """Sees the job of ``handle`` to its end (:meth:`run`), telling ``observer`` (default:
    nobody) what it sees.

    Attributes:
        stop_signal: the signal (SIGINT, SIGTERM) that made :meth:`run` cancel the job, once
            one did (else None): for :func:`~dlrover_core.display.exit_code` (130, 143). It is
            set before the job is cancelled, so it is there when :meth:`run` raises too.
    """

    def __init__(self, backend: SchedulerBackend, handle: JobHandle, *, observer: Observer | None = None) -> None:
        self.backend = backend
        self.handle = handle
        self.observer: Observer = observer if observer is not None else _Unobserved()
        self.stop_signal: int | None = None

    def run(self, *, timeout_s: float | None = None, poll_s: float = 0.5) -> JobResult:
        """Block until the job ends, supervising it every ``poll_s`` seconds; return its
        result (CANCELLED after a stop signal).

        It ends when the backend has the job's result, when a terminal state is not followed
        by a result within :data:`RESULT_WAIT_S`, on a stop signal, or after ``timeout_s``
        seconds. SIGINT and SIGTERM stop it when this runs in the main thread and their
        handling is Python's default (it is given back at the end), or when the process's
        stop latch is armed (``dlrover run --simulate-nodes``, :mod:`dlrover_core.stoplatch`);
        a ``KeyboardInterrupt`` raised by a handler of the caller's stops it too (SIGINT).
        However it ends, the job is cancelled then (idempotent: every process it started is
        removed).

        Raises:
            TimeoutError: ``timeout_s`` passed (the job was cancelled).
            SchedulerError: the job ended without a result.
        """
        backend, handle, observer = self.backend, self.handle, self.observer
        start = time.monotonic()
        latch, own_latch = _stop_latch()
        timed_out = False
        try:
            observer.start()
            terminal_since: float | None = None
            while True:
                if latch is not None and latch.signum is not None:
                    self.stop_signal = latch.signum
                    observer.note("interrupted", f"{latch.name}: cancelling the job")
                    break
                if backend.result(handle) is not None:
                    break
                backend.supervise(handle)
                status = backend.status(handle)
                if status.state.is_terminal:
                    # the result follows once agents have drained; a dead master never writes one
                    terminal_since = terminal_since or time.monotonic()
                    if time.monotonic() - terminal_since > RESULT_WAIT_S:
                        break
                else:
                    terminal_since = None  # e.g. a requeued job runs again
                observer.update(status, time.monotonic() - start)
                if timeout_s is not None and time.monotonic() - start > timeout_s:
                    timed_out = True
                    break
                _sleep_until_result(handle, poll_s, latch)
        except KeyboardInterrupt:  # SIGINT where a handler of the caller's raises it
            self.stop_signal = signal.SIGINT
            observer.note("interrupted", "cancelling the job")
        finally:
            observer.stop()
            if own_latch and latch is not None:
                latch.disarm()  # a second Ctrl-C while cancelling is the caller's again
            backend.cancel(handle)  # idempotent: ends the job, removes every process
        if timed_out:
            raise TimeoutError(f"job {handle.job_id} did not finish within {timeout_s} s; it was cancelled")
        result = backend.result(handle)
        if result is None:
            raise SchedulerError(f"job {handle.job_id} ended without a result; see {handle.log_dir}")
        return result


def _sleep_until_result(handle: JobHandle, poll_s: float, latch: StopLatch | None) -> None:
    """Sleep ``poll_s`` seconds, or less: until the master's result file appears (the next
    pass reads it through the backend) or a stop signal is latched."""
    result_file = rundir.RunDir(handle.log_dir).result
    deadline = time.monotonic() + poll_s
    while (left := deadline - time.monotonic()) > 0:
        if result_file.exists() or (latch is not None and latch.signum is not None):
            return
        time.sleep(min(RESULT_FILE_POLL_S, left))


class _Unobserved:
    """The observer of a job nobody watches: hears everything, shows nothing."""

    def start(self) -> None:
        pass

    def update(self, status: JobStatus, elapsed_s: float) -> None:
        pass

    def note(self, event: str, text: str) -> None:
        pass

    def stop(self) -> None:
        pass


def _stop_latch() -> tuple[StopLatch | None, bool]:
    """The latch :meth:`Supervisor.run` watches for SIGINT and SIGTERM, and whether it armed it:
    the process's own (``dlrover run --simulate-nodes`` armed it at its start), else one for
    those of the two whose handling is Python's default, armed now (in the main thread only:
    signals are handled there)."""
    process = process_latch()
    if process is not None and process.armed:
        return process, False
    if threading.current_thread() is not threading.main_thread():
        return None, False
    defaults = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
    ours = [s for s, handler in defaults.items() if signal.getsignal(s) is handler]
    if not ours:
        return None, False
    return StopLatch(ours).arm(), True
