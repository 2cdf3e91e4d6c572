"""Named, bounded retry policies (tenacity), composed from stop / wait / retry parts.

Every network call the project makes goes through one of these. ``sleep`` is injectable so
tests run instantly.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import httpx
import tenacity

from dlrover_core.errors import TransientError

__all__ = ["RETRYABLE_RPC_ERRORS", "api_retrying", "master_retrying", "rpc_retrying", "storage_retrying"]

#: Errors of a master RPC that a retry may cure: connection refused or reset, a timeout,
#: or a 5xx answer (raised by the client as TransientError).
RETRYABLE_RPC_ERRORS: tuple[type[BaseException], ...] = (
    httpx.TransportError,
    TransientError,
)


def rpc_retrying(
    *,
    attempts: int = 6,
    max_total_s: float = 30.0,
    initial_wait_s: float = 0.05,
    max_wait_s: float = 2.0,
    sleep: Callable[[float], None] = time.sleep,
) -> tenacity.Retrying:
    """Policy for agent/worker → master calls.

    Stops after ``attempts`` tries or ``max_total_s`` seconds, whichever comes first, waiting
    exponentially with jitter between ``initial_wait_s`` and ``max_wait_s``. Re-raises the
    last error (``reraise=True``) so callers see the real cause.
    """
    return tenacity.Retrying(
        stop=tenacity.stop_after_attempt(attempts) | tenacity.stop_after_delay(max_total_s),
        wait=tenacity.wait_exponential_jitter(multiplier=initial_wait_s, max=max_wait_s, jitter=initial_wait_s),
        retry=tenacity.retry_if_exception_type(RETRYABLE_RPC_ERRORS),
        sleep=sleep,
        reraise=True,
    )


def master_retrying(*, patience_s: float = 30.0, sleep: Callable[[float], None] = time.sleep) -> tenacity.Retrying:
    """Policy for a job's own processes (agents, workers) calling their master: retry for
    ``patience_s`` seconds, at most a second apart, so that a master restarted from its
    journal (seconds) is waited for rather than given up on."""
    return rpc_retrying(attempts=10_000, max_total_s=patience_s, max_wait_s=1.0, sleep=sleep)


def storage_retrying(
    *,
    attempts: int = 3,
    initial_wait_s: float = 0.2,
    max_wait_s: float = 2.0,
    sleep: Callable[[float], None] = time.sleep,
) -> tenacity.Retrying:
    """Policy for a checkpoint shard write that raised ``OSError`` (disk full, permission,
    a network filesystem's hiccup): ``attempts`` tries, waiting exponentially between
    ``initial_wait_s`` and ``max_wait_s``; re-raises the last error. (A write that never
    returns is not retried: the saver reports it after ``Checkpoint.persist_timeout_s``.)"""
    return tenacity.Retrying(
        stop=tenacity.stop_after_attempt(attempts),
        wait=tenacity.wait_exponential(multiplier=initial_wait_s, max=max_wait_s),
        retry=tenacity.retry_if_exception_type(OSError),
        sleep=sleep,
        reraise=True,
    )


def api_retrying(
    transient: Callable[[BaseException], bool],
    *,
    attempts: int = 5,
    max_total_s: float = 30.0,
    initial_wait_s: float = 0.2,
    max_wait_s: float = 5.0,
    wait: Callable[[tenacity.wait.wait_base], tenacity.wait.wait_base] | None = None,
    before_sleep: Callable[[tenacity.RetryCallState], None] | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> tenacity.Retrying:
    """Policy for a scheduler backend's calls to its platform (the Docker engine, the
    Kubernetes API, Slurm's commands): retry the errors ``transient`` accepts, at most
    ``attempts`` tries or ``max_total_s`` seconds, waiting exponentially with jitter from
    ``initial_wait_s`` up to ``max_wait_s``; re-raise the last error.

    Args:
        transient: says whether an error is worth retrying (a 5xx answer, a refused
            connection...); every other error is raised at once.
        wait: wraps the exponential wait (e.g. to honour a ``Retry-After`` header).
        before_sleep: called before each wait (a log line).
    """
    backoff: tenacity.wait.wait_base = (tenacity.wait_exponential(multiplier=initial_wait_s, max=max_wait_s)
                                        + tenacity.wait_random(0, initial_wait_s))
    return tenacity.Retrying(
        stop=tenacity.stop_after_attempt(attempts) | tenacity.stop_after_delay(max_total_s),
        wait=wait(backoff) if wait is not None else backoff,
        retry=tenacity.retry_if_exception(transient),
        before_sleep=before_sleep,
        sleep=sleep,
        reraise=True,
    )
