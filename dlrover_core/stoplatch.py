"""Stop signals kept from a launcher's first instruction until it can act on them.

``dlrover run`` owns SIGINT, SIGTERM and torchrun's other stop signals from the moment its
Python code starts: before it has imported the rest of dlrover (about half a second on a
small machine), parsed its flags, loaded the plugins or forked its agent and job master, a
Ctrl-C or a SIGTERM must neither kill it half-way (leaving a run directory whose master never
answers) nor be lost. :class:`StopLatch` installs a handler that only records the first
signal (a Python handler that assigns attributes: it takes no lock and does no I/O, so it is
safe wherever the main thread is); the launcher looks at :attr:`StopLatch.signum` between its
steps and, once it supervises its processes, acts on it (:mod:`dlrover_core.hostrun`).

Importing ``dlrover_core`` arms the process's latch when the process is ``dlrover run``
(:func:`arm_for_command`, called by the package's ``__init__`` before anything else is
imported), so this module imports only the standard library. What it cannot cover: a signal
that arrives before Python runs its first line of ``dlrover_core`` (the interpreter's own
start, about 30 ms), which Python handles by default (SIGINT: ``KeyboardInterrupt`` during
the start; SIGTERM: the process ends).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Sequence

__all__ = ["DEFAULT_SIGNALS", "StopLatch", "arm_for_command", "process_latch"]

#: torchrun's default ``--signals-to-handle`` (``torch.distributed.run``): the signals a
#: launcher takes as "stop the job" before it has read its flags.
DEFAULT_SIGNALS: tuple[int, ...] = (int(signal.SIGTERM), int(signal.SIGINT), int(signal.SIGHUP), int(signal.SIGQUIT))


class StopLatch:
    """Record the first of ``signals`` this process receives, and act later.

    Attributes:
        signals: the signal numbers it handles.
        signum: the first one received (``None``: none yet).
        received_at: when it arrived (``time.time()``, seconds since the epoch).
        count: how many of them arrived in all.
    """

    def __init__(self, signals: Iterable[int] = DEFAULT_SIGNALS) -> None:
        self.signals = tuple(dict.fromkeys(int(s) for s in signals))
        self.signum: int | None = None
        self.received_at: float | None = None
        self.count = 0
        self._previous: dict[int, object] = {}

    @property
    def armed(self) -> bool:
        """Whether its handlers are installed."""
        return bool(self._previous)

    @property
    def name(self) -> str | None:
        """The first signal's name (``"SIGINT"``), or ``None``."""
        return None if self.signum is None else signal.Signals(self.signum).name

    def _record(self, signum: int, _frame: object) -> None:
        # only assignments: a handler runs between two bytecodes of the main thread, wherever it is
        if self.signum is None:
            self.signum = signum
            self.received_at = time.time()
        self.count += 1

    def arm(self) -> StopLatch:
        """Install the recording handler for each of :attr:`signals` (main thread only;
        elsewhere, and for a signal already handled by this latch, nothing changes)."""
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                if signum not in self._previous:
                    self._previous[signum] = signal.signal(signum, self._record)
        return self

    def handle_only(self, signals: Sequence[int]) -> StopLatch:
        """Handle exactly ``signals`` from now on (``dlrover run --signals-to-handle``): arm
        those not handled yet; give every other one its previous handling back, and one of
        those that arrived meanwhile is delivered again, as if it came now, and forgotten here."""
        keep = tuple(dict.fromkeys(int(s) for s in signals))
        for signum in [s for s in self._previous if s not in keep]:
            signal.signal(signum, self._previous.pop(signum))  # type: ignore[arg-type]
            if self.signum == signum:
                self.signum, self.received_at, self.count = None, None, 0
                os.kill(os.getpid(), signum)
        self.signals = keep
        return self.arm()

    def disarm(self) -> None:
        """Give every signal its previous handling back (what was received is kept)."""
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)  # type: ignore[arg-type]
        self._previous.clear()


_PROCESS_LATCH: StopLatch | None = None


def _is_dlrover_run(argv: Sequence[str], orig_argv: Sequence[str]) -> bool:
    """``dlrover run ...`` (the console script) or ``python -m dlrover_core.cli run ...``."""
    if len(argv) >= 2 and os.path.basename(argv[0]) in ("dlrover", "dlrover.exe") and argv[1] == "run":
        return True
    for i, arg in enumerate(orig_argv[:-2]):
        if arg == "-m":
            return orig_argv[i + 1] == "dlrover_core.cli" and orig_argv[i + 2] == "run"
    return False


def arm_for_command(argv: Sequence[str] | None = None, orig_argv: Sequence[str] | None = None) -> StopLatch | None:
    """Arm this process's latch (:data:`DEFAULT_SIGNALS`) if the process is ``dlrover run``,
    once; return it (``None`` in any other process: nothing is installed there)."""
    global _PROCESS_LATCH
    if _PROCESS_LATCH is None and _is_dlrover_run(sys.argv if argv is None else argv,
                                                  getattr(sys, "orig_argv", ()) if orig_argv is None else orig_argv):
        _PROCESS_LATCH = StopLatch().arm()
    return _PROCESS_LATCH


def process_latch() -> StopLatch | None:
    """The latch :func:`arm_for_command` armed in this process, if any."""
    return _PROCESS_LATCH


arm_for_command()  # on import: `dlrover run` keeps its stop signals from here on (the module docstring says why)
