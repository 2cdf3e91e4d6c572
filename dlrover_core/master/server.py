"""The master's HTTP/JSON API, a thin layer over :class:`JobMaster`, served by uvicorn.

Every endpoint takes and returns JSON; a 4xx answer carries ``{"error": ...}``.

==========================  ===========================================================
``POST /v1/register``       ``{node_id, host, pid}``
``POST /v1/join``           ``{node_id, nproc}`` → ``{round}``
``POST /v1/poll``           ``{node_id}`` → ``{state: waiting|ready|stop, ...world}``
``POST /v1/heartbeat``      ``{node_id, round, workers, steps, records}`` → ``{action}``
``POST /v1/failure``        ``{node_id, round, failures: [{rank, local_rank, exit_code}]}``
``POST /v1/succeeded``      ``{node_id, round}`` → ``{action}``
``POST /v1/exited``         ``{node_id}``
``POST /v1/node_check``     ``{node_id, check_round, result: {ok, elapsed_s, ...}}``
``POST /v1/cancel``         ``{reason}``
``POST /v1/checkpoint_shard`` ``{node_id, rank, step, world_size, crc32, bytes}`` → ``{committed}``
``POST /v1/checkpoint_error`` ``{node_id, rank, step, error}``
``POST /v1/restore_plan``   ``{round, rank, world_size, memory_steps}`` → ``{state, source, step}``
``GET  /v1/status``         live status (``JobStatus`` fields plus the node table)
``GET  /v1/result``         the JobResult as a dict
==========================  ===========================================================

How it is served: uvicorn's event loop (uvloop and the httptools parser where installed)
runs in one background thread with keep-alive connections, and each request calls the
:class:`JobMaster` method directly on that loop: every method is a short computation under
the master's lock, so a thread pool would only add hand-offs. One thread holding thousands
of idle connections is what lets one master serve 10,000 agents
(``benchmarks/master_scale.py``); the werkzeug development server it replaces started a
thread and closed the connection per request, and collapsed under 1,000 polling agents.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

import uvicorn

from dlrover_core.logging import get_logger
from dlrover_core.master.job_master import JobMaster

__all__ = ["MasterServer"]

log = get_logger()

#: Seconds an idle keep-alive connection stays open. Longer than httpx's 5 s keep-alive
#: expiry, so that the client, not the server, closes an idle connection: a server-side
#: close racing a reused connection would cost the client a failed request and a retry.
_KEEP_ALIVE_S = 20
#: Pending connections the kernel queues before accepting (capped by ``net.core.somaxconn``):
#: thousands of agents connect at once when a job starts.
_BACKLOG = 4096
#: Seconds :meth:`MasterServer.stop` lets requests in flight finish.
_GRACEFUL_STOP_S = 2.0
#: Seconds :meth:`MasterServer.start` waits for the server to be up.
_START_TIMEOUT_S = 30.0

_JSON_HEADERS = [(b"content-type", b"application/json")]


def _int_keys(d: dict[str, Any] | None) -> dict[int, int]:
    return {int(k): int(v) for k, v in (d or {}).items()}


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

    The socket is bound and listening when the constructor returns, so clients may connect
    before :meth:`start`; they are served once it runs.
    """

    def __init__(self, master: JobMaster, host: str = "127.0.0.1", port: int = 0) -> None:
        self.master = master
        m = master
        self._routes: dict[str, Callable[[Any], Any]] = {
            "register": lambda b: m.register(int(b["node_id"]), str(b.get("host", "")), int(b.get("pid", 0))),
            "join": lambda b: m.join(int(b["node_id"]), int(b["nproc"])),
            "poll": lambda b: m.poll(int(b["node_id"])),
            "heartbeat": lambda b: m.heartbeat(
                int(b["node_id"]), int(b["round"]), workers=_int_keys(b.get("workers")),
                steps=_int_keys(b.get("steps")), records=b.get("records") or [],
                pid=int(b["pid"]) if b.get("pid") else None),
            "failure": lambda b: m.failure(int(b["node_id"]), int(b["round"]), list(b["failures"])),
            "succeeded": lambda b: m.succeeded(int(b["node_id"]), int(b["round"])),
            "exited": lambda b: m.exited(int(b["node_id"])),
            "node_check": lambda b: m.node_check(int(b["node_id"]), int(b["check_round"]), dict(b["result"])),
            "cancel": lambda b: m.cancel(str(b.get("reason") or "cancelled by the user")),
            "checkpoint_shard": m.checkpoint_shard,
            "checkpoint_error": m.checkpoint_error,
            "restore_plan": m.restore_plan,
            "status": lambda b: m.status(),
            "result": lambda b: m.result().to_dict(),
        }
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._socket = socket.create_server((host, port), family=family, backlog=_BACKLOG)
        self.port: int = self._socket.getsockname()[1]
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
            logging.getLogger(name).setLevel(logging.WARNING)
        config = uvicorn.Config(
            self._app, interface="asgi3", lifespan="off", access_log=False, log_config=None,
            timeout_keep_alive=_KEEP_ALIVE_S, timeout_graceful_shutdown=_GRACEFUL_STOP_S,
            server_header=False, date_header=False, backlog=_BACKLOG,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._serve, name="dlrover-master-http", daemon=True)
        self._error: BaseException | None = None

    def _serve(self) -> None:
        try:
            self._server.run(sockets=[self._socket])
        except BaseException as exc:  # reported by start() or stop()
            self._error = exc
            log.error("master_server_failed", error=f"{type(exc).__name__}: {exc}")

    # ----- requests ----------------------------------------------------------------------

    def _handle(self, method: str, path: str, body: bytes, is_json: bool) -> tuple[int, Any]:
        """Route one request to the master; return ``(status, JSON-able answer)``."""
        name = path[4:] if path.startswith("/v1/") else ""
        handler = self._routes.get(name) if name and "/" not in name else None
        if handler is None:
            return 404, {"error": f"no endpoint {path}"}
        if method not in ("GET", "POST", "HEAD"):
            return 405, {"error": f"/v1/{name} takes GET or POST, not {method}"}
        payload: Any = {}
        if method == "POST" and is_json and body:
            try:
                payload = json.loads(body) or {}
            except ValueError:  # a body that is not JSON counts as empty, as before
                payload = {}
        try:
            return 200, handler(payload)
        except (KeyError, TypeError, ValueError) as exc:
            return 400, {"error": f"bad request to /v1/{name}: {type(exc).__name__}: {exc}"}
        except Exception as exc:  # a bug in the master: the client retries a 5xx answer
            log.exception("master_request_failed", endpoint=name)
            return 500, {"error": f"/v1/{name} failed: {type(exc).__name__}: {exc}"}

    async def _app(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        status, answer = self._handle(scope["method"], scope["path"], b"".join(chunks), _is_json(scope["headers"]))
        data = json.dumps(answer).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [*_JSON_HEADERS, (b"content-length", str(len(data)).encode())]})
        await send({"type": "http.response.body", "body": data})

    # ----- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Serve from a background thread; return once the server accepts requests."""
        self._thread.start()
        deadline = _START_TIMEOUT_S
        step = 0.01
        while not self._server.started and self._thread.is_alive() and deadline > 0:
            self._thread.join(step)
            deadline -= step
        if not self._server.started:
            raise RuntimeError(f"the master's HTTP server did not start on port {self.port}: {self._error!r}")

    def stop(self) -> None:
        """Stop accepting, let requests in flight finish (at most a few seconds), close."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(_GRACEFUL_STOP_S + 5.0)
        self._socket.close()

