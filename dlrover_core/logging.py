"""structlog configuration shared by every dlrover process.

Events are stable snake_case names with key-value context, e.g.
``log.info("worker_restarted", rank=3, exit_code=-9)``.

Environment:
    DLROVER_LOG_LEVEL: ``debug`` | ``info`` (default) | ``warning`` | ``error``.
    DLROVER_LOG_FORMAT: ``console`` (default, human readable) | ``json`` (one object a line).
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

__all__ = ["configure", "get_logger"]

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING, "error": logging.ERROR}


def configure(level: str | None = None, fmt: str | None = None) -> None:
    """Configure structlog for this process (idempotent; later calls reconfigure).

    Args:
        level: a name of ``_LEVELS``; default from ``DLROVER_LOG_LEVEL`` or ``info``.
        fmt: ``console`` or ``json``; default from ``DLROVER_LOG_FORMAT`` or ``console``.
    """
    level = (level or os.environ.get("DLROVER_LOG_LEVEL") or "info").lower()
    fmt = (fmt or os.environ.get("DLROVER_LOG_FORMAT") or "console").lower()
    renderer: structlog.typing.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty(), pad_event_to=0)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S", utc=False),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(**context: object) -> structlog.typing.FilteringBoundLogger:
    """Return a structlog logger bound to ``context``, configuring structlog on first use."""
    if not structlog.is_configured():
        configure()
    return structlog.get_logger(**context)
