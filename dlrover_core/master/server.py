"""The master's HTTP/JSON API, a thin layer over :class:`JobMaster`, served by uvicorn.

Every endpoint takes and returns JSON: the body is decoded into the endpoint's request
message (:data:`dlrover_core.protocol.messages.ENDPOINTS`), the :class:`JobMaster` method of
the same name is called with it, and its answer is encoded. A malformed body (a field
missing or of the wrong type) is answered 400 with ``{"error": ...}`` naming the message and
the field; fields the master does not know (from a newer peer) are ignored.

==========================  ===========================================================
``POST /v1/register``       ``Register{node_id, host, pid}`` → ``Registered{action, job_id, token}``
``POST /v1/join``           ``Join{node_id, nproc}`` → ``Joined{action, round}``
``POST /v1/poll``           ``Poll{node_id}`` → ``RoundAssignment{state: waiting|ready|rejoin|check|stop, ...}``
``POST /v1/heartbeat``      ``Heartbeat{node_id, round, workers, steps, records, saves}`` → ``{action}``
``POST /v1/failure``        ``FailureReport{node_id, round, failures: [WorkerFailure]}`` → ``{action}``
``POST /v1/succeeded``      ``Succeeded{node_id, round}`` → ``{action}``
``POST /v1/exited``         ``Exited{node_id}`` → ``{action}``
``POST /v1/node_check``     ``NodeCheckReport{node_id, check_round, result}`` → ``{action}``
``POST /v1/cancel``         ``Cancel{reason}`` → ``{action}``
``POST /v1/checkpoint_shard`` ``ShardReport{node_id, rank, step, world_size, round, crc32, bytes}`` → ``ShardAnswer{committed}``
``POST /v1/checkpoint_error`` ``CheckpointErrorReport{node_id, rank, step, error, fatal}`` → ``{action}``
``POST /v1/restore_plan``   ``RestorePlanRequest{round, rank, world_size, memory}`` → ``RestoreDecision{state, source, step}``
``POST /v1/restore_verify`` ``RestoreVerify{round, rank, world_size, step, ok, error}`` → ``RestoreVerifyAnswer{state, step}``
``POST /v1/live_reform``    ``LiveReform{node_id, local_rank, pid, round, generation, step, reason}`` → ``LiveAssignment{state, generation, rank, world_size, ...}``
``GET  /v1/status``         ``MasterStatus`` (live status with the node table)
``GET  /v1/result``         ``JobResult``
==========================  ===========================================================

Calls an agent makes for its node carry its fencing ``token``: the calls of an agent that
was replaced are answered ``{"action": "stop", "state": "stop", "fenced": true}`` and change
nothing (:meth:`JobMaster.fenced`).

How it is served: uvicorn's event loop (uvloop and the httptools parser where installed)
runs in one background thread with keep-alive connections, and each request calls the
:class:`JobMaster` method directly on that loop: every method is a short computation under
the master's lock, so a thread pool would only add hand-offs. One thread holding thousands
of idle connections is what lets one master serve 10,000 agents
(``benchmarks/master_scale.py``); the werkzeug development server it replaces started a
thread and closed the connection per request, and collapsed under 1,000 polling agents.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
import uvicorn

from dlrover_core.errors import ProtocolError
from dlrover_core.logging import get_logger
from dlrover_core.master.job_master import JobMaster
from dlrover_core.protocol.client import KEEPALIVE_EXPIRY_S, POLL_HOLD_MAX_S
from dlrover_core.protocol.codec import decode, encode
from dlrover_core.protocol.messages import ENDPOINTS, Action, Endpoint, Poll, PollState, RoundAssignment

__all__ = ["MasterServer"]

log = get_logger()

#: Seconds an idle keep-alive connection stays open. Longer than the client's keep-alive
#: expiry (``KEEPALIVE_EXPIRY_S``), so that the client, not the server, closes an idle
#: connection: a server-side close racing a reused connection would cost the client a
#: failed request and a retry.
_KEEP_ALIVE_S = int(KEEPALIVE_EXPIRY_S) + 15
#: Pending connections the kernel queues before accepting (capped by ``net.core.somaxconn``):
#: thousands of agents connect at once when a job starts.
_BACKLOG = 4096
#: Seconds :meth:`MasterServer.stop` lets requests in flight finish.
_GRACEFUL_STOP_S = 2.0
#: Seconds :meth:`MasterServer.start` waits for the server to be up.
_START_TIMEOUT_S = 30.0
#: Seconds between checks for changes made outside requests while polls are held.
_WATCH_S = 0.01
#: Middle-generation collections between two full ones (CPython's default: 10); see _tune_gc.
_FULL_GC_THRESHOLD = 1000

_JSON_HEADERS = [(b"content-type", b"application/json")]


def _fenced_answer(endpoint: Endpoint) -> Any:
    """What a replaced (fenced) agent's call to ``endpoint`` is answered: stop."""
    fields = attrs.fields_dict(endpoint.answer)
    values = {"action": Action.STOP, "state": PollState.STOP, "fenced": True}
    return endpoint.answer(**{k: v for k, v in values.items() if k in fields})


