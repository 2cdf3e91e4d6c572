"""The client agents (and the runner) use to talk to the master: httpx + tenacity.

A master can come back at another address (the local scheduler restarts a dead master on a
free port when its old one was taken): with an address file (``addr_file``, by default the
one named by ``DLROVER_MASTER_ADDR_FILE``) the client re-reads it whenever a request fails
to reach the master, and the next attempt goes to the address written there.

Every endpoint has a method that takes its request message and returns its answer
(:mod:`dlrover_core.protocol.messages`): ``client.heartbeat(Heartbeat(...))`` →
:class:`~dlrover_core.protocol.messages.HeartbeatAnswer`, ``client.status()`` →
:class:`~dlrover_core.protocol.status.MasterStatus`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import tenacity

from dlrover_core import env
from dlrover_core.errors import DLRoverError, MasterUnavailableError, TransientError
from dlrover_core.logging import get_logger
from dlrover_core.protocol.codec import decode, encode
from dlrover_core.protocol.messages import (
    ENDPOINTS,
    ActionAnswer,
    AssignNode,
    Cancel,
    CheckpointErrorReport,
    Exited,
    FailureReport,
    Heartbeat,
    HeartbeatAnswer,
    Join,
    Joined,
    LiveAssignment,
    LiveReform,
    NodeAssigned,
    NodeCheckReport,
    Poll,
    Register,
    Registered,
    RestoreDecision,
    RestorePlanRequest,
    RestoreVerify,
    RestoreVerifyAnswer,
    RoundAssignment,
    ShardAnswer,
    ShardReport,
    Succeeded,
)
from dlrover_core.protocol.result import JobResult
from dlrover_core.protocol.status import MasterStatus
from dlrover_core.retry import master_retrying, rpc_retrying

__all__ = ["MasterClient", "fetch_master_status"]

log = get_logger()

#: The longest the master holds an answer to ``poll`` while the round is still forming
#: (seconds; ``MasterServer`` holds it for ``JobSpec.heartbeat_interval_s`` at most this),
#: and to ``restore_plan`` / ``restore_verify`` while other ranks have not reported. The
#: timeout of these long polls (``Endpoint.held``) is the client's timeout plus this.
POLL_HOLD_MAX_S = 3.0
#: Seconds an idle keep-alive connection to the master is reused (httpx's default: 5 s).
#: Longer than the heartbeat interval of any job up to 100,000 nodes (``max(0.5, nodes /
#: 2000)`` s, :func:`dlrover_core.spec.auto_heartbeat`): with 5 s, every heartbeat of a
#: 10,000-node job opened a new connection. The server keeps them open longer still.
KEEPALIVE_EXPIRY_S = 60.0
_LIMITS = httpx.Limits(max_connections=100, max_keepalive_connections=20, keepalive_expiry=KEEPALIVE_EXPIRY_S)

A = TypeVar("A")


class MasterClient:
    """Calls the master's ``/v1/*`` endpoints; each call has a timeout and a bounded retry.

    Args:
        addr: ``host:port`` of the master.
        timeout_s: per-request timeout (seconds); a long poll (``poll``, ``restore_plan``,
            ``restore_verify``), which the master may hold, gets :data:`POLL_HOLD_MAX_S` more.
        retrying: factory of the retry policy (default
            :func:`dlrover_core.retry.master_retrying`: it outlasts a master restart).
        addr_file: a file holding the master's current ``host:port``, re-read when a request
            does not reach the master (default: ``$DLROVER_MASTER_ADDR_FILE``; ``""``: none).

    Raises (from every call):
        MasterUnavailableError: the master did not answer within the retry policy.
        DLRoverError: the master rejected the request (4xx), with its message.
        ProtocolError: the master's answer is malformed.
    """

    def __init__(
        self,
        addr: str,
        *,
        timeout_s: float = 5.0,
        retrying: Callable[[], tenacity.Retrying] = master_retrying,
        addr_file: str | None = None,
    ) -> None:
        self.addr = addr
        self._timeout_s = timeout_s
        # plain http: verify=False skips loading the CA bundle (about 80 ms per client)
        self._http = httpx.Client(base_url=f"http://{addr}", timeout=timeout_s, verify=False, limits=_LIMITS)
        self._poll_timeout = httpx.Timeout(timeout_s + POLL_HOLD_MAX_S)
        self._retrying = retrying
        file = os.environ.get(env.MASTER_ADDR_FILE, "") if addr_file is None else addr_file
        self._addr_file = Path(file) if file else None
        self._swap = threading.Lock()
        self._give_up: threading.Event | None = None

    def give_up_when(self, event: threading.Event) -> None:
        """Once ``event`` is set, calls stop retrying and raise :class:`MasterUnavailableError`
        (a call in flight after its current attempt, which ends within ``timeout_s``; a new
        call at once). An agent sets it when it has declared the master lost: its main
        thread must not go on waiting out the retry policy's patience for a master it has
        given up on."""
        self._give_up = event

    # ----- one method per endpoint ----------------------------------------------------------

    def assign_node(self, message: AssignNode) -> NodeAssigned:
        """Which node a host's launcher is (idempotent per ``key``)."""
        return self._exchange("assign_node", message, NodeAssigned)

    def register(self, message: Register) -> Registered:
        """An agent starts for its node; the answer holds its fencing token."""
        return self._exchange("register", message, Registered)

    def join(self, message: Join) -> Joined:
        """Join the next rendezvous round."""
        return self._exchange("join", message, Joined)

    def poll(self, message: Poll) -> RoundAssignment:
        """Whether the round formed (the master may hold the answer up to :data:`POLL_HOLD_MAX_S`)."""
        return self._exchange("poll", message, RoundAssignment)

    def heartbeat(self, message: Heartbeat) -> HeartbeatAnswer:
        """Report progress and liveness; the answer says whether to go on."""
        return self._exchange("heartbeat", message, HeartbeatAnswer)

    def failure(self, message: FailureReport) -> ActionAnswer:
        """Report failed workers (or a failed node)."""
        return self._exchange("failure", message, ActionAnswer)

    def succeeded(self, message: Succeeded) -> ActionAnswer:
        """Report that every worker of the node exited 0."""
        return self._exchange("succeeded", message, ActionAnswer)

    def exited(self, message: Exited) -> ActionAnswer:
        """Report that the agent exits."""
        return self._exchange("exited", message, ActionAnswer)

    def node_check(self, message: NodeCheckReport) -> ActionAnswer:
        """Report a node-check round's result."""
        return self._exchange("node_check", message, ActionAnswer)

    def cancel(self, message: Cancel | None = None) -> ActionAnswer:
        """Cancel the job."""
        return self._exchange("cancel", message or Cancel(), ActionAnswer)

    def checkpoint_shard(self, message: ShardReport) -> ShardAnswer:
        """Report a shard durable in storage; the answer holds the newest commit."""
        return self._exchange("checkpoint_shard", message, ShardAnswer)

    def checkpoint_error(self, message: CheckpointErrorReport) -> ActionAnswer:
        """Report a failed shard write (``fatal``: the job must fail)."""
        return self._exchange("checkpoint_error", message, ActionAnswer)

    def restore_plan(self, message: RestorePlanRequest) -> RestoreDecision:
        """Report the snapshots a rank holds; the answer is the restore decision (or ``waiting``)."""
        return self._exchange("restore_plan", message, RestoreDecision)

    def restore_verify(self, message: RestoreVerify) -> RestoreVerifyAnswer:
        """Report a rank's check of its shard of a storage step."""
        return self._exchange("restore_verify", message, RestoreVerifyAnswer)

    def live_reform(self, message: LiveReform) -> LiveAssignment:
        """Ask for a worker's place in the live world's next generation (or say it is ready)."""
        return self._exchange("live_reform", message, LiveAssignment)

    def status(self) -> MasterStatus:
        """The master's live status."""
        return decode(MasterStatus, self._call("status"))

    def result(self) -> JobResult:
        """The job's result (state ``UNKNOWN`` while it runs)."""
        return decode(JobResult, self._call("result"))

    # ----- transport -------------------------------------------------------------------------

    def _exchange(self, name: str, message: Any, answer: type[A]) -> A:
        return decode(answer, self._call(name, encode(message)))

    def _call(self, name: str, body: dict[str, Any] | None = None) -> Any:
        """POST ``body`` to ``/v1/<name>`` (GET without a body); return the JSON answer."""
        give_up = self._give_up
        if give_up is not None and give_up.is_set():
            raise MasterUnavailableError(f"job master at {self.addr}: /v1/{name} not sent, the master was given up on")
        retrying = self._retrying()
        if give_up is not None:
            retrying = retrying.copy(stop=retrying.stop | tenacity.stop_when_event_set(give_up))
        try:
            for attempt in retrying:
                with attempt:
                    return self._once(name, body)
        except (httpx.TransportError, TransientError) as exc:
            raise MasterUnavailableError(f"job master at {self.addr} did not answer /v1/{name}: {exc}") from exc
        raise AssertionError("unreachable")  # pragma: no cover

    def _once(self, name: str, body: dict[str, Any] | None) -> Any:
        http = self._http
        try:
            if body is None:
                response = http.get(f"/v1/{name}")
            elif ENDPOINTS[name].held:  # a long poll (poll, restore_plan, restore_verify)
                response = http.post(f"/v1/{name}", json=body, timeout=self._poll_timeout)
            else:
                response = http.post(f"/v1/{name}", json=body)
        except httpx.TransportError:
            self.rediscover()
            raise
        if response.status_code >= 500:
            raise TransientError(f"master answered {response.status_code}: {response.text[:200]}")
        if response.status_code >= 400:
            raise DLRoverError(f"master rejected /v1/{name}: {response.json().get('error', response.text)}")
        return response.json()

    def rediscover(self) -> bool:
        """Re-read the address file; switch to the address there if it changed. Returns
        whether it did (thread-safe; without an address file, nothing to do)."""
        if self._addr_file is None:
            return False
        try:
            addr = self._addr_file.read_text().strip()
        except OSError:
            return False
        with self._swap:
            if not addr or addr == self.addr:
                return False
            old, self._http = self._http, httpx.Client(base_url=f"http://{addr}", timeout=self._timeout_s, verify=False,
                                                       limits=_LIMITS)
            log.info("master_address_changed", old=self.addr, new=addr)
            self.addr = addr
        old.close()  # a request still in flight on it fails and is retried on the new one
        return True

    def close(self) -> None:
        """Close the HTTP connections."""
        self._http.close()


def fetch_master_status(addr: str, *, timeout_s: float = 2.0) -> MasterStatus | None:
    """The master's ``/v1/status`` at ``host:port``, decoded; ``None`` when it does not answer
    or answers something that is not a status. Map it with
    :meth:`~dlrover_core.protocol.MasterStatus.to_job_status`."""
    client = MasterClient(addr, timeout_s=timeout_s, retrying=lambda: rpc_retrying(attempts=1), addr_file="")
    try:
        return client.status()
    except (DLRoverError, ValueError):  # not answering (MasterUnavailableError), a 4xx, bad JSON, a ProtocolError
        return None
    finally:
        client.close()
