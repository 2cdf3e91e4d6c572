"""structlog configuration shared by every dlrover process.

Events are stable snake_case names with key-value context, e.g.
``log.info("worker_restarted", rank=3, exit_code=-9)``.

Environment:
    DLROVER_LOG_LEVEL: ``debug`` | ``info`` (default) | ``warning`` | ``error``.
    DLROVER_LOG_FORMAT: ``console`` (default: human readable, ``HH:MM:SS`` local times, to
        stderr) | ``json`` (JSON Lines on stdout: one object a line, an ISO-8601 UTC
        ``timestamp``, ``level``, ``event``, and the process's ``node`` and ``rank`` where it
        has them). In ``json`` mode everything a job prints on its console is such an object:
        a worker's line that is not JSON (a ``print``) is wrapped by :func:`as_record` as
        ``{"event": "output", "text": ...}`` with the node and rank it came from.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
import threading
from typing import Any

import structlog

__all__ = ["FORMATS", "as_record", "bind_process", "configure", "get_logger", "json_mode", "write_record"]

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}
#: The values of ``DLROVER_LOG_FORMAT``.
FORMATS = ("console", "json")

#: Fields added to every event of this process (``bind_process``), e.g. ``node`` and ``rank``.
_process_fields: dict[str, Any] = {}
#: Serialises :func:`write_record` calls of this process's threads (one whole line each).
_write_lock = threading.Lock()


def _format(fmt: str | None) -> str:
    value = (fmt or os.environ.get("DLROVER_LOG_FORMAT") or "console").lower()
    if value not in FORMATS:
        raise ValueError(f"DLROVER_LOG_FORMAT={value!r} is not a log format; set it to one of {', '.join(FORMATS)} "
                         "(or unset it for console)")
    return value


def json_mode() -> bool:
    """Whether this process writes JSON Lines (``DLROVER_LOG_FORMAT=json``).

    Raises:
        ValueError: ``DLROVER_LOG_FORMAT`` is set to an unknown format (names the fix).
    """
    return _format(None) == "json"


def _fields_from_env() -> dict[str, Any]:
    """``node`` and ``rank`` of a worker or node-check process, from the environment its
    agent gave it (``DLROVER_NODE_ID``, and ``RANK`` where both are set)."""
    fields: dict[str, Any] = {}
    node = os.environ.get("DLROVER_NODE_ID", "")
    if node.lstrip("-").isdigit():
        fields["node"] = int(node)
        rank = os.environ.get("RANK", "")
        if rank.isdigit():
            fields["rank"] = int(rank)
    return fields


def bind_process(**fields: Any) -> None:
    """Add ``fields`` (``node=3``) to every event this process logs from now on, in every
    thread (structlog's contextvars are per thread); ``None`` removes a field."""
    for key, value in fields.items():
        if value is None:
            _process_fields.pop(key, None)
        else:
            _process_fields[key] = value


def _add_process_fields(_logger: Any, _name: str, event: dict[str, Any]) -> dict[str, Any]:
    for key, value in _process_fields.items():
        event.setdefault(key, value)
    return event


class _CurrentStream:
    """``sys.stdout`` or ``sys.stderr`` as they are at each write, not as they were when
    logging was configured: a stream swapped later (pytest's capture, a redirect in the
    script) gets the lines, and a closed one left behind is never written to."""

    def __init__(self, name: str) -> None:
        self._name = name

    def write(self, text: str) -> int:
        return getattr(sys, self._name).write(text)

    def flush(self) -> None:
        getattr(sys, self._name).flush()


def configure(level: str | None = None, fmt: str | None = None) -> None:
    """Configure structlog for this process (idempotent; later calls reconfigure).

    Args:
        level: a name of ``_LEVELS``; default from ``DLROVER_LOG_LEVEL`` or ``info``.
        fmt: ``console`` or ``json``; default from ``DLROVER_LOG_FORMAT`` or ``console``.

    Raises:
        ValueError: ``fmt`` (or ``DLROVER_LOG_FORMAT``) is not one of :data:`FORMATS`.
    """
    level = (level or os.environ.get("DLROVER_LOG_LEVEL") or "info").lower()
    fmt = _format(fmt)
    processors: list[structlog.typing.Processor]
    if fmt == "json":
        for key, value in _fields_from_env().items():
            _process_fields.setdefault(key, value)
        processors = [
            structlog.contextvars.merge_contextvars,
            _add_process_fields,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.dict_tracebacks,
            structlog.processors.JSONRenderer(default=str),
        ]
        out = _CurrentStream("stdout")
    else:
        processors = [
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False),
            structlog.processors.format_exc_info,
            structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty(), pad_event_to=0),
        ]
        out = _CurrentStream("stderr")
    structlog.configure(
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=out),
        cache_logger_on_first_use=False,
    )


def get_logger(**context: object) -> structlog.typing.FilteringBoundLogger:
    """Return a structlog logger bound to ``context``, configuring structlog on first use."""
    if not structlog.is_configured():
        configure()
    return structlog.get_logger(**context)


def _now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat().replace("+00:00", "Z")


def as_record(line: str, **fields: Any) -> dict[str, Any]:
    """One line of a process's output as a JSON Lines object: a JSON object line as it is,
    any other line (a ``print``, a traceback line) as ``{"event": "output", "text": line}``
    with a ``timestamp`` (now, ISO-8601 UTC); then each of ``fields`` (``node=0, rank=1``)
    added where the object lacks it. ``line`` is without its newline."""
    text = line.rstrip("\r\n")
    if text.startswith("{"):
        try:
            record = json.loads(text)
        except ValueError:
            record = None
        if isinstance(record, dict):
            for key, value in fields.items():
                record.setdefault(key, value)
            return record
    return {"event": "output", "timestamp": _now_iso(), **fields, "text": text}


def write_record(record: dict[str, Any], out: Any = None) -> None:
    """Write ``record`` (a ``timestamp`` added when it has none) as one JSON line to ``out``
    (default ``sys.stdout``), in one write, and flush."""
    if "timestamp" not in record:
        record = {"event": record.get("event"), "timestamp": _now_iso(), **record}
    stream = out if out is not None else sys.stdout
    line = json.dumps(record, default=str) + "\n"
    with _write_lock:
        stream.write(line)
        stream.flush()
