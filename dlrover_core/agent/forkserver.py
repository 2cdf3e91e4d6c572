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

Where the nodes of a job share a host (``DLROVER_SHARED_STANDBY=1``, the local scheduler),
the standby is not started as a process of its own but forked, already warm, by the host's
shared standby (:mod:`dlrover_core.agent.zygote`, :func:`ask_shared_standby`): the agent
hands it the standby's end of the socket pair, and the wire above is the same. Such a
standby is the shared one's child, not the agent's: it exits when the agent's end of the
socket closes (the agent exits or dies), and :class:`Standby` watches it through a pidfd
(``pidfd_open(2)``). Where no shared standby can serve (it cannot start, it refuses, it
exits before forking), the agent starts a standby of its own, as above.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import select
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

__all__ = [
    "SHARED_HEADER",
    "ChildExits",
    "ForkedProcess",
    "Standby",
    "StandbyGone",
    "ask_shared_standby",
    "launcher",
    "recv_request",
    "send_event",
    "shared_standby_digest",
    "shared_standby_name",
]

log = get_logger()

_HEADER = struct.Struct("!cI")  # b"F", payload length
#: A request to the host's shared standby (:mod:`dlrover_core.agent.zygote`): b"S", payload length.
SHARED_HEADER = struct.Struct("!cI")
#: How long closing a standby the shared one has not forked yet waits for it to drop the request
#: (seconds): it does so once its main thread runs, after its first imports, which a shared
#: standby started at nice 19 on a busy machine may take more than 10 s to get through.
_SHARED_DROP_TIMEOUT_S = 60.0
#: How long an agent waits for the shared standby it started to listen (seconds).
_SHARED_START_TIMEOUT_S = 30.0
#: What may differ between the standbys of the nodes that share one (what names the agent).
_PER_AGENT_VARIABLES = frozenset({WATCH_PID, STANDBY_FD})
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


class ChildExits:
    """A fork server's children's exits as a descriptor ``select`` can wait on: SIGCHLD
    writes to a pipe (``signal.set_wakeup_fd``). Used by the standby and the shared standby."""

    def __init__(self) -> None:
        self.fd, self._w = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._w, False)
        signal.set_wakeup_fd(self._w)
        signal.signal(signal.SIGCHLD, lambda *_: None)

    def drain(self) -> None:
        """Empty the pipe (after ``select`` said it is readable)."""
        with contextlib.suppress(BlockingIOError):
            while os.read(self.fd, 512):
                pass

    def close_in_child(self) -> None:
        """In a process just forked from the server: SIGCHLD back to its default, the pipe closed."""
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
        os.close(self.fd)
        os.close(self._w)


# ----- the host's shared standby ---------------------------------------------------------------------


def shared_standby_digest(env: dict[str, str], cwd: str) -> str:
    """What a warm-up depends on, as a hex digest: the interpreter, the user, the working
    directory and the environment but for what names the agent (:data:`_PER_AGENT_VARIABLES`).
    Standbys whose digests are equal would be identical once warm."""
    h = hashlib.sha256()
    for part in (sys.executable, str(os.getuid()), cwd):
        h.update(part.encode() + b"\0")
    for key in sorted(env):
        if key not in _PER_AGENT_VARIABLES:
            h.update(f"{key}={env[key]}".encode() + b"\0")
    return h.hexdigest()[:16]


def shared_standby_name(job_id: str, env: dict[str, str], cwd: str) -> str:
    """The abstract socket name of the shared standby for a standby with ``env`` and ``cwd``."""
    return f"dlrover-standby-{os.getuid()}-{job_id}-{shared_standby_digest(env, cwd)}"


def _connect(name: str) -> socket.socket | None:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(b"\0" + name.encode())
    except OSError:
        sock.close()
        return None
    return sock


# Runs as the shared standby's starter: forks, and the child execs the shared standby while
# the starter exits at once, so that the shared standby leaves the process tree of the agent
# that started it (the agent reaps the starter). A tiny interpreter start (``-S``).
_DAEMONIZE_EXEC = "import os,sys;os.fork() and os._exit(0);os.execv(sys.argv[1],sys.argv[1:])"


