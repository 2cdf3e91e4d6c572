"""The client agents (and the runner) use to talk to the master: httpx + tenacity."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx
import tenacity

from dlrover_core.errors import DLRoverError, MasterUnavailableError, TransientError
from dlrover_core.retry import rpc_retrying

__all__ = ["MasterClient"]

#: The longest the master holds an answer to ``poll`` while the round is still forming
#: (seconds; ``MasterServer`` holds it for ``Failure.heartbeat_interval_s`` at most this).
#: A poll's timeout is the client's timeout plus this.
POLL_HOLD_MAX_S = 3.0


class MasterClient:
    """Calls the master's ``/v1/*`` endpoints; each call has a timeout and a bounded retry.

    Args:
        addr: ``host:port`` of the master.
        timeout_s: per-request timeout (seconds); a ``poll``, which the master may hold,
            gets :data:`POLL_HOLD_MAX_S` more.
        retrying: factory of the retry policy (default :func:`dlrover_core.retry.rpc_retrying`).

    Raises (from :meth:`call`):
        MasterUnavailableError: the master did not answer within the retry policy.
        DLRoverError: the master rejected the request (4xx), with its message.
    """

    def __init__(
        self,
        addr: str,
        *,
        timeout_s: float = 5.0,
        retrying: Callable[[], tenacity.Retrying] = rpc_retrying,
    ) -> None:
        self.addr = addr
        self._http = httpx.Client(base_url=f"http://{addr}", timeout=timeout_s)
        self._poll_timeout = httpx.Timeout(timeout_s + POLL_HOLD_MAX_S)
        self._retrying = retrying

    def call(self, name: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
        try:
            for attempt in self._retrying():
                with attempt:
                    return self._once(name, body)
        except (httpx.TransportError, TransientError) as exc:
            raise MasterUnavailableError(f"job master at {self.addr} did not answer /v1/{name}: {exc}") from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _once(self, name: str, body: dict[str, Any] | None) -> dict[str, Any]:
        if body is None:
            response = self._http.get(f"/v1/{name}")
        elif name == "poll":
            response = self._http.post("/v1/poll", json=body, timeout=self._poll_timeout)
        else:
            response = self._http.post(f"/v1/{name}", json=body)
        if response.status_code >= 500:
            raise TransientError(f"master answered {response.status_code}: {response.text[:200]}")
        if response.status_code >= 400:
            raise DLRoverError(f"master rejected /v1/{name}: {response.json().get('error', response.text)}")
        return response.json()

    def close(self) -> None:
        self._http.close()
