"""The master's HTTP/JSON API (werkzeug), a thin layer over :class:`JobMaster`.

Every endpoint takes and returns JSON; a 4xx answer carries ``{"error": ...}``.

==========================  ===========================================================
``POST /v1/register``       ``{node_id, host, pid}``
``POST /v1/join``           ``{node_id, nproc}`` → ``{round}``
``POST /v1/poll``           ``{node_id}`` → ``{state: waiting|ready|stop, ...world}``
``POST /v1/heartbeat``      ``{node_id, round, workers, steps, records}`` → ``{action}``
``POST /v1/failure``        ``{node_id, round, failures: [{rank, local_rank, exit_code}]}``
``POST /v1/succeeded``      ``{node_id, round}`` → ``{action}``
``POST /v1/exited``         ``{node_id}``
``POST /v1/cancel``         ``{reason}``
``POST /v1/checkpoint_shard`` ``{node_id, rank, step, world_size, crc32, bytes}`` → ``{committed}``
``POST /v1/checkpoint_error`` ``{node_id, rank, step, error}``
``POST /v1/restore_plan``   ``{round, rank, world_size, memory_steps}`` → ``{state, source, step}``
``GET  /v1/status``         live status (``JobStatus`` fields plus the node table)
``GET  /v1/result``         the JobResult as a dict
==========================  ===========================================================
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any

from werkzeug.exceptions import BadRequest, HTTPException, NotFound
from werkzeug.routing import Map, Rule
from werkzeug.serving import BaseWSGIServer, make_server
from werkzeug.wrappers import Request, Response

from dlrover_core.master.job_master import JobMaster

__all__ = ["MasterServer"]


def _int_keys(d: dict[str, Any] | None) -> dict[int, int]:
    return {int(k): int(v) for k, v in (d or {}).items()}


class MasterServer:
    """Serves a :class:`JobMaster` on ``host:port`` from a background thread."""

    def __init__(self, master: JobMaster, host: str = "127.0.0.1", port: int = 0) -> None:
        self.master = master
        m = master
        self._routes = {
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
            "cancel": lambda b: m.cancel(str(b.get("reason") or "cancelled by the user")),
            "checkpoint_shard": m.checkpoint_shard,
            "checkpoint_error": m.checkpoint_error,
            "restore_plan": m.restore_plan,
            "status": lambda b: m.status(),
            "result": lambda b: m.result().to_dict(),
        }
        self._map = Map([Rule("/v1/<name>", endpoint="call", methods=["GET", "POST"])])
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        self._server: BaseWSGIServer = make_server(host, port, self._app, threaded=True)
        self.port = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, name="dlrover-master-http", daemon=True)

    def _app(self, environ: dict[str, Any], start_response: Any) -> Any:
        request = Request(environ)
        try:
            _, args = self._map.bind_to_environ(environ).match()
            handler = self._routes.get(args["name"])
            if handler is None:
                raise NotFound(f"no endpoint /v1/{args['name']}")
            body = (request.get_json(silent=True) or {}) if request.method == "POST" else {}
            try:
                answer = handler(body)
            except (KeyError, TypeError, ValueError) as exc:
                raise BadRequest(f"bad request to /v1/{args['name']}: {type(exc).__name__}: {exc}") from exc
            response = Response(json.dumps(answer), mimetype="application/json")
        except HTTPException as exc:
            response = Response(json.dumps({"error": exc.description}), status=exc.code, mimetype="application/json")
        return response(environ, start_response)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