#: The answer of each endpoint to a replaced agent (``Endpoint.fenced``).
_FENCED = {name: _fenced_answer(e) for name, e in ENDPOINTS.items() if e.fenced}


def _is_json(headers: list[tuple[bytes, bytes]]) -> bool:
    """The request's content type is JSON (``application/json`` or ``application/*+json``)."""
    for key, value in headers:
        if key.lower() == b"content-type":
            mimetype = value.split(b";", 1)[0].strip().lower()
            return mimetype == b"application/json" or (
                mimetype.startswith(b"application/") and mimetype.endswith(b"+json"))
    return False


class MasterServer:
    """Serves a :class:`JobMaster` on ``host:port`` from a background thread.

    Args:
        master: the job master whose methods the endpoints call.
        host: address to listen on (an IPv6 address when it contains ``:``).
        port: TCP port; 0 picks a free one, then found in :attr:`port`.
        sock: a socket bound and listening already (``host`` and ``port`` are then unused):
            ``dlrover run`` binds the rendezvous endpoint before it starts the master.

    The socket is bound and listening when the constructor returns, so clients may connect
    before :meth:`start`; they are served once it runs.
    """

    def __init__(self, master: JobMaster, host: str = "127.0.0.1", port: int = 0, *,
                 sock: socket.socket | None = None) -> None:
        self.master = master
        #: endpoint name -> the JobMaster method of that name (it takes the request message)
        self._routes: dict[str, Callable[..., Any]] = {name: getattr(master, name) for name in ENDPOINTS}
        if sock is None:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.create_server((host, port), family=family, backlog=_BACKLOG)
        self._socket = sock
        self.port: int = self._socket.getsockname()[1]
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
            logging.getLogger(name).setLevel(logging.WARNING)
        config = uvicorn.Config(
            self._app, interface="asgi3", lifespan="off", access_log=False, log_config=None, proxy_headers=False,
            timeout_keep_alive=_KEEP_ALIVE_S, timeout_graceful_shutdown=_GRACEFUL_STOP_S,
            server_header=False, date_header=False, backlog=_BACKLOG,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name="dlrover-master-http", daemon=True)
        self._error: BaseException | None = None
        # long polls (event loop thread only)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._held: set[asyncio.Future[None]] = set()
        self._seen: tuple[Any, ...] = ()
        self._watching = False
        self._agreeing: set[asyncio.Future[None]] = set()  # held restore calls (_agree)

    def _serve(self) -> None:
        try:
            self._server.run(sockets=[self._socket])
        except BaseException as exc:  # reported by start() or stop()
            self._error = exc
            log.error("master_server_failed", error=f"{type(exc).__name__}: {exc}")

    # ----- requests ----------------------------------------------------------------------

    def _decode(self, name: str, payload: Any) -> Any:
        """The request message of endpoint ``name`` in ``payload`` (``None`` for a GET).

        Raises:
            ProtocolError: a field is missing or has the wrong type.
        """
        request = ENDPOINTS[name].request
        return None if request is None else decode(request, payload)

    def _call(self, name: str, message: Any) -> tuple[int, Any]:
        """Call endpoint ``name`` of the master with its request message (``None`` for a
        GET); return ``(status, answer)``: the answer message, or an error's JSON."""
        try:
            return 200, self._routes[name]() if message is None else self._routes[name](message)
        except (KeyError, TypeError, ValueError) as exc:
            return 400, {"error": f"bad request to /v1/{name}: {type(exc).__name__}: {exc}"}
        except Exception as exc:  # a bug in the master: the client retries a 5xx answer
            log.exception("master_request_failed", endpoint=name)
            return 500, {"error": f"/v1/{name} failed: {type(exc).__name__}: {exc}"}

    def _handle(self, name: str, payload: Any) -> tuple[int, Any] | Any:
        """Decode the body and answer it; a long poll (``Endpoint.held``: a poll, a restore
        call) that may be held is returned as the message instead."""
        try:
            message = self._decode(name, payload)
        except ProtocolError as exc:
            return 400, {"error": f"bad request to /v1/{name}: {exc}"}
        fenced = _FENCED.get(name)
        if fenced is not None and self.master.fenced(message.node_id, message.token):
            return 200, fenced
        if ENDPOINTS[name].held:
            return message
        return self._call(name, message)

    async def _app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        method, path = scope["method"], scope["path"]
        name = path[4:] if path.startswith("/v1/") else ""
        if name not in self._routes:
            status, answer = 404, {"error": f"no endpoint {path}"}
        elif method not in ("GET", "POST", "HEAD"):
            status, answer = 405, {"error": f"/v1/{name} takes GET or POST, not {method}"}
        else:
            payload: Any = {}
            body = b"".join(chunks)
            if method == "POST" and body and _is_json(scope["headers"]):
                try:
                    payload = json.loads(body) or {}
                except ValueError:  # a body that is not JSON counts as empty
                    payload = {}
            handled = self._handle(name, payload)
            if isinstance(handled, tuple):
                status, answer = handled
            elif isinstance(handled, Poll):
                status, answer = await self._poll(handled)
            else:
                status, answer = await self._agree(name, handled)
            self._wake_if_changed()
        data = json.dumps(encode(answer)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [*_JSON_HEADERS, (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    # ----- long polls ----------------------------------------------------------------------

    def _signature(self) -> tuple[Any, ...]:
        """What, when it changes, may change the answer to a waiting node's poll: the job's
        state, the round required and the round formed, and a node check's progress. (A
        change to one node alone, such as its exclusion, is seen when its hold ends.)"""
        m = self.master
        check = m.node_checks.run  # the node check under way, if any
        return (m.state, m.required_round, m.restarts, m.rdzv.next_index, id(check), getattr(check, "round", None))

    async def _poll(self, message: Poll) -> tuple[int, Any]:
        """Poll the master for a node; hold a ``waiting`` answer until the master's state
        changes or the hold time is up, then poll again (which also renews the node's
        liveness). Agents poll in a loop: without the hold, 10,000 of them would keep the
        master busy answering "waiting" while it needs to accept and join the late ones."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        deadline = loop.time() + min(POLL_HOLD_MAX_S, self.master.job.heartbeat_interval_s)
        while True:
            before = self._signature()
            status, answer = self._call("poll", message)
            remaining = deadline - loop.time()
            if (status != 200 or not isinstance(answer, RoundAssignment) or answer.state != PollState.WAITING
                    or remaining <= 0 or self._server.should_exit):
                return status, answer
            if self._signature() != before:
                continue  # it changed while the master answered: ask again at once
            if not self._held:
                self._seen = before
            if not self._watching:
                self._watching = True
                loop.call_later(_WATCH_S, self._watch)
            await _hold(self._held, remaining)

    async def _agree(self, name: str, message: Any) -> tuple[int, Any]:
        """Answer a rank's ``restore_plan`` or ``restore_verify``; hold a ``waiting`` answer
        (not every rank of the round has reported) until another rank's call settles the
        agreement, the master's state changes or :data:`POLL_HOLD_MAX_S` passed, then ask
        again. A long poll: the ranks waiting for the last one cost two requests each, not
        one every few milliseconds while they wait (the last rank may be seconds behind,
        e.g. still importing or reading its shard)."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        deadline = loop.time() + POLL_HOLD_MAX_S
        while True:
            status, answer = self._call(name, message)
            remaining = deadline - loop.time()
            waiting = status == 200 and getattr(answer, "state", None) == "waiting"
            if not waiting:
                if status == 200 and self._agreeing:
                    self._wake_agreeing()  # settled (or moved on): the held ranks ask again
                return status, answer
            if remaining <= _WATCH_S or self._server.should_exit:  # (uvloop's clock and timers tick in ms:
                return status, answer                             # a hold of under one would spin)
            if not self._held and not self._agreeing:
                self._seen = self._signature()  # a job that ends (or restarts) releases them
            await _hold(self._agreeing, remaining)

    def _wake_agreeing(self) -> None:
        """Release every held restore call (they ask the master again)."""
        held, self._agreeing = self._agreeing, set()
        for woken in held:
            _release(woken)

    def _wake_if_changed(self) -> None:
        if (self._held or self._agreeing) and self._signature() != self._seen:
            self._wake()

    def _wake(self) -> None:
        """Release every held poll (they poll the master again)."""
        self._seen = self._signature()
        held, self._held = self._held, set()
        for woken in held:
            _release(woken)
        self._wake_agreeing()

    def _watch(self) -> None:
        """While polls are held, notice changes made outside requests (the master's ticks)."""
        if not self._held:
            self._watching = False
            return
        self._wake_if_changed()
        asyncio.get_running_loop().call_later(_WATCH_S, self._watch)

    # ----- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Serve from a background thread; return once the server accepts requests."""
        _tune_gc()
        self._thread.start()
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            self._thread.join(0.01)
        if not self._server.started:
            raise RuntimeError(f"the master's HTTP server did not start on port {self.port}: {self._error!r}")

    def stop(self) -> None:
        """Stop accepting, answer held polls, let requests in flight finish (at most a few
        seconds), close."""
        self._server.should_exit = True
        if self._loop is not None and self._thread.is_alive():
            with contextlib.suppress(RuntimeError):  # the loop just closed
                self._loop.call_soon_threadsafe(self._wake)
        if self._thread.is_alive():
            self._thread.join(_GRACEFUL_STOP_S + 5.0)
        self._socket.close()


def _tune_gc() -> None:
    """Keep the cyclic garbage collector's full collections out of the way of requests.

    A master serving 10,000 agents holds about 200,000 container objects for their
    connections, plus what its imports made (torch: another 150,000). Every full
    collection walks them all, 0.2-0.4 s with the GIL held, and by CPython's default rule
    (``threshold2=10``) one ran every 1-2 s under 3,000 heartbeats a second: most of the
    heartbeat latency above 50 ms (``benchmarks/master_scale.py``). So: objects alive when
    the master starts serving (modules, the job) are frozen out of collections for good,
    and a full collection waits for 1,000 middle-generation ones instead of 10 (young
    garbage is still collected as often as before; cycles that lived long wait longer).
    Process-wide, like every GC setting: meant for the master's own process.
    """
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, _FULL_GC_THRESHOLD)


async def _hold(waiters: set[asyncio.Future[None]], timeout_s: float) -> None:
    """Wait (in the event loop) until a future added to ``waiters`` is released by a wake-up
    or ``timeout_s`` passed."""
    woken = asyncio.get_running_loop().create_future()
    waiters.add(woken)
    timer = asyncio.get_running_loop().call_later(timeout_s, _release, woken)
    try:
        await woken
    finally:
        timer.cancel()
        waiters.discard(woken)


def _release(woken: asyncio.Future[None]) -> None:
    if not woken.done():
        woken.set_result(None)
