"""Signals handled on a thread of their own, never inside the signal handler.

A Python signal handler runs in the main thread between two bytecodes, wherever that
thread happens to be: inside a log write (structlog's ``PrintLogger`` holds a lock per
file), inside an ``Event``'s condition, inside a buffered file's ``write``. Work done in the
handler that takes such a lock again deadlocks the process; writing the same buffered file
again raises ``RuntimeError: reentrant call``. The CPython documentation (``signal``, "Note
on Signal Handlers and Exceptions", and ``signal.set_wakeup_fd``) describes the interpreter's
wakeup fd as the way out, which :class:`SignalWatcher` uses: the handlers it installs do
nothing in Python; the interpreter's C-level handler writes each signal's number to a pipe
(:func:`signal.set_wakeup_fd`), and a daemon thread reading that pipe calls the callback as
ordinary code, free to take locks and to log.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterable, Mapping

from dlrover_core.logging import get_logger

__all__ = ["DEFAULT_STOP_SIGNALS", "SIGNALS_ENV", "SignalWatcher", "parse_signals", "stop_signals"]

#: The variable naming the signals that stop a job's processes gracefully, comma-separated
#: names (torchrun's ``--signals-to-handle``, which it exports to its workers under this name).
SIGNALS_ENV = "TORCHELASTIC_SIGNALS_TO_HANDLE"
#: torchrun's default for ``--signals-to-handle`` (``torch.distributed.run``).
DEFAULT_STOP_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def parse_signals(text: str) -> tuple[int, ...]:
    """``"SIGTERM,SIGHUP"`` -> their numbers, in order, without repeats.

    Raises:
        ValueError: a name that is not a signal of this platform, or SIGKILL or SIGSTOP,
            which no process can handle (names it).
    """
    out: list[int] = []
    for name in filter(None, (part.strip() for part in text.split(","))):
        try:
            number = int(signal.Signals[name])
        except KeyError:
            raise ValueError(f"{name!r} is not a signal name (e.g. SIGTERM, SIGHUP)") from None
        if number in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(f"{name} cannot be handled by any process: leave it out")
        if number not in out:
            out.append(number)
    return tuple(out)


def stop_signals(environ: Mapping[str, str] | None = None) -> tuple[int, ...]:
    """The signals on which a master or agent stops its job gracefully: SIGTERM and SIGINT,
    and those ``TORCHELASTIC_SIGNALS_TO_HANDLE`` names (set by ``dlrover run
    --signals-to-handle``, whose launcher forwards them), else torchrun's default list
    (adding SIGHUP, a closed terminal, and SIGQUIT). Unknown names there are skipped: the
    launcher checked them already."""
    text = (os.environ if environ is None else environ).get(SIGNALS_ENV) or DEFAULT_STOP_SIGNALS
    named: list[int] = []
    for part in text.split(","):
        with contextlib.suppress(ValueError):
            named.extend(parse_signals(part))
    return tuple(dict.fromkeys((int(signal.SIGTERM), int(signal.SIGINT), *named)))


#: A byte no signal has: written by :meth:`SignalWatcher.stop` to end the thread.
_STOP = 0


def _ignore(_signum: int, _frame: object) -> None:
    """The Python-level handler: nothing. (A Python handler must be installed for the
    interpreter to write the signal to the wakeup fd; SIG_DFL or SIG_IGN would not.)"""


class SignalWatcher:
    """Call ``callback(signum)`` on a daemon thread when one of ``signals`` arrives.

    Args:
        callback: called once per delivered signal, in the order they arrived, on the
            watcher's thread; an exception it raises is logged (``signal_callback_failed``)
            and the watcher goes on.
        signals: the signal numbers to watch (default :func:`stop_signals`).

    :meth:`start` must be called in the main thread (the only one that may install handlers
    or the wakeup fd) and replaces the process's wakeup fd; :meth:`stop` restores the
    previous handlers and wakeup fd. Signals that arrive in quick succession are each
    delivered (one byte each) unless the pipe is full (thousands pending), when extra ones
    are dropped.

    Raises:
        ValueError: ``start`` is called outside the main thread.
    """

    def __init__(self, callback: Callable[[int], None], signals: Iterable[int] | None = None) -> None:
        self._callback = callback
        self._signals = stop_signals() if signals is None else tuple(int(s) for s in signals)
        self._previous: dict[int, object] = {}
        self._previous_fd: int | None = None
        self._read_fd: int | None = None
        self._write_fd: int | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> SignalWatcher:
        if threading.current_thread() is not threading.main_thread():
            raise ValueError("SignalWatcher.start must be called in the main thread (signal handlers live there)")
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)  # the C handler must never block
        self._read_fd, self._write_fd = read_fd, write_fd
        self._thread = threading.Thread(target=self._run, name="dlrover-signals", daemon=True)
        self._thread.start()
        self._previous_fd = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        for signum in self._signals:
            self._previous[signum] = signal.signal(signum, _ignore)
        return self

    def stop(self) -> None:
        """Restore the handlers and the wakeup fd that were in place before :meth:`start`,
        and end the thread (after the callbacks of signals already read)."""
        if self._thread is None:
            return
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()
        signal.set_wakeup_fd(self._previous_fd if self._previous_fd is not None else -1)
        assert self._write_fd is not None
        with contextlib.suppress(BlockingIOError):
            os.write(self._write_fd, bytes([_STOP]))
        self._thread.join(timeout=5)
        for fd in (self._read_fd, self._write_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._read_fd = self._write_fd = None
        self._thread = None

    def _run(self) -> None:
        assert self._read_fd is not None
        while True:
            try:
                data = os.read(self._read_fd, 64)
            except OSError:
                return
            for signum in data:
                if signum == _STOP:
                    return
                if signum not in self._signals:  # another signal with a Python handler
                    continue
                try:
                    self._callback(signum)
                except Exception as exc:  # noqa: BLE001 - the watcher must survive a callback
                    get_logger().error("signal_callback_failed", signal=signal.Signals(signum).name,
                                       error=f"{type(exc).__name__}: {exc}")
            if not data:
                return
