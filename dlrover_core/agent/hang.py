"""The agent's hang watcher: workers without progress, and their Python stacks.

A worker is hung when it reported no progress (a ``train.report`` step, a checkpoint save or
restore) for the hang timeout: ``Failure.hang_timeout_s``, or, once steps were seen, 20x the
median step time of the node's ranks, at least 60 s (slow steps in a healthy job vary by a
few x at most, and a minute is short next to the 30 minutes of gloo's default timeout).
Before its first report (imports, data loading, restore) a worker gets at least
``STARTUP_S``; a replacement joining the live world only until it asks to join: its wait to
be let in is held to the hang timeout (its node's step times carry over to it), so no live
re-form waits for ever. While the checkpoint saver writes, nobody is hung (a worker waiting
for a free snapshot slot waits for the storage).

Stacks are written next to the worker's log (``stacks_round<R>_rank<r>.txt``): by py-spy
when installed (it reads a stopped or stuck process from outside), else by the worker's own
faulthandler on SIGUSR1 (``dlrover_core.train`` registers it on ``DLROVER_STACK_FILE``).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from dlrover_core import rundir
from dlrover_core.agent.progress import ProgressTail
from dlrover_core.agent.workers import WorkerProcess
from dlrover_core.logging import get_logger
from dlrover_core.protocol.messages import WorkerFailure

__all__ = ["PEER_DUMP_GRACE_S", "STARTUP_S", "HangWatcher"]

log = get_logger()

#: Least time a worker gets before its first report before it counts as hung (seconds).
STARTUP_S = 300.0
#: After reporting a hang, how long the agent leaves its hung workers alive, so that the
#: other agents dump their workers' stacks before the connections they hang on drop (seconds).
PEER_DUMP_GRACE_S = 2.0


class HangWatcher:
    """Finds the hung workers of one node and dumps their stacks.

    Args:
        node_id: the node (for logs).
        node_dir: where the stack files go (beside the workers' logs).
        hang_timeout_s: ``Failure.hang_timeout_s`` (``None``: derived from step times).
        storage_busy: whether the node's checkpoint saver is writing (no hang meanwhile).
    """

    def __init__(self, *, node_id: int, node_dir: Path, hang_timeout_s: float | None,
                 storage_busy: Callable[[], bool]) -> None:
        self.node_id = node_id
        self.node_dir = node_dir
        self.hang_timeout_s = hang_timeout_s
        self._storage_busy = storage_busy

    def stack_file(self, round_index: int, rank: int) -> Path:
        """Where a worker's stacks are written (``DLROVER_STACK_FILE``)."""
        return self.node_dir / rundir.stack_file(round_index, rank)

    def timeout_s(self, tails: Mapping[int, ProgressTail]) -> float | None:
        """The hang timeout: ``Failure.hang_timeout_s``, or derived once steps were seen
        (20x the median step time of the node's ranks, at least 60 s). ``None``: not known
        yet (no detection)."""
        if self.hang_timeout_s is not None:
            return self.hang_timeout_s
        times = sorted(t for tail in tails.values() for t in tail.step_times)
        if len(times) < 3:
            return None
        return max(60.0, 20 * times[len(times) // 2])

    def hung(self, workers: Sequence[WorkerProcess], tails: Mapping[int, ProgressTail]) -> list[WorkerProcess]:
        """Live workers without progress for the hang timeout. Before a worker's first
        report the timeout is at least :data:`STARTUP_S`."""
        timeout = self.timeout_s(tails)
        if timeout is None:
            return []
        if self._storage_busy():
            return []  # a worker waiting for a free snapshot slot waits for the storage, not hung
        now = time.monotonic()
        hung = []
        for w in workers:
            tail = tails[w.rank]
            # a replacement that asked to join (live_ready) has started up: a wait to join
            # that outlasts the hang timeout is a hang like any other, never an endless wait
            started = tail.last_step >= 0 or (tail.joiner and tail.live)
            limit = timeout if started else max(timeout, STARTUP_S)
            if w.poll() is None and not tail.done and now - tail.last_progress > limit:
                hung.append(w)
        return hung

    def dump_stacks(self, round_index: int, workers: Sequence[WorkerProcess]) -> list[str]:
        """Write each worker's Python stacks next to its log: py-spy when installed, else the
        worker's faulthandler (SIGUSR1). Returns the files."""
        beside = Path(sys.executable).with_name("py-spy")  # installed in this venv, maybe not on PATH
        py_spy = shutil.which("py-spy") or (str(beside) if beside.exists() else None)
        written = []
        for w in workers:
            path = self.stack_file(round_index, w.rank)
            if py_spy:
                try:
                    out = subprocess.run([py_spy, "dump", "--pid", str(w.pid), "--nonblocking"], capture_output=True,
                                         text=True, timeout=20)
                    path.write_text(out.stdout + out.stderr)
                except (subprocess.TimeoutExpired, OSError) as exc:
                    path.write_text(f"py-spy failed: {exc}\n")
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.pid, signal.SIGUSR1)
                time.sleep(1.0)
            written.append(str(path))
        return written

    def dump_stalled(self, round_index: int, workers: Sequence[WorkerProcess],
                     tails: Mapping[int, ProgressTail]) -> None:
        """Before workers are stopped on the master's order: dump the stacks of those
        without progress for half the hang timeout — another node saw the hang first, and
        these are likely stuck in the same collective (their stacks say where)."""
        timeout = self.timeout_s(tails)
        if timeout is None:
            return
        now = time.monotonic()
        stalled = [w for w in workers if w.poll() is None and now - tails[w.rank].last_progress > timeout / 2]
        if stalled:
            stacks = self.dump_stacks(round_index, stalled)
            log.warning("workers_stalled", node_id=self.node_id, ranks=[w.rank for w in stalled], stacks=stacks)

    def failures(self, round_index: int, workers: Sequence[WorkerProcess], hung: Sequence[WorkerProcess],
                 tails: Mapping[int, ProgressTail], *, stopped: bool = False) -> list[WorkerFailure]:
        """Dump every worker's stacks (the hung ones' peers too) and describe the hang: one
        failure per hung worker, for the master. ``stopped``: the hung workers are stopped
        processes (SIGSTOP), the ones the others wait on: they alone can be replaced."""
        timeout = self.timeout_s(tails)
        stacks = self.dump_stacks(round_index, workers)
        log.warning("workers_hung", node_id=self.node_id, ranks=[w.rank for w in hung], timeout_s=timeout,
                    steps={w.rank: tails[w.rank].last_step for w in hung}, stacks=stacks)
        now = time.monotonic()
        state = "process stopped; " if stopped else ""
        return [WorkerFailure(rank=w.rank, local_rank=w.local_rank, kind="hang", replaceable=stopped,
                              silent_s=round(now - tails[w.rank].last_progress, 3),
                              detail=f"{state}no progress for {timeout:g} s at step {tails[w.rank].last_step}; "
                                     f"stacks: {self.stack_file(round_index, w.rank)}") for w in hung]