def _start_shared_standby(name: str, *, env: dict[str, str], cwd: str, shared_log_file: Path | None, job_id: str,
                          low_priority: bool) -> None:
    """Bind ``name`` here and start the shared standby on it (it inherits the listening
    socket, so a connection made now waits in its backlog while it warms up). Returns
    without starting one when another agent bound ``name`` first.

    Raises:
        StandbyGone: it could not be started.
    """
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        try:
            listener.bind(b"\0" + name.encode())
        except OSError:  # another agent of this host started it a moment ago
            return
        listener.listen(64)
        argv = [sys.executable, "-S", "-c", _DAEMONIZE_EXEC, sys.executable, "-u", "-m", "dlrover_core.agent.zygote",
                "--listen-fd", str(listener.fileno()), "--job-id", job_id, *(["--low-priority"] if low_priority else [])]
        out = open(shared_log_file, "ab") if shared_log_file is not None else subprocess.DEVNULL  # noqa: SIM115 (closed below)
        try:
            starter = subprocess.Popen(argv, env=env, cwd=cwd, pass_fds=(listener.fileno(),),
                                       stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True)
            starter.wait(timeout=_SHARED_START_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise StandbyGone(f"could not start the shared standby: {exc}") from exc
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
    finally:
        listener.close()


def ask_shared_standby(*, wire: socket.socket, env: dict[str, str], cwd: str, log_file: Path | None,
                       shared_log_file: Path | None, job_id: str, low_priority: bool) -> None:
    """Ask the host's shared standby for ``env`` and ``cwd`` (:mod:`dlrover_core.agent.zygote`)
    to fork a standby that serves ``wire``, starting the shared one first when none listens.
    Returns once asked; the standby says ``ready`` (or ``refused``) on ``wire``.

    Raises:
        StandbyGone: no shared standby could be started or reached (start an own one).
    """
    env = {**env, JOB_ID: job_id}  # (a process of the job: ``ps``, cleanup)
    name = shared_standby_name(job_id, env, cwd)
    conn = _connect(name)
    if conn is None:
        _start_shared_standby(name, env=env, cwd=cwd, shared_log_file=shared_log_file, job_id=job_id,
                              low_priority=low_priority)
        conn = _connect(name)
        if conn is None:
            raise StandbyGone("the shared standby is not listening")
    with conn:
        log_fd = os.open(log_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644) if log_file else os.open(
            os.devnull, os.O_WRONLY)
        try:
            payload = json.dumps({"env": env, "cwd": cwd}).encode()
            socket.send_fds(conn, [SHARED_HEADER.pack(b"S", len(payload))], [wire.fileno(), log_fd])
            conn.sendall(payload)
        except OSError as exc:
            raise StandbyGone(f"the shared standby did not take the request: {exc}") from exc
        finally:
            os.close(log_fd)


def _wait_gone(pid: int, timeout_s: float) -> None:
    """Wait until ``pid`` (not necessarily a child) has exited, at most ``timeout_s``."""
    try:
        fd = os.pidfd_open(pid)
    except OSError:  # gone already (or a kernel before Linux 5.3: then wait by polling)
        with contextlib.suppress(psutil.Error):
            psutil.Process(pid).wait(timeout=timeout_s)
        return
    try:
        select.select([fd], [], [], timeout_s)
    finally:
        os.close(fd)


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
        shared_log_file: with a ``job_id``, on Linux: ask the host's shared standby
            (:mod:`dlrover_core.agent.zygote`, whose output goes to this file) to fork this
            one, already warm, starting it when none runs; a process of its own where it
            cannot (none could start, or it refused). None: always a process of its own.
    """

    def __init__(self, *, env: dict[str, str], cwd: str, log_file: Path | None = None, job_id: str = "",
                 low_priority: bool = False, shared_log_file: Path | None = None) -> None:
        self.low_priority = low_priority
        self._env = env
        self._cwd = cwd
        self._log_file = log_file
        self._job_id = job_id
        self.popen: subprocess.Popen | None = None  # a standby of its own
        self.pid: int | None = None  # known once started (its own) or ready (a shared one's)
        self._pidfd: int | None = None  # a shared one's (not this process's child)
        self.shared = False  # forked by the host's shared standby
        self._exiting_shared: int | None = None  # the shared one that exits as it drops our request
        self._closing = threading.Event()
        self._request_lock = threading.Lock()  # one request on the socket at a time
        self._exits = threading.Condition()  # guards the tables below
        self._requests = 0  # the last request's number
        self._answers: dict[int, tuple[int | None, str]] = {}  # request number -> (pid forked or None, why not)
        self._abandoned: set[int] = set()  # requests that gave up waiting: their late worker is killed
        self._codes: dict[int, int] = {}  # worker pid -> exit code
        self._forked: set[int] = set()  # pids of workers not reaped yet
        self._ready = threading.Event()
        self._gone = threading.Event()
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            if shared_log_file is not None and job_id and sys.platform == "linux":
                try:  # (connecting and sending take no time; starting the shared one ~0.3 s)
                    ask_shared_standby(wire=theirs, env=env, cwd=cwd, log_file=log_file,
                                       shared_log_file=shared_log_file, job_id=job_id, low_priority=low_priority)
                    self.shared = True
                except StandbyGone as exc:
                    log.info("standby_not_shared", reason=str(exc))
            if not self.shared:
                self._start_own(theirs)
        finally:
            theirs.close()
        self._reader = threading.Thread(target=self._read_events, name="dlrover-standby-events", daemon=True)
        self._reader.start()

    def _start_own(self, theirs: socket.socket) -> None:
        argv = [*launcher(), sys.executable, "-u", "-m", "dlrover_core.agent.standby"]
        if self.low_priority:
            argv.append("--low-priority")
        if self._job_id:
            argv += ["--job-id", self._job_id]
        out = open(self._log_file, "ab") if self._log_file is not None else subprocess.DEVNULL  # noqa: SIM115 (closed below)
        try:
            self.popen = subprocess.Popen(
                argv, env={**self._env, STANDBY_FD: str(theirs.fileno()), **({JOB_ID: self._job_id} if self._job_id else {})},
                cwd=self._cwd, pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
        self.pid = self.popen.pid

    # ----- state -------------------------------------------------------------------------

    def alive(self) -> bool:
        return not self._gone.is_set() and (self.popen is None or self.popen.poll() is None)

    @property
    def exit_code(self) -> int | None:
        """Its exit code once it exited, where known (a shared one's parent is not this process)."""
        return self.popen.poll() if self.popen is not None else None

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
        refused = self._read_lines()
        if refused is not None and not self._closing.is_set():
            # the shared standby would not fork one (or died first): a standby of its own
            log.info("standby_not_shared", reason=refused)
            with self._request_lock:
                if not self._closing.is_set():  # (close() takes this lock to close the socket)
                    old = self._sock
                    self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
                    self.shared = False
                    try:
                        self._start_own(theirs)
                    except OSError as exc:
                        log.warning("standby_start_failed", error=str(exc))
                    finally:
                        theirs.close()
                        old.close()
            if self.popen is not None and not self._closing.is_set():
                self._read_lines()
        self._on_gone()

    def _read_lines(self) -> str | None:
        """Read the standby's events until its socket closes. Returns why a shared one was
        not had (refused, or the socket closed before it said ready), else None."""
        try:
            with self._sock.makefile("rb") as lines:
                for line in lines:
                    try:
                        event = json.loads(line)
                    except ValueError:
                        continue
                    kind = event.get("event")
                    if kind == "ready":
                        self._on_ready(event.get("pid"))
                    elif kind == "refused":
                        return f"the shared standby refused: {event.get('reason')}"
                    elif kind == "dropped":  # (after close(): it let the request go)
                        if event.get("exiting") and isinstance(event.get("pid"), int):
                            self._exiting_shared = event["pid"]
                        return "the shared standby dropped the request"
                    elif kind == "started":
                        self._on_started(int(event["id"]), event.get("pid"), str(event.get("error") or ""))
                    elif kind == "exited":
                        with self._exits:
                            self._forked.discard(int(event["pid"]))
                            self._codes[int(event["pid"])] = int(event["returncode"])
                            self._exits.notify_all()
        except (OSError, ValueError):
            pass
        if self.shared and not self._ready.is_set():
            return "the shared standby exited before it forked this one"
        return None

    def _on_ready(self, pid: Any) -> None:
        if self.shared and isinstance(pid, int):
            self.pid = pid
            with contextlib.suppress(OSError):  # (gone already: its socket says so next)
                self._pidfd = os.pidfd_open(pid)
        self._ready.set()

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
                        exit_code=self.exit_code)

    def close(self) -> None:
        """Retire it: closing its socket makes it exit (its workers, if any, with it); wait
        until it has."""
        self._closing.set()
        if self.shared and not self._ready.is_set():
            # asked, not forked yet: the shared standby sees the end of the request and drops
            # it (or exits, if nobody else waits for it); the socket closes on its side then
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_WR)
            self._reader.join(timeout=_SHARED_DROP_TIMEOUT_S)
            if self._exiting_shared is not None:  # nobody else waited for it: it exits, wait for that
                _wait_gone(self._exiting_shared, _SHARED_DROP_TIMEOUT_S)
        with self._request_lock:
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                self._sock.close()
        if self.popen is not None:
            if not self._ready.is_set():  # still importing: it reads its socket only once warm
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.popen.pid, signal.SIGKILL)
            try:
                self.popen.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        elif self._pidfd is not None:  # a shared one's: it sees its socket close and exits
            if not select.select([self._pidfd], [], [], 5.0)[0]:
                with contextlib.suppress(OSError):
                    signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
                select.select([self._pidfd], [], [], 5.0)
        elif self.shared and self.pid is not None:  # (no pidfd: a kernel before Linux 5.3)
            _wait_gone(self.pid, 5.0)
        # (a shared one not ready yet exits when it finds its socket closed, or is never forked)
        self._reader.join(timeout=5)
        if self._pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(self._pidfd)
            self._pidfd = None
