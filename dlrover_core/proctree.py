"""One process-tree killer: SIGTERM, a grace period, then SIGKILL — for workers (agents),
agents and masters (the local scheduler)."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterable

import psutil

__all__ = ["kill_trees", "process_tree"]


def process_tree(pid: int) -> list[psutil.Process]:
    """``pid`` and all its descendants (empty if it is gone)."""
    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def kill_trees(pids: Iterable[int], *, grace_s: float, process_groups: Iterable[int] = ()) -> None:
    """SIGTERM every process tree rooted at ``pids``, wait up to ``grace_s`` seconds, then
    SIGKILL what is left (and wait up to 5 s more for it).

    Trees are collected before signalling, so grandchildren are found while their parents
    still live. A stopped (SIGSTOP) process gets SIGCONT after its SIGTERM, or it would
    handle it only when continued. The ``process_groups`` (ids; workers start with
    ``start_new_session``, so a worker's pid names its group) are signalled too: that
    reaches children re-parented away from a tree, even of a root that already exited.
    """
    groups = list(process_groups)
    procs = [p for pid in pids for p in process_tree(pid)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        live = []
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.send_signal(sig)
                live.append(p)
        for group in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, sig)
        if sig == signal.SIGTERM:
            for p in live:
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.send_signal(signal.SIGCONT)
            _, procs = psutil.wait_procs(live, timeout=grace_s)
            if not procs:
                return
        else:
            psutil.wait_procs(live, timeout=5.0)
