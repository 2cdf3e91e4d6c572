"""``python -m dlrover_core.agent.zygote``: the standby the nodes of one host share.

Where several nodes of a job run on one host (the local scheduler: every node on this
machine), each node's standby (:mod:`dlrover_core.agent.standby`) would import torch and
warm up on its own, about 2 CPU-s each. With ``DLROVER_SHARED_STANDBY=1`` in the agents'
environment, the first agent that needs a standby starts this process instead: it warms up
once (:func:`dlrover_core.agent.standby.warm_up`) and then forks a standby for every agent
that asks, already warm. Android's zygote, one level up: this process forks standbys, a
standby forks its node's workers.

It is found by name, an abstract Unix socket (Linux's abstract namespace, ``unix(7)``; one
per network namespace, so nodes in separate containers or network namespaces never share
one), ``dlrover-standby-<uid>-<job id>-<digest>``: the digest covers everything a warm-up
depends on (the interpreter, the working directory and the standby's environment, except
what names the agent), so only agents whose standbys would be identical share one. The
agent that finds none binds the name itself (so of agents that start together, one wins)
and starts this process on the listening socket (``--listen-fd``); a request sent meanwhile
waits in the socket's backlog while it warms up. It accepts a connection only from its own
user (``SO_PEERCRED``).

The wire, over a connection to that socket (:func:`dlrover_core.agent.forkserver.ask_shared_standby`):
a 5-byte header ``b"S" + len`` (big-endian ``uint32``) that carries two descriptors
(``SCM_RIGHTS``): the standby's end of the socket pair its agent will talk to it on, and
its log file opened for appending; then ``len`` bytes of JSON ``{"env", "cwd"}``. Nothing
comes back on the connection: the forked standby says ``ready`` on the socket pair, as one
the agent started would, or this process writes ``{"event": "refused", "reason"}`` there.

A forked standby takes its own session, its agent's environment and directory, and serves
its agent until the agent closes the socket pair or dies (the kernel closes its end): it
does not die with this process, which may exit first. This process leaves the process tree
of the agent that started it at once (its starter forks and exits), so a node that dies with its agent's
tree does not take the other nodes' standbys with it, and it exits when the last standby
it forked has exited (or after :data:`_IDLE_EXIT_S` without a request).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import socket
import struct
import sys
import threading
import time
from typing import Any

from dlrover_core.agent.forkserver import SHARED_HEADER, ChildExits, send_event, shared_standby_digest

#: A shared standby that forked no standby this long after it started exits (seconds): the
#: agent that started it died before it asked.
_IDLE_EXIT_S = 60.0
#: How long a request may take to arrive once connected (seconds).
_REQUEST_TIMEOUT_S = 5.0


def _recv_request(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """A standby request: its JSON and its two descriptors.

    Raises:
        ValueError: not this wire's header, not two descriptors, or JSON without the keys.
        OSError: the connection broke or timed out.
    """
    data, fds, _flags, _addr = socket.recv_fds(conn, SHARED_HEADER.size, 2)
    try:
        if len(data) < SHARED_HEADER.size:
            raise ValueError(f"a short header: {data!r}")
        kind, length = SHARED_HEADER.unpack(data)
        if kind != b"S" or len(fds) != 2:
            raise ValueError(f"not a standby request: header {data!r} with {len(fds)} descriptor(s)")
        payload = b""
        while len(payload) < length:
            chunk = conn.recv(length - len(payload))
            if not chunk:
                raise ValueError("the request ended early")
            payload += chunk
        request = json.loads(payload)
        if not isinstance(request, dict) or not {"env", "cwd"} <= set(request):
            raise ValueError("a standby request needs env and cwd")
        return request, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def _refusal(conn: socket.socket, request: dict[str, Any], digest: str) -> str | None:
    """Why this process will not fork a standby for the request, or None."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    if uid != os.getuid():
        return f"the request came from user {uid}, this standby serves user {os.getuid()}"
    theirs = shared_standby_digest(request["env"], request["cwd"])
    if theirs != digest:
        return "the request's environment or directory differs from this standby's"
    return None


