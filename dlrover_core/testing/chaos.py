"""Fault injection: send a real signal to a real worker of a running job."""

from __future__ import annotations

import os
import signal as signal_module
import threading
import time
from typing import Any

import attrs

__all__ = ["Kill", "kill_worker_at_step"]


@attrs.define
class Kill:
    """What a chaos thread did: ``step`` is rank 0's reported step when the signal was sent
    (``None`` until then); ``pid`` the process signalled."""

    rank: int
    at_step: int
    signal: int
    step: int | None = None
    pid: int | None = None
    done: threading.Event = attrs.field(factory=threading.Event)


def kill_worker_at_step(
    run: Any,
    *,
    step: int,
    rank: int,
    sig: int = signal_module.SIGKILL,
    timeout_s: float = 600.0,
    poll_s: float = 0.05,
) -> Kill:
    """In a background thread, send ``sig`` to worker ``rank`` of ``run`` (a
    :class:`~dlrover_core.runner.JobRun`) once the job reports ``step`` or later.

    Only the first attempt is hit: the thread stops after one signal. Returns a :class:`Kill`
    that is filled in when the signal is sent (``kill.done`` is set).
    """
    kill = Kill(rank=rank, at_step=step, signal=sig)

    def loop() -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                status = run.status()
            except Exception:
                status = None
            if status is not None:
                if status.state.is_terminal:
                    break
                pid = status.worker_pids.get(rank)
                if status.step >= step and pid and status.restarts == 0:
                    try:
                        os.kill(pid, sig)
                    except ProcessLookupError:
                        pass
                    else:
                        kill.step, kill.pid = status.step, pid
                        break
            time.sleep(poll_s)
        kill.done.set()

    threading.Thread(target=loop, name="dlrover-chaos", daemon=True).start()
    return kill
