"""Calls to the Docker engine: the SDK (an optional extra), a client, bounded retries, and
errors that keep the engine's own message.

The docker SDK is imported only here and only when a call needs it, so importing
dlrover-core never needs it; without it, using the ``docker`` scheduler raises a
:class:`~dlrover_core.errors.SchedulerError` naming ``pip install 'dlrover-core[docker]'``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

import tenacity

from dlrover_core.errors import SchedulerError
from dlrover_core.retry import api_retrying

if TYPE_CHECKING:
    import docker

__all__ = ["INSTALL_HINT", "call", "connect", "docker_retrying", "sdk"]

#: What to run when the SDK is missing.
INSTALL_HINT = "pip install 'dlrover-core[docker]'"

T = TypeVar("T")


def sdk() -> ModuleType:
    """The ``docker`` SDK module.

    Raises:
        SchedulerError: it is not installed; names the extra to install.
    """
    try:
        import docker  # optional extra (dlrover-core[docker])
    except ImportError as exc:
        raise SchedulerError(f"the docker scheduler needs the docker SDK, which is not installed: {INSTALL_HINT}") \
            from exc
    return docker


def _transient(exc: BaseException) -> bool:
    """Whether a Docker API error may go away: the engine unreachable, a timeout, a 5xx answer."""
    import docker.errors  # optional extra (dlrover-core[docker])
    import requests  # comes with the docker SDK

    if isinstance(exc, (requests.ConnectionError, requests.Timeout)):
        return True
    if isinstance(exc, docker.errors.APIError):
        return exc.status_code is not None and exc.status_code >= 500 and exc.status_code != 501
    return False


def docker_retrying(*, attempts: int = 4, max_total_s: float = 20.0, initial_wait_s: float = 0.2,
                    max_wait_s: float = 3.0, sleep: Callable[[float], None] = time.sleep) -> tenacity.Retrying:
    """Policy for Docker API calls: :func:`dlrover_core.retry.api_retrying` of what
    :func:`_transient` accepts, at most ``attempts`` tries or ``max_total_s`` seconds."""
    return api_retrying(_transient, attempts=attempts, max_total_s=max_total_s, initial_wait_s=initial_wait_s,
                        max_wait_s=max_wait_s, sleep=sleep)


def _engine_message(exc: BaseException) -> str:
    explanation = getattr(exc, "explanation", None)
    if explanation:
        return str(explanation.decode() if isinstance(explanation, bytes) else explanation)
    return str(exc) or type(exc).__name__


def call(fn: Callable[[], T], what: str, *, passthrough: tuple[type[BaseException], ...] = ()) -> T:
    """``fn()`` under :func:`docker_retrying`; a final failure becomes SchedulerError with the
    engine's message (exceptions in ``passthrough`` are re-raised as they are)."""
    import docker.errors  # optional extra (dlrover-core[docker])
    import requests  # comes with the docker SDK

    try:
        return docker_retrying()(fn)
    except passthrough:
        raise
    except (docker.errors.DockerException, requests.RequestException) as exc:
        raise SchedulerError(f"docker: {what} failed: {_engine_message(exc)}") from exc


def connect(docker_host: str | None = None) -> docker.DockerClient:
    """A client of the engine at ``docker_host`` (default: ``$DOCKER_HOST``); TLS settings
    come from the SDK's usual variables (``DOCKER_TLS_VERIFY``, ``DOCKER_CERT_PATH``)."""
    module = sdk()
    environment: dict[str, Any] = dict(os.environ)
    if docker_host:
        environment["DOCKER_HOST"] = docker_host
    return call(lambda: module.from_env(timeout=60, environment=environment),
                f"connect to the engine ({docker_host or environment.get('DOCKER_HOST') or 'the default socket'})")