class _Request:
    """A request taken in: its agent's socket end (the standby's), log fd and JSON."""

    def __init__(self, conn: socket.socket, request: dict[str, Any], wire_fd: int, log_fd: int) -> None:
        self.conn = conn  # (kept open: its peer's credentials are checked at fork time)
        self.request = request
        self.wire_fd = wire_fd
        self.log_fd = log_fd

    def abandoned(self) -> bool:
        """Whether its agent closed its end before it was served (an agent never writes on
        it before the standby says ready, so anything readable is the end of it)."""
        return bool(select.select([self.wire_fd], [], [], 0)[0])

    def drop(self, *, exiting: bool) -> None:
        """Let an abandoned request go; its agent, which waits for the end of its socket,
        learns whether this process exits now (then it waits for that too: ``pid``)."""
        self._end(event="dropped", exiting=exiting, pid=os.getpid())

    def refuse(self, reason: str) -> None:
        self._end(event="refused", reason=reason)

    def _end(self, **event: Any) -> None:
        """Tell the agent (on its standby's socket) and let the request go."""
        with contextlib.suppress(OSError), socket.socket(fileno=os.dup(self.wire_fd)) as wire:
            send_event(wire, **event)
        self.close_fds()

    def close_fds(self) -> None:
        for fd in (self.wire_fd, self.log_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.conn.close()


def _take(listener: socket.socket) -> _Request | None:
    """Accept one connection and read its request (None: a bad one, dropped)."""
    try:
        conn, _ = listener.accept()
    except OSError:
        return None
    conn.settimeout(_REQUEST_TIMEOUT_S)
    try:
        request, (wire_fd, log_fd) = _recv_request(conn)
    except (OSError, ValueError) as exc:
        print(f"dlrover shared standby: a bad request: {exc!r}", file=sys.stderr, flush=True)
        conn.close()
        return None
    return _Request(conn, request, wire_fd, log_fd)


def _warm_up_taking_requests(listener: socket.socket, *, low_priority: bool,
                             idle_exit_s: float = _IDLE_EXIT_S) -> list[_Request]:
    """Warm up (:func:`dlrover_core.agent.standby.warm_up`, on a thread) while taking the
    requests that come meanwhile; the requests whose agents still wait once warm. Exits the
    process at once when every agent that asked gave up before it was warm (a node whose
    standby is closed while it warms up leaves nothing behind)."""
    failure: list[BaseException] = []

    def work() -> None:
        try:
            # lazy: torch's imports on this thread too, while the main one takes requests
            from dlrover_core.agent.standby import warm_up

            warm_up(low_priority=low_priority)
        except BaseException as exc:  # re-raised on the main thread
            failure.append(exc)

    warm = threading.Thread(target=work, name="dlrover-shared-standby-warm-up", daemon=True)
    warm.start()
    pending: list[_Request] = []
    asked = False
    started = time.monotonic()
    while warm.is_alive():
        readable, _, _ = select.select([listener], [], [], 0.1)
        if readable and (request := _take(listener)) is not None:
            pending.append(request)
            asked = True
        for request in [r for r in pending if r.abandoned()]:
            pending.remove(request)
            request.drop(exiting=not pending)
        if (asked or time.monotonic() - started > idle_exit_s) and not pending:
            os._exit(0)  # nobody waits for it any more (the warm-up thread ends with it)
    warm.join()
    if failure:
        raise failure[0]
    return pending


def _serve(listener: socket.socket, digest: str, pending: list[_Request], *,
           idle_exit_s: float = _IDLE_EXIT_S) -> tuple[socket.socket, int, dict[str, Any]] | None:
    """Fork a standby for each request (``pending`` first) until the last one forked has exited.

    Returns:
        In a forked standby: its socket to the agent, its log fd and the request; here,
        None (time to exit).
    """
    exits = ChildExits()  # SIGCHLD wakes the select
    children: set[int] = set()
    served_any = bool(pending)  # a request was taken (forked, refused or dropped)
    started = time.monotonic()
    while True:
        if pending:
            readable: list[Any] = []
        else:
            readable, _, _ = select.select([listener, exits.fd], [], [], 1.0)
        if exits.fd in readable:
            exits.drain()
        with contextlib.suppress(ChildProcessError):
            while (pid := os.waitpid(-1, os.WNOHANG)[0]) != 0:
                children.discard(pid)
        if pending:
            request: _Request | None = pending.pop(0)
        elif listener in readable:
            request = _take(listener)
        else:
            request = None
        if request is None:
            if not children and (served_any or time.monotonic() - started > idle_exit_s):
                return None  # the job's standbys are gone: so is the job on this host
            continue
        served_any = True
        if request.abandoned():  # its agent gave up meanwhile
            request.drop(exiting=not children and not pending)
            if not children and not pending:
                return None  # (its agent waits for this process to be gone)
            continue
        reason = _refusal(request.conn, request.request, digest)
        if reason is not None:
            request.refuse(reason)
            continue
        try:
            pid = os.fork()
        except OSError as exc:
            request.refuse(f"fork failed: {exc}")
            continue
        if pid == 0:  # the standby: nothing of this server stays open in it
            exits.close_in_child()
            for other in pending:
                other.close_fds()
            request.conn.close()
            listener.close()
            return socket.socket(fileno=request.wire_fd), request.log_fd, request.request
        children.add(pid)
        request.close_fds()


def _become_standby(log_fd: int, request: dict[str, Any]) -> None:
    """In a just-forked standby: its own session, its log, its agent's environment and directory."""
    os.setsid()
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dlrover_core.agent.zygote")
    parser.add_argument("--listen-fd", type=int, required=True,
                        help="the listening socket, bound by the agent that started this process")
    parser.add_argument("--job-id", default="", help="the job's id (on the command line for ps and cleanup)")
    parser.add_argument("--low-priority", action="store_true", help="warm up at nice 19 (workers train already)")
    parser.add_argument("--idle-exit-s", type=float, default=_IDLE_EXIT_S,
                        help="exit when no agent asked within this many seconds (its starter died before asking)")
    args = parser.parse_args(argv)
    digest = shared_standby_digest(dict(os.environ), os.getcwd())
    listener = socket.socket(fileno=args.listen_fd)
    pending = _warm_up_taking_requests(listener, low_priority=args.low_priority, idle_exit_s=args.idle_exit_s)
    served = _serve(listener, digest, pending, idle_exit_s=args.idle_exit_s)
    if served is None:
        return 0
    wire, log_fd, request = served
    _become_standby(log_fd, request)
    from dlrover_core.agent.standby import serve_agent  # heavy (imported by the warm-up already)

    serve_agent(wire, watch_parent=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
