"""Worker processes: start with the torch environment, stream their output, kill whole trees."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from dlrover_core.env import CONSOLE_LOCAL_RANKS, CPU_AFFINITY, NODE_ID, STANDBY_READY_FD
from dlrover_core.logging import as_record, json_mode, write_record
from dlrover_core.proctree import kill_trees as _kill_trees

__all__ = ["Standby", "WorkerProcess", "kill_trees"]

# Runs in the child before exec: die with the agent (PR_SET_PDEATHSIG = 1), and exit if the
# agent is already gone (the race between fork and prctl); bind it to the CPUs in
# DLROVER_CPU_AFFINITY ("0-7,16-23", --numa-binding) if set, which the program exec'd and every
# thread it starts inherit (what `numactl --physcpubind`, torchrun's way, does). A tiny
# interpreter start instead of preexec_fn, which is unsafe in a process with threads.
_PDEATHSIG_EXEC = (
    "import ctypes,os,signal,sys;"
    "ctypes.CDLL(None,use_errno=True).prctl(1,signal.SIGKILL,0,0,0);"
    "os.getppid()==int(sys.argv[1]) or os._exit(1);"
    f"a=os.environ.get({CPU_AFFINITY!r});"
    "a and os.sched_setaffinity(0,{c for p in a.split(',') for c in range(int(p.split('-')[0]),int(p.split('-')[-1])+1)});"
    "os.execvp(sys.argv[2],sys.argv[2:])"
)


def _launcher() -> list[str]:
    if sys.platform == "linux":
        return [sys.executable, "-S", "-c", _PDEATHSIG_EXEC, str(os.getpid())]
    return []


class Standby:
    """A warm spare worker (:mod:`dlrover_core.agent.standby`): started now, it imports what
    workers need and waits; :meth:`activate` turns it into a worker."""

    def __init__(self, *, env: dict[str, str], cwd: str) -> None:
        self._ready_r, ready_w = os.pipe()
        try:
            self.popen = subprocess.Popen(
                [*_launcher(), sys.executable, "-u", "-m", "dlrover_core.agent.standby"],
                env={**env, STANDBY_READY_FD: str(ready_w)}, cwd=cwd, pass_fds=(ready_w,),
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
            )
        finally:
            os.close(ready_w)
        os.set_blocking(self._ready_r, False)
        self._ready = False

    def alive(self) -> bool:
        return self.popen.poll() is None

    def ready(self) -> bool:
        """Whether it finished warming up (imports, a first step): activated before that, it
        would start the worker later than a fresh process would."""
        if not self._ready:
            with contextlib.suppress(BlockingIOError, OSError):
                self._ready = os.read(self._ready_r, 1) == b"1"
        return self._ready

    def activate(self, *, argv: Sequence[str], env: dict[str, str], cwd: str) -> subprocess.Popen:
        """Hand the standby its worker command; returns its process (now the worker)."""
        assert self.popen.stdin is not None
        self.popen.stdin.write((json.dumps({"argv": list(argv), "env": env, "cwd": cwd}) + "\n").encode())
        self.popen.stdin.close()
        self._close_pipe()
        return self.popen

    def _close_pipe(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._ready_r)

    def close(self) -> None:
        """Retire an unused standby: closing its stdin makes a warm one exit; one still
        warming up reads stdin only once warm, so it is killed (it holds nothing yet)."""
        ready = self.ready()
        self._close_pipe()
        with contextlib.suppress(OSError, ValueError):
            if self.popen.stdin is not None:
                self.popen.stdin.close()
        if not ready:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()


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
    With ``standby`` the worker is that warm process, activated with this command.
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
        if standby is not None:
            self.popen = standby.activate(argv=argv, env=env, cwd=cwd)
        else:
            self.popen = subprocess.Popen(
                [*_launcher(), *argv], env=env, cwd=cwd, stdin=subprocess.DEVNULL,
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
