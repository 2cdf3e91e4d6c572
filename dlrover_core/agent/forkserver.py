"""The agent's side of a node's warm standby: a fork server that turns into workers.

One standby per node (:mod:`dlrover_core.agent.standby`, started by the agent when it starts)
imports what workers need once — torch, numpy, safetensors, ``dlrover_core.train``, the
plugin host, the optimizers' first-use imports — and then forks every worker of the node
from that warm state: the first ones, the replacements in a live world, and every restart.
A worker so skips starting Python and importing torch (3–5 CPU-seconds each on this kind of
machine), and the node pays for the imports once instead of once per worker and per restart.
This is the zygote of Android and the ``forkserver`` start method of :mod:`multiprocessing`.

The wire, over a Unix socket pair (``socketpair(2)``):

- agent → standby: one request per worker, a 5-byte header ``b"F" + len`` (big-endian
  ``uint32``) that carries the write end of the worker's output pipe (``SCM_RIGHTS``,
  :func:`socket.send_fds`), then ``len`` bytes of JSON ``{"id", "argv", "env", "cwd"}``: the
  request's number and the exact command, environment and directory a cold worker would
  get. Closing the socket retires the standby.
- standby → agent: JSON lines, ``{"event": "ready"}`` once warm, ``{"event": "started",
  "id", "pid"}`` after each fork, ``{"event": "exited", "pid", "returncode"}`` when it reaps a
  worker (``returncode`` as :class:`subprocess.Popen`'s: ``-N`` for a signal). An answer
  that comes after its request gave up is not adopted: that worker is killed.

The forked workers are the standby's children, not the agent's: :class:`ForkedProcess`
gives the agent the :class:`subprocess.Popen` calls it uses (``pid``, ``stdout``, ``poll``,
``wait``, ``returncode``) from the standby's reports. Each worker runs in its own session,
is killed by the kernel when the standby dies (``PR_SET_PDEATHSIG``), and the standby is
killed when the agent dies; a standby that dies leaves its workers' exit code ``-9``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import psutil

from dlrover_core.env import CPU_AFFINITY, JOB_ID, STANDBY_FD, WATCH_PID
from dlrover_core.errors import DLRoverError
from dlrover_core.logging import get_logger

__all__ = ["ForkedProcess", "Standby", "StandbyGone", "launcher", "recv_request", "send_event"]

log = get_logger()

_HEADER = struct.Struct("!cI")  # b"F", payload length
#: How long a fork request waits for the standby's answer (it forks at once when warm).
_FORK_TIMEOUT_S = 30.0


class StandbyGone(DLRoverError):
    """The standby exited (or did not answer) before it could fork the worker: start it cold."""


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


def launcher() -> list[str]:
    """The prefix of a command line that makes the process die with this one (Linux; empty elsewhere)."""
    if sys.platform == "linux":
        return [sys.executable, "-S", "-c", _PDEATHSIG_EXEC, str(os.getpid())]
    return []


# ----- the wire -----------------------------------------------------------------------------------


def send_event(sock: socket.socket, **event: Any) -> None:
    """Send one event line to the agent (the standby's side)."""
    sock.sendall(json.dumps(event).encode() + b"\n")


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = sock.recv(left)
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def recv_request(sock: socket.socket) -> tuple[dict[str, Any], int] | None:
    """The next fork request and its output fd (the standby's side); None when the agent closed.

    Raises:
        ValueError: a malformed request (not this wire's header, or JSON without the keys).
    """
    data, fds, _flags, _addr = socket.recv_fds(sock, _HEADER.size, 1)
    if not data:
        return None
    if len(data) < _HEADER.size:
        rest = _recv_exact(sock, _HEADER.size - len(data))
        if rest is None:
            return None
        data += rest
    kind, length = _HEADER.unpack(data)
    if kind != b"F" or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        raise ValueError(f"not a fork request: header {data!r} with {len(fds)} descriptor(s)")
    payload = _recv_exact(sock, length)
    if payload is None:
        os.close(fds[0])
        return None
    request = json.loads(payload)
    if not {"argv", "env", "cwd"} <= set(request):
        os.close(fds[0])
        raise ValueError(f"a fork request needs argv, env and cwd, got {sorted(request)}")
    return request, fds[0]


# ----- the agent's side ----------------------------------------------------------------------------


class ForkedProcess:
    """A worker the standby forked, with the :class:`subprocess.Popen` calls the agent uses.

    Args:
        pid: the worker's process id.
        stdout: the read end of its output pipe (stdout and stderr together), binary.
        standby: the standby that forked it and reports its exit.
    """

    def __init__(self, *, pid: int, stdout: Any, standby: Standby) -> None:
        self.pid = pid
        self.stdout = stdout
        self.args: list[str] = []
        self._standby = standby

    @property
    def returncode(self) -> int | None:
        return self._standby.returncode(self.pid)

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """The exit code, waiting up to ``timeout`` seconds (forever when None).

        Raises:
            subprocess.TimeoutExpired: still running after ``timeout``.
        """
        code = self._standby.wait_exit(self.pid, timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return code


class Standby:
    """A node's warm standby (:mod:`dlrover_core.agent.standby`): started now, it imports
    what workers need, then :meth:`fork` turns it into as many workers as asked, at once.

    Args:
        env: its environment: the workers' values of what libraries read when imported
            (``OMP_NUM_THREADS``, the accelerator's variables, ``Job.env``).
        cwd: its working directory.
        log_file: where its own output goes (warnings and errors of the warm-up).
        job_id: the job's id, on its command line and in its environment (``ps``, cleanup).
        low_priority: warm up at nice 19 (:func:`dlrover_core.agent.standby._preload_at_low_priority`):
            for a standby started while workers train on the node.
    """

    def __init__(self, *, env: dict[str, str], cwd: str, log_file: Path | None = None, job_id: str = "",
                 low_priority: bool = False) -> None:
        self.low_priority = low_priority
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        argv = [*launcher(), sys.executable, "-u", "-m", "dlrover_core.agent.standby"]
        if low_priority:
            argv.append("--low-priority")
        if job_id:
            argv += ["--job-id", job_id]
        out = open(log_file, "ab") if log_file is not None else subprocess.DEVNULL  # noqa: SIM115 (closed below)
        try:
            self.popen = subprocess.Popen(
                argv, env={**env, STANDBY_FD: str(theirs.fileno()), **({JOB_ID: job_id} if job_id else {})},
                cwd=cwd, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
        finally:
            theirs.close()
            if out is not subprocess.DEVNULL:
                out.close()
        self.pid = self.popen.pid
        self._sock = ours
        self._request_lock = threading.Lock()  # one request on the socket at a time
        self._exits = threading.Condition()  # guards the tables below
        self._requests = 0  # the last request's number
        self._answers: dict[int, tuple[int | None, str]] = {}  # request number -> (pid forked or None, why not)
        self._abandoned: set[int] = set()  # requests that gave up waiting: their late worker is killed
        self._codes: dict[int, int] = {}  # worker pid -> exit code
        self._forked: set[int] = set()  # pids of workers not reaped yet
        self._ready = threading.Event()
        self._gone = threading.Event()
        self._reader = threading.Thread(target=self._read_events, name="dlrover-standby-events", daemon=True)
        self._reader.start()

    # ----- state -------------------------------------------------------------------------

    def alive(self) -> bool:
        return not self._gone.is_set() and self.popen.poll() is None

    @property
    def warmed(self) -> bool:
        """Whether it ever said it was ready (also after it exited)."""
        return self._ready.is_set()

    def ready(self) -> bool:
        """Whether it finished warming up and can fork (one still warming up would start a
        worker later than a fresh process would, were it started at low priority)."""
        return self._ready.is_set() and self.alive()

    def wait_ready(self, timeout_s: float, stop: threading.Event | None = None) -> bool:
        """Wait until it is ready, it exits, ``stop`` is set or ``timeout_s`` passes; whether ready."""
        deadline = time.monotonic() + timeout_s
        while not self._ready.is_set() and not self._gone.is_set() and time.monotonic() < deadline:
            if stop is not None and stop.is_set():
                break
            self._ready.wait(0.05)
        return self.ready()

    # ----- forking -----------------------------------------------------------------------

    def fork(self, *, argv: Sequence[str], env: dict[str, str], cwd: str) -> ForkedProcess:
        """Fork a worker that runs ``argv`` (``python [-u] script|-m module args``) with
        ``env`` in ``cwd``, its output on a new pipe.

        Raises:
            StandbyGone: the standby exited or did not answer within 30 s.
        """
        if not self.ready():
            raise StandbyGone("the standby is not ready")
        read_end, write_end = os.pipe()
        try:
            with self._request_lock:
                self._requests += 1
                number = self._requests
                # the worker watches its parent, the standby (``dlrover_core.train.process_group``)
                payload = json.dumps({"id": number, "argv": list(argv), "env": {**env, WATCH_PID: str(self.pid)},
                                      "cwd": cwd}).encode()
                try:
                    socket.send_fds(self._sock, [_HEADER.pack(b"F", len(payload))], [write_end])
                    self._sock.sendall(payload)
                except OSError as exc:
                    raise StandbyGone(f"the standby's socket is closed: {exc}") from exc
                finally:
                    os.close(write_end)
            with self._exits:
                self._exits.wait_for(lambda: number in self._answers or self._gone.is_set(), _FORK_TIMEOUT_S)
                answered = number in self._answers
                pid, error = self._answers.pop(number, (None, ""))
                if not answered:
                    self._abandoned.add(number)
        except BaseException:
            os.close(read_end)
            raise
        if pid is None:
            os.close(read_end)
            raise StandbyGone(f"the standby did not fork the worker: {error}" if error else
                              f"the standby did not fork the worker (it exited, or took over {_FORK_TIMEOUT_S:.0f} s)")
        return ForkedProcess(pid=pid, stdout=os.fdopen(read_end, "rb"), standby=self)

    def returncode(self, pid: int) -> int | None:
        with self._exits:
            return self._codes.get(pid)

    def wait_exit(self, pid: int, timeout_s: float | None) -> int | None:
        """A worker's exit code once the standby reaped it; None after ``timeout_s``."""
        with self._exits:
            self._exits.wait_for(lambda: pid in self._codes, timeout_s)
            return self._codes.get(pid)

    def _read_events(self) -> None:
        try:
            with self._sock.makefile("rb") as lines:
                for line in lines:
                    try:
                        event = json.loads(line)
                    except ValueError:
                        continue
                    kind = event.get("event")
                    if kind == "ready":
                        self._ready.set()
                    elif kind == "started":
                        self._on_started(int(event["id"]), event.get("pid"), str(event.get("error") or ""))
                    elif kind == "exited":
                        with self._exits:
                            self._forked.discard(int(event["pid"]))
                            self._codes[int(event["pid"])] = int(event["returncode"])
                            self._exits.notify_all()
        except (OSError, ValueError):
            pass
        self._on_gone()

    def _on_started(self, number: int, pid: int | None, error: str) -> None:
        with self._exits:
            if number in self._abandoned:  # its request gave up: nobody runs this worker
                self._abandoned.discard(number)
                if pid is not None:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    log.warning("standby_late_worker_killed", standby_pid=self.pid, pid=pid)
                return
            if pid is not None:
                self._forked.add(pid)
            self._answers[number] = (pid, error)
            self._exits.notify_all()

    def _on_gone(self) -> None:
        """The standby exited: the kernel kills its workers (``PR_SET_PDEATHSIG``); they
        end with ``-9`` once they are gone (the standby cannot report them any more)."""
        with self._exits:
            self._gone.set()
            self._exits.notify_all()
            orphans = sorted(self._forked)
        procs = []
        for pid in orphans:
            with contextlib.suppress(psutil.Error):
                procs.append(psutil.Process(pid))
        psutil.wait_procs(procs, timeout=2.0)
        with self._exits:
            for pid in orphans:
                self._codes.setdefault(pid, -signal.SIGKILL)
            self._forked.clear()
            self._exits.notify_all()
        if orphans:
            log.warning("standby_exited_with_workers", standby_pid=self.pid, pids=orphans,
                        exit_code=self.popen.poll())

    def close(self) -> None:
        """Retire it: closing its socket makes it exit (its workers, if any, with it)."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._sock.close()
        if not self._ready.is_set():  # still importing: it reads its socket only once warm
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
        try:
            self.popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait()
        self._reader.join(timeout=5)
