"""Worker processes: start with the torch environment, stream their output, kill whole trees."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from dlrover_core.agent.forkserver import ForkedProcess, Standby, launcher
from dlrover_core.env import CONSOLE_LOCAL_RANKS, NODE_ID
from dlrover_core.logging import as_record, json_mode, write_record
from dlrover_core.proctree import kill_trees as _kill_trees

__all__ = ["WorkerProcess", "kill_trees"]


def _on_console(local_rank: int) -> bool:
    """Whether a worker's output goes to the agent's console (``DLROVER_CONSOLE_LOCAL_RANKS``)."""
    ranks = os.environ.get(CONSOLE_LOCAL_RANKS)
    if ranks is None:
        return True
    return str(local_rank) in {r.strip() for r in ranks.split(",")}


class WorkerProcess:
    """One worker: its process, and a thread copying its output to a log file and to the
    agent's stdout with a ``[rank N]`` prefix.

    The worker runs in its own session (process group), so the whole tree it forks can be
    signalled, and it is killed by the kernel if the agent dies (``PR_SET_PDEATHSIG``).
    With ``standby`` the node's warm standby forks it (:mod:`dlrover_core.agent.forkserver`).

    Raises:
        StandbyGone: the standby could not fork it (the caller starts it without one).
    """

    def __init__(
        self,
        *,
        rank: int,
        local_rank: int,
        argv: Sequence[str],
        env: dict[str, str],
        cwd: str,
        log_file: Path,
        echo: IO[str] | None = None,
        standby: Standby | None = None,
    ) -> None:
        self.rank = rank
        self.local_rank = local_rank
        self.log_file = log_file
        self.warm = standby is not None
        self.popen: subprocess.Popen | ForkedProcess
        if standby is not None:
            self.popen = standby.fork(argv=argv, env=env, cwd=cwd)
        else:
            self.popen = subprocess.Popen(
                [*launcher(), *argv], env=env, cwd=cwd, stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
            )
        self.pid = self.popen.pid
        self._echo = echo if _on_console(local_rank) else None
        node = env.get(NODE_ID, "")
        self._node = int(node) if node.lstrip("-").isdigit() else None
        self._pump = threading.Thread(target=self._copy_output, name=f"dlrover-log-rank{rank}", daemon=True)
        self._pump.start()

    def _copy_output(self) -> None:
        assert self.popen.stdout is not None
        prefix = f"[rank {self.rank}] "
        as_json = json_mode()  # JSON Lines: each line an object with the node and rank it came from
        with open(self.log_file, "ab") as f:
            for line in iter(self.popen.stdout.readline, b""):
                f.write(line)
                f.flush()
                if self._echo is not None:
                    try:
                        text = line.decode(errors="replace")
                        if as_json:
                            write_record(as_record(text, node=self._node, rank=self.rank), self._echo)
                        else:
                            self._echo.write(prefix + text)
                            self._echo.flush()
                    except (ValueError, OSError):
                        pass

    def poll(self) -> int | None:
        return self.popen.poll()

    def join_output(self, timeout_s: float = 2.0) -> None:
        """Wait until the output of an exited worker has been copied."""
        self._pump.join(timeout_s)


def kill_trees(workers: Sequence[WorkerProcess], *, grace_s: float) -> None:
    """Stop every live worker's process tree and process group
    (:func:`dlrover_core.proctree.kill_trees`), then reap the workers and copy the rest of
    their output."""
    _kill_trees([w.pid for w in workers if w.poll() is None], grace_s=grace_s,
                process_groups=[w.pid for w in workers])
    deadline = time.monotonic() + 5.0
    for w in workers:
        try:
            w.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        w.join_output()
