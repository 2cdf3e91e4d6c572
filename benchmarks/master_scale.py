"""Job master at scale: the real master against thousands of simulated agents.

    python benchmarks/master_scale.py [--agents 1000,10000,30000] [--json PATH] [--repeat 1]
        [--heartbeat-interval-s S] [--heartbeat-timeout-s S] [--no-journal] [--wait-quiet-s 0]
        [--source-addresses K] [--no-rendezvous-heartbeats]

For each agent count N a child process runs the master as ``python -m dlrover_core.master``
assembles it: :class:`~dlrover_core.master.job_master.JobMaster` for ``Job(nodes=N)`` (the
dummy entrypoint ``json.tool``) with checkpoint storage in a temporary directory, the real
TCPStore factory of ``dlrover_core.master.__main__``
(torch is imported before serving; one store per round, and the benchmark forms one round),
:class:`~dlrover_core.master.server.MasterServer`, and ``__main__``'s loop: ``tick()`` every
0.1 s and the journal (a JSON snapshot of the master's state, written when it changed) every
``soft_state_journal_s(N)`` s (0.5 s up to 250 nodes, N / 500 above: 20 s at 10,000). Its logs and ``events.jsonl`` go to files, as a deployed master's do. Its ``relaunch``
callback records when it is called.

This process runs the N agents: one asyncio task each (uvloop when installed), speaking
the agents' protocol (``server.py``) over its own keep-alive HTTP/1.1 connection as
``MasterClient`` (httpx) does: a connection is reused while idle less than its
``KEEPALIVE_EXPIRY_S`` (60 s); the agent's main requests have ``MasterClient``'s timeout
(5 s; a long poll 3 s more) and ``master_retrying`` (retries within 30 s, at most 1 s apart),
its heartbeats the heartbeat client's (``ElasticAgent._heartbeat_loop``: a timeout of half
the heartbeat timeout, 2 to 10 s, and 3 attempts within two intervals). Like the agent, each
simulated agent heartbeats from its registration on (``round`` -1 until its round forms), so
the rendezvous is measured under the heartbeat load a real job puts on the master
(``--no-rendezvous-heartbeats``: the older protocol, heartbeats only after ``ready``). The
agent has a second connection for its heartbeats; here both share one, so a heartbeat due
while a poll is held waits for its answer (at most ``POLL_HOLD_MAX_S``; the wait is not
counted as latency): two connections per agent would need twice the open files, and 10,000
agents would not fit this machine's limit. The HTTP client is a small one on
``asyncio.Protocol`` and runs without the cyclic garbage collector, so that 10,000 agents
cost well under one core and the numbers are the master's; the table shows both processes'
CPU use. At most ``--max-connecting`` (512) agents are starting at once (connecting, up to
their first answer): a job's agents start over seconds, and one host opening 10,000
connections within milliseconds overflows the kernel's accept queue
(``net.core.somaxconn``, 4096 here) and measures the kernel's SYN retry timers instead.

Measured per N:

* ``rendezvous_s``: every agent registers, joins, and polls every 0.02 s (``ElasticAgent``)
  until its answer is ``ready``: from the first join sent to the last ``ready`` received.
* ``restore_agreement_s``: after its first heartbeat each agent, as its node's one rank,
  agrees on the restore as ``Checkpointer.load()`` does: ``restore_plan`` until the answer
  is not ``waiting`` (``Checkpointer._ask``: 5 ms apart; the master holds a ``waiting``
  answer until the last rank reported — a long poll). From the last rank's request to the
  last answer; ``restore_requests_per_rank`` counts the HTTP requests (mean; median and
  min-max beside it; 1 when every held request was answered by the decision; the master
  asks itself again when woken; a 5 ms poll would cost one per 5 ms of waiting). (On the
  agent's connection, one request at a time with its heartbeats: a worker's client has its
  own.) ``--no-restore`` leaves it out.
* ``heartbeat_p50_ms`` / ``heartbeat_p99_ms`` (and min, max): an agent heartbeats every
  heartbeat interval — the product's default for a job of N nodes
  (:func:`dlrover_core.spec.auto_heartbeat`, read back as ``JobSpec.heartbeat_interval_s``:
  ``max(0.5, N / 2000)`` s, 15 s at 30,000) unless ``--heartbeat-interval-s`` sets one;
  each row records the product's default for its N and whether the run used it — agent
  ``k`` at phase ``k/N`` of the interval: a steady ``N / interval`` requests a second.
  Latency is from writing the request to reading the answer, for the heartbeats sent in a
  window of ``--window-intervals`` intervals starting one interval after the last ``ready``
  and restore; ``heartbeat_rate_per_s`` is what was served in that window. The body is the
  agent's: a worker pid and step per node; node 0 also forwards a step record (rank 0's
  progress). ``rendezvous_heartbeats`` and ``rendezvous_heartbeat_p99_ms``: those sent
  before the last ``ready``.
* ``relaunch_decision_ms``: ``--silent-agents`` agents go silent at spread moments of the
  window while the others keep heartbeating. For each, the time the master's relaunch
  callback ran minus the time its last heartbeat was sent minus
  ``Failure.heartbeat_timeout_s``: the master's own detection overhead, i.e. waiting for
  its next tick (0.1 s period, stretched by the journal) plus scanning the node table and
  deciding. The timeout is the product's default for N nodes (``max(30, 6 * interval)``
  s) unless ``--heartbeat-timeout-s`` sets one. The master stamps a heartbeat when it
  handles it, a little after it was sent,
  so this over-counts by the request's transit (the heartbeat latency). Median and maximum
  (and minimum) over the silent agents; both processes read the same ``CLOCK_MONOTONIC``. The first loss
  makes the master order every node to restart; the simulated agents ignore the order and
  keep heartbeating, so the load stays the same.

Other people's work on the machine makes all of this noisy: the CPU used by other processes
during each phase is reported (``others_cpu_pct_*``, % of one core), and ``--wait-quiet-s``
waits for the CPUs to be free before each run. With ``--repeat R`` each N runs R times and
the table shows the median of each number with its min-max over the runs (JSON:
``per_agents.<N>.min_max``); the JSON keeps every run and the exact ``command``. If the
simulated agents use most of their one core (``agents_saturated``), the figures may be the
simulator's, not the master's: the table says so.

Limits of one machine, checked before anything runs (the run fails with the numbers if a
count does not fit): each agent holds one connection, so the agents' process and the
master's each need N open files plus ``FD_RESERVE`` (``RLIMIT_NOFILE``; raised to its hard
limit, beyond it only with ``CAP_SYS_RESOURCE``); and one source address has only the
ephemeral port range (``net.ipv4.ip_local_port_range``, 28,232 ports by default) to connect
from, so above that the agents spread over source addresses ``127.0.0.1``,
``127.0.0.2``, ... of the loopback network (``--source-addresses`` forces a number), as the
agents of a real job come from many hosts. The goals for this
2-core machine (10,000 agents at the default heartbeat: rendezvous within 5 s, heartbeat
p99 within 50 ms, relaunch decision within 1 s) are printed next to the results; nothing
here is a pass/fail test. ``docs/scale.md`` discusses the figures.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import multiprocessing as mp
import os
import platform
import random
import resource
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from _results import write_result  # noqa: E402  (benchmarks/ is the script's directory)
from rich.console import Console
from rich.table import Table

from dlrover_core import Failure, Job, Nodes
from dlrover_core.master.__main__ import _store_factory, soft_state_journal_s
from dlrover_core.master.job_master import JobMaster
from dlrover_core.master.journal import Journal
from dlrover_core.master.server import MasterServer
from dlrover_core.protocol.client import KEEPALIVE_EXPIRY_S, POLL_HOLD_MAX_S
from dlrover_core.protocol.codec import decode, encode
from dlrover_core.protocol.messages import (
    ENDPOINTS,
    Heartbeat,
    Join,
    NodeRelaunch,
    Poll,
    PollState,
    Register,
    RestorePlanRequest,
)
from dlrover_core.protocol.progress import StepRecord
from dlrover_core.spec import HEARTBEAT_RATE_PER_S, JobSpec, auto_heartbeat
from dlrover_core.storage import PosixStorage

#: Seconds between the ready-polls of an agent (``dlrover_core.agent.agent``).
POLL_S = 0.02
#: Seconds between a rank's restore requests while the answer is ``waiting``
#: (``Checkpointer._ask``; the master holds each one first).
RESTORE_POLL_S = 0.005
#: Seconds between master ticks (``dlrover_core.master.__main__``).
TICK_S = 0.1
#: ``MasterClient``'s keep-alive expiry, seconds: an idle connection older than this is not reused.
KEEPALIVE_S = KEEPALIVE_EXPIRY_S
#: ``MasterClient``'s per-request timeout, seconds (a poll gets ``POLL_HOLD_MAX_S`` more).
REQUEST_TIMEOUT_S = 5.0
#: ``master_retrying`` (``MasterClient``'s default): attempts, total seconds, first and largest
#: backoff (seconds).
MAIN_RETRY = (10_000, 30.0, 0.05, 1.0)
#: Open files each process keeps besides the agents' connections (logs, store, pipes, modules).
FD_RESERVE = 1000
#: Ephemeral ports of a source address left to other connections on the machine.
PORT_RESERVE = 2000
#: The simulated agents' CPU (% of their one core) above which their figures are suspect.
SATURATED_PCT = 80.0
#: The top-level keys of the JSON (taken from the largest N).
HEADLINE = ("rendezvous_s", "heartbeat_p50_ms", "heartbeat_p99_ms", "relaunch_decision_ms", "heartbeat_interval_s",
            "restore_agreement_s", "restore_requests_per_rank")
#: key -> (agents, goal): the goals on a 2-core machine, at the default heartbeat.
GOALS = {"rendezvous_s": (10_000, 5.0), "heartbeat_p99_ms": (10_000, 50.0), "relaunch_decision_ms": (10_000, 1000.0)}


def job_spec(n: int, interval_s: float | None, timeout_s: float | None) -> JobSpec:
    """The benchmark's job of ``n`` nodes; ``None``: the product's default heartbeat
    interval / timeout for that size (read back as ``spec.heartbeat_interval_s``)."""
    return Job(name="master-scale", entrypoint="json.tool", nodes=Nodes(min=n, max=n),
               failure=Failure(heartbeat_interval_s=interval_s, heartbeat_timeout_s=timeout_s))


class GcPauses:
    """Records this process's cyclic garbage collections (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.pauses_s: list[float] = []
        self.generations: list[int] = []
        self._start = 0.0
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.pauses_s.append(time.perf_counter() - self._start)
            self.generations.append(info["generation"])

    def summary(self) -> dict[str, float]:
        full = [p for p, g in zip(self.pauses_s, self.generations, strict=True) if g == 2]
        return {"gc_collections": len(self.pauses_s), "gc_total_ms": 1e3 * sum(self.pauses_s),
                "gc_max_ms": 1e3 * max(self.pauses_s, default=0.0), "gc_full": len(full),
                "gc_full_total_ms": 1e3 * sum(full)}


# ----- the master (child process) ----------------------------------------------------------


def _master_process(n: int, interval_s: float | None, timeout_s: float | None, journal_on: bool, log_dir: str,
                    conn: Any) -> None:
    """Run the real master for ``n`` nodes until the parent says stop; report through ``conn``."""
    fd = os.open(Path(log_dir) / "master.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)  # structlog prints to stderr: into a file, as a deployed master's does
    sys.stderr = os.fdopen(2, "w", buffering=1)

    gc_pauses = GcPauses()
    send_lock = threading.Lock()

    def send(*msg: Any) -> None:
        with send_lock:
            conn.send(msg)

    job = job_spec(n, interval_s, timeout_s)
    journal = Journal(Path(log_dir) / "master_journal.json") if journal_on else None
    def relaunch(request: NodeRelaunch) -> None:
        send("relaunch", request.node_id, time.monotonic())

    master = JobMaster(job, "master-scale", store_host="127.0.0.1", store_factory=_store_factory(),
                       storage=PosixStorage(str(Path(log_dir) / "checkpoints")), relaunch=relaunch,
                       log_dir=Path(log_dir), journal=journal)
    server = MasterServer(master, "127.0.0.1", 0)
    server.start()
    stop = threading.Event()
    ticks: list[float] = []
    journals: list[float] = []

    def loop() -> None:
        """``python -m dlrover_core.master``'s loop: tick; every ``soft_state_journal_s(N)``
        (0.5 s up to 250 nodes, N / 500 s above), the journal's soft state (decisions are
        journaled ahead by the master itself)."""
        last_journal = 0.0
        journal_s = soft_state_journal_s(job.nodes.max)
        while not stop.is_set():
            t = time.monotonic()
            master.tick()
            ticks.append(time.monotonic() - t)
            if journal_on and time.monotonic() - last_journal >= journal_s:
                t = last_journal = time.monotonic()
                master.write_journal()
                journals.append(time.monotonic() - t)
            stop.wait(TICK_S)

    thread = threading.Thread(target=loop, name="master-loop", daemon=True)
    thread.start()
    send("ready", server.port, os.getpid())
    conn.recv()  # "stop"
    stop.set()
    thread.join()
    lost = sum(1 for node in master.nodes.values() if node.state == "dead")
    send("done", {
        "tick_mean_ms": 1e3 * statistics.fmean(ticks) if ticks else 0.0, "tick_max_ms": 1e3 * max(ticks, default=0.0),
        "journal_mean_ms": 1e3 * statistics.fmean(journals) if journals else 0.0,
        "journal_max_ms": 1e3 * max(journals, default=0.0), "lost_nodes": lost, "state": master.state.value,
        "rss_mb": psutil.Process().memory_info().rss / 2**20, **gc_pauses.summary(),
    })
    server.stop()


# ----- the agents (this process) -----------------------------------------------------------


class _Http(asyncio.Protocol):
    """One HTTP/1.1 keep-alive connection with at most one request in flight."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.last_used = time.monotonic()
        self._buf = bytearray()
        self._waiter: asyncio.Future[tuple[int, bytes]] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(ConnectionResetError("the master closed the connection"))

    def data_received(self, data: bytes) -> None:
        self._buf += data
        waiter = self._waiter
        if waiter is None or waiter.done():
            return
        end = self._buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = bytes(self._buf[:end]).decode("latin-1").lower()
        length = 0
        for line in head.split("\r\n")[1:]:
            if line.startswith("content-length:"):
                length = int(line[15:])
        if len(self._buf) < end + 4 + length:
            return
        body = bytes(self._buf[end + 4:end + 4 + length])
        del self._buf[:end + 4 + length]
        if "connection: close" in head:
            self.closed = True
        waiter.set_result((int(head[9:12]), body))

    def request(self, raw: bytes) -> asyncio.Future[tuple[int, bytes]]:
        assert self.transport is not None
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return self._waiter

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


#: The endpoint of each request message.
_ENDPOINT_OF = {e.request: e for e in ENDPOINTS.values() if e.request is not None}


class Stats:
    """What every simulated agent shares: counters, heartbeat latencies, and the bound on
    agents starting at once."""

    def __init__(self, max_connecting: int) -> None:
        self.starting = asyncio.Semaphore(max_connecting)
        self.requests = 0
        self.connects = 0
        self.timeouts = 0
        self.retries = 0
        self.heartbeat_failures = 0
        self.heartbeats: list[tuple[float, float]] = []  # (sent at, latency s)


class Policy:
    """A client's timeout and bounded retry, as ``MasterClient`` + a tenacity preset: the
    per-request timeout (a long poll gets ``POLL_HOLD_MAX_S`` more), attempts, total seconds,
    first and largest backoff."""

    def __init__(self, timeout_s: float, attempts: int, total_s: float, first_s: float, max_s: float) -> None:
        self.timeout_s, self.attempts, self.total_s, self.first_s, self.max_s = timeout_s, attempts, total_s, first_s, max_s

    def as_dict(self) -> dict[str, float]:
        return {"timeout_s": self.timeout_s, "attempts": self.attempts, "max_total_s": self.total_s,
                "initial_wait_s": self.first_s, "max_wait_s": self.max_s}


def main_policy() -> Policy:
    """The agent's main client: ``MasterClient``'s 5 s timeout and ``master_retrying``."""
    return Policy(REQUEST_TIMEOUT_S, *MAIN_RETRY)


def heartbeat_policy(interval_s: float, timeout_s: float) -> Policy:
    """The agent's heartbeat client (``ElasticAgent._heartbeat_loop``): a timeout of half the
    heartbeat timeout (2 to 10 s) and 3 attempts within two intervals (at least 1 s)."""
    return Policy(max(2.0, min(10.0, timeout_s / 2)), 3, max(1.0, 2 * interval_s), 0.05, 2.0)


class SimAgent:
    """A simulated agent: ``ElasticAgent``'s protocol, no workers, on one keep-alive connection."""

    def __init__(self, node_id: int, n: int, port: int, stats: Stats, *, local_addr: tuple[str, int] | None,
                 main: Policy, beat: Policy) -> None:
        self.node_id = node_id
        self.phase = node_id / n  # of the heartbeat interval
        self.port = port
        self.stats = stats
        self.local_addr = local_addr
        self.main, self.beat = main, beat
        self.pid = 100_000 + node_id
        self._conn: _Http | None = None
        self._lock = asyncio.Lock()  # one request at a time on the connection
        self._host = f"Host: 127.0.0.1:{port}\r\n".encode()
        self.n = n
        self.step = 0
        self.join_sent: float | None = None
        self.ready_at: float | None = None
        self.last_heartbeat_sent: float | None = None
        self.restore_sent: float | None = None
        self.restore_done: float | None = None
        self.restore_requests = 0

    def _fresh_connection_needed(self) -> bool:
        conn = self._conn
        return conn is None or conn.closed or time.monotonic() - conn.last_used > KEEPALIVE_S

    async def _once(self, name: str, payload: bytes) -> dict[str, Any]:
        raw = (b"POST /v1/" + name.encode() + b" HTTP/1.1\r\n" + self._host
               + b"Content-Type: application/json\r\nContent-Length: " + str(len(payload)).encode()
               + b"\r\n\r\n" + payload)
        if self._fresh_connection_needed():
            if self._conn is not None:
                self._conn.close()
            _, self._conn = await asyncio.get_running_loop().create_connection(_Http, "127.0.0.1", self.port,
                                                                               local_addr=self.local_addr)
            self.stats.connects += 1
        conn = self._conn
        assert conn is not None
        self.stats.requests += 1
        status, body = await conn.request(raw)
        conn.last_used = time.monotonic()
        if status >= 400:
            raise RuntimeError(f"master answered {status} to /v1/{name}: {body[:200]!r}")
        return json.loads(body)

    async def exchange(self, message: Any, policy: Policy) -> tuple[Any, float, float]:
        """One RPC with ``policy``'s timeout and retries: ``message`` to its endpoint; the
        decoded answer, when the successful attempt was written (monotonic) and its latency
        (s). A request waits for the one in flight on this connection (not counted)."""
        endpoint = _ENDPOINT_OF[type(message)]
        name = endpoint.name
        payload = json.dumps(encode(message)).encode()
        timeout_s = policy.timeout_s + (POLL_HOLD_MAX_S if endpoint.held else 0.0)  # a long poll: more
        start = time.monotonic()
        for attempt in range(policy.attempts):
            async with self._lock:
                starting = self._fresh_connection_needed()
                if starting:  # a new connection counts as starting until its first answer
                    await self.stats.starting.acquire()
                try:
                    sent = time.monotonic()
                    answer = decode(endpoint.answer, await asyncio.wait_for(self._once(name, payload), timeout_s))
                    return answer, sent, time.monotonic() - sent
                except (OSError, asyncio.TimeoutError) as exc:
                    self.stats.timeouts += isinstance(exc, asyncio.TimeoutError)
                    if self._conn is not None:
                        self._conn.close()
                        self._conn = None
                    wait = min(policy.max_s, policy.first_s * 2 ** attempt) + random.uniform(0, policy.first_s)
                    if attempt == policy.attempts - 1 or time.monotonic() - start + wait > policy.total_s:
                        raise
                    self.stats.retries += 1
                finally:
                    if starting:
                        self.stats.starting.release()
            await asyncio.sleep(wait)
        raise AssertionError("unreachable")

    async def call(self, message: Any) -> Any:
        """An RPC of the agent's main client; the decoded answer."""
        return (await self.exchange(message, self.main))[0]

    async def rendezvous(self) -> None:
        self.join_sent = time.monotonic()
        await self.call(Join(node_id=self.node_id, nproc=1))
        while True:
            answer = await self.call(Poll(node_id=self.node_id))
            if answer.state == PollState.READY:
                self.ready_at = time.monotonic()
                return
            if answer.state == PollState.STOP:
                raise RuntimeError(f"node {self.node_id}: the master said stop during the rendezvous")
            if answer.state == PollState.REJOIN:
                await self.call(Join(node_id=self.node_id, nproc=1))
            await asyncio.sleep(POLL_S)

    async def restore(self) -> None:
        """``Checkpointer.load()``'s agreement, as this node's one rank: ``restore_plan``
        until the answer is not ``waiting``."""
        self.restore_sent = time.monotonic()
        while True:
            self.restore_requests += 1
            answer = await self.call(RestorePlanRequest(round=0, rank=self.node_id, world_size=self.n))
            if answer.state != "waiting":
                break
            await asyncio.sleep(RESTORE_POLL_S)
        self.restore_done = time.monotonic()

    async def heartbeat(self) -> None:
        """One heartbeat on the heartbeat client's policy: between rounds (before ``ready``)
        round -1 and nothing else, as ``ElasticAgent`` sends; then the round's worker pid and
        step, and node 0 forwards a step record (rank 0's progress)."""
        if self.ready_at is None:
            beat = Heartbeat(node_id=self.node_id, round=-1, pid=self.pid)
        else:
            self.step += 1
            records = ()
            if self.node_id == 0:
                records = (StepRecord(step=self.step, rank=0, dt_s=0.1, unix_time_s=time.time(), metrics={"loss": 1.0}),)
            beat = Heartbeat(node_id=self.node_id, round=0, workers={self.node_id: self.pid + 1},
                             steps={self.node_id: self.step}, records=records, pid=self.pid)
        _, sent, latency = await self.exchange(beat, self.beat)
        self.last_heartbeat_sent = sent
        self.stats.heartbeats.append((sent, latency))

    async def beat_loop(self, *, anchor: float, interval_s: float, silence: dict[int, float],
                        stop: asyncio.Event) -> None:
        """``ElasticAgent``'s heartbeat thread: a beat every interval, in this agent's slot of
        it (phase ``k/N`` from ``anchor``), from the next slot on, until ``stop``; a beat that
        fails after its retries is counted and the next one goes on time, as the agent's does;
        an agent in ``silence`` stops after its first heartbeat past that time."""
        slot = anchor + interval_s * self.phase
        while slot <= time.monotonic():
            slot += interval_s
        while not stop.is_set():
            await asyncio.sleep(max(0.0, slot - time.monotonic()))
            if stop.is_set():
                break
            try:
                await self.heartbeat()
            except (OSError, asyncio.TimeoutError, RuntimeError):
                self.stats.heartbeat_failures += 1
            if self.node_id in silence and slot >= silence[self.node_id]:
                break  # this node's host died
            slot += interval_s
            while slot <= time.monotonic():  # a late beat: the next one an interval on, no burst
                slot += interval_s

    async def run(self, *, anchor: float, interval_s: float, silence: dict[int, float], stop: asyncio.Event,
                  on_ready: Any, restore: bool, beat_from_register: bool) -> None:
        """Register, start heartbeating (``beat_from_register``: at once, as ``ElasticAgent``
        starts its heartbeat thread after registering; else, the older protocol, with one
        heartbeat at once after ``ready``), rendezvous, agree on the restore, then heartbeat
        until ``stop`` (or silence)."""
        beats: asyncio.Future[None] | None = None

        def start_beats() -> asyncio.Future[None]:
            return asyncio.ensure_future(self.beat_loop(anchor=anchor, interval_s=interval_s, silence=silence,
                                                        stop=stop))

        try:
            try:
                await self.call(Register(node_id=self.node_id, host=f"sim-{self.node_id}", pid=self.pid))
                if beat_from_register:
                    beats = start_beats()
                await self.rendezvous()
            finally:
                on_ready()
            if beats is None:
                await self.heartbeat()  # the older protocol: at once after ready
                beats = start_beats()
            if restore:
                await self.restore()
            await beats
        finally:
            if beats is not None and not beats.done():
                beats.cancel()
            if self._conn is not None:
                self._conn.close()


# ----- one measurement -----------------------------------------------------------------------


def _cpu_sample(me: psutil.Process, master: psutil.Process) -> tuple[float, float, float, float]:
    """CPU seconds so far of this process, of the master, of the whole machine; and the time."""
    machine = psutil.cpu_times()
    busy = sum(machine) - machine.idle - getattr(machine, "iowait", 0.0)
    return sum(me.cpu_times()[:2]), sum(master.cpu_times()[:2]), busy, time.monotonic()


def _cpu_pct(a: tuple[float, ...], b: tuple[float, ...]) -> tuple[float, float, float]:
    """CPU use between two samples in % of one core: the agents, the master, everything else."""
    wall = b[3] - a[3]
    agents, master = b[0] - a[0], b[1] - a[1]
    return 100 * agents / wall, 100 * master / wall, 100 * max(0.0, b[2] - a[2] - agents - master) / wall


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


async def _drive(n: int, port: int, master_pid: int, conn: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Run ``n`` agents against the master on ``port``; return the measurements."""
    spec = job_spec(n, args.heartbeat_interval_s, args.heartbeat_timeout_s)
    interval_s, timeout_s = spec.heartbeat_interval_s, spec.heartbeat_timeout_s  # the master's, for N nodes
    stats = Stats(args.max_connecting)
    sources = source_addresses(n, args.source_addresses)
    main_p, beat_p = main_policy(), heartbeat_policy(interval_s, timeout_s)
    agents = [SimAgent(i, n, port, stats, local_addr=(f"127.0.0.{1 + i % sources}", 0) if sources > 1 else None,
                       main=main_p, beat=beat_p) for i in range(n)]
    k = min(args.silent_agents, n)
    silent_ids = [(i * n) // k + n // (2 * k) for i in range(k)] if k else []
    silence: dict[int, float] = {}  # filled once every agent is ready
    stop, all_ready = asyncio.Event(), asyncio.Event()
    done = [0]

    def on_ready() -> None:
        done[0] += 1
        if done[0] == n:
            all_ready.set()

    me, master = psutil.Process(), psutil.Process(master_pid)
    anchor = time.monotonic()
    cpu0 = _cpu_sample(me, master)
    tasks = [asyncio.ensure_future(a.run(anchor=anchor, interval_s=interval_s, silence=silence, stop=stop,
                                         on_ready=on_ready, restore=not args.no_restore,
                                         beat_from_register=not args.no_rendezvous_heartbeats)) for a in agents]
    try:
        await asyncio.wait_for(all_ready.wait(), args.rendezvous_limit_s)
    except asyncio.TimeoutError:
        pass
    cpu1 = _cpu_sample(me, master)
    joins = [a.join_sent for a in agents if a.join_sent is not None]
    readies = [a.ready_at for a in agents if a.ready_at is not None]
    ready_all = len(readies) == n
    restored_all = False
    if ready_all and not args.no_restore:  # every rank agrees on the restore (a long poll each)
        limit = time.monotonic() + args.rendezvous_limit_s
        while not (restored_all := all(a.restore_done is not None for a in agents)) and time.monotonic() < limit:
            await asyncio.sleep(0.02)
    restores = [a.restore_done for a in agents if a.restore_done is not None]
    # the window starts one interval after the last ready and restore (or after giving up on the rest)
    window_start = (max([*readies, *restores]) if ready_all else time.monotonic()) + interval_s
    window_end = window_start + args.window_intervals * interval_s
    for j, nid in enumerate(silent_ids):  # silent from a slot in the window's first interval
        silence[nid] = window_start + (j + 0.5) * interval_s / k
    deadline = max(window_end, window_start + 2 * interval_s + timeout_s + 2.0) if silent_ids else window_end
    relaunched: dict[int, float] = {}
    spurious = 0
    cpu2: tuple[float, ...] | None = None
    while True:
        now = time.monotonic()
        if cpu2 is None and now >= window_start:
            cpu2 = _cpu_sample(me, master)
        while conn.poll():
            kind, node_id, at = conn.recv()
            if node_id in silence:
                relaunched.setdefault(node_id, at)
            else:
                spurious += 1
        if now >= deadline or (now >= window_end and len(relaunched) == len(silent_ids)):
            break
        await asyncio.sleep(0.02)
    cpu3 = _cpu_sample(me, master)
    stop.set()
    for task in tasks:
        task.cancel()
    ended = await asyncio.gather(*tasks, return_exceptions=True)

    rdzv_cpu = _cpu_pct(cpu0, cpu1)
    hb_cpu = _cpu_pct(cpu2, cpu3) if cpu2 is not None else (float("nan"),) * 3
    hb = [latency for sent, latency in stats.heartbeats if window_start <= sent < window_end]
    last_ready = max(readies) if readies else time.monotonic()
    rdzv_hb = [latency for sent, latency in stats.heartbeats if sent < last_ready]
    requests_per_rank = [a.restore_requests for a in agents]
    overheads = [1e3 * (relaunched[nid] - agents[nid].last_heartbeat_sent - timeout_s)  # type: ignore[operator]
                 for nid in silent_ids if nid in relaunched and agents[nid].last_heartbeat_sent is not None]
    nan = float("nan")
    return {
        "agents": n,
        "rendezvous_s": round(max(readies) - min(joins), 3) if ready_all else nan,
        "ready_agents": len(readies),
        "start_to_all_ready_s": round(max(readies) - anchor, 3) if ready_all else nan,
        "heartbeat_interval_s": interval_s,
        "heartbeat_interval_default": args.heartbeat_interval_s is None,
        "product_default_heartbeat_s": dict(zip(("interval_s", "timeout_s"), auto_heartbeat(n), strict=True)),
        "heartbeat_is_product_default": (interval_s, timeout_s) == auto_heartbeat(n),
        "heartbeats_from_register": not args.no_rendezvous_heartbeats,
        "source_addresses": sources,
        "restore_agreement_s": round(max(restores) - max(a.restore_sent for a in agents), 3)  # type: ignore[type-var]
                               if restored_all else nan,
        "restore_all_s": round(max(restores) - min(a.restore_sent for a in agents), 3)  # type: ignore[type-var]
                         if restored_all else nan,
        "restore_requests_per_rank": round(sum(requests_per_rank) / n, 3) if restored_all else nan,
        "restore_requests_per_rank_median": statistics.median(requests_per_rank) if restored_all else nan,
        "restore_requests_per_rank_min": min(requests_per_rank) if restored_all else nan,
        "restore_requests_per_rank_max": max(requests_per_rank) if restored_all else nan,
        "heartbeat_rate_per_s": round(len(hb) / (window_end - window_start), 1),
        "heartbeat_offered_rate_per_s": round(n / interval_s, 1),
        "heartbeat_samples": len(hb),
        "heartbeat_min_ms": round(1e3 * min(hb, default=nan), 2),
        "heartbeat_p50_ms": round(1e3 * _percentile(hb, 50), 2),
        "heartbeat_p99_ms": round(1e3 * _percentile(hb, 99), 2),
        "heartbeat_max_ms": round(1e3 * max(hb, default=nan), 2),
        "rendezvous_heartbeats": len(rdzv_hb),
        "rendezvous_heartbeat_p50_ms": round(1e3 * _percentile(rdzv_hb, 50), 2),
        "rendezvous_heartbeat_p99_ms": round(1e3 * _percentile(rdzv_hb, 99), 2),
        "heartbeat_failures": stats.heartbeat_failures,
        "relaunch_decision_ms": round(statistics.median(overheads), 1) if overheads else nan,
        "relaunch_decision_min_ms": round(min(overheads), 1) if overheads else nan,
        "relaunch_decision_max_ms": round(max(overheads), 1) if overheads else nan,
        "relaunch_samples": len(overheads),
        "heartbeat_timeout_s": timeout_s,
        "heartbeat_timeout_default": args.heartbeat_timeout_s is None,
        "spurious_losses": spurious,
        "requests": stats.requests,
        "connects": stats.connects,
        "timeouts": stats.timeouts,
        "retries": stats.retries,
        "failed_agents": sum(isinstance(e, Exception) for e in ended),
        "master_cpu_pct_rendezvous": round(rdzv_cpu[1], 1),
        "agents_cpu_pct_rendezvous": round(rdzv_cpu[0], 1),
        "others_cpu_pct_rendezvous": round(rdzv_cpu[2], 1),
        "master_cpu_pct_heartbeats": round(hb_cpu[1], 1),
        "agents_cpu_pct_heartbeats": round(hb_cpu[0], 1),
        "others_cpu_pct_heartbeats": round(hb_cpu[2], 1),
        "agents_saturated": max(rdzv_cpu[0], hb_cpu[0]) > SATURATED_PCT,
    }


def _run_async(coro: Any) -> Any:
    """Run the agents on uvloop when it is installed (about half the CPU of asyncio's loop)."""
    try:
        import uvloop  # optional: installed for speed
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def _others_cpu_pct(sample_s: float = 1.0) -> float:
    """CPU used by the whole machine over ``sample_s``, in % of one core."""
    a = psutil.cpu_times()
    time.sleep(sample_s)
    b = psutil.cpu_times()
    busy = (sum(b) - b.idle - getattr(b, "iowait", 0.0)) - (sum(a) - a.idle - getattr(a, "iowait", 0.0))
    return 100 * busy / sample_s


def _ephemeral_ports() -> int:
    """How many ports ``net.ipv4.ip_local_port_range`` gives one source address."""
    try:
        low, high = (int(x) for x in Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return high - low + 1
    except (OSError, ValueError):
        return 60999 - 32768 + 1  # Linux's default


def source_addresses(n: int, forced: int | None) -> int:
    """How many loopback source addresses ``n`` agents connect from: ``forced``, else as few
    as leave each one ``PORT_RESERVE`` of its ephemeral ports."""
    if forced:
        return forced
    per_source = max(1, _ephemeral_ports() - PORT_RESERVE)
    return -(-n // per_source)


def check_limits(counts: list[int], forced_sources: int | None) -> list[str]:
    """Raise ``RLIMIT_NOFILE`` for the largest count (the master's process inherits it); what
    does not fit on this machine, in words (empty: every count fits)."""
    need = max(counts) + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < need:
        with contextlib.suppress(ValueError, OSError):  # needs CAP_SYS_RESOURCE
            resource.setrlimit(resource.RLIMIT_NOFILE, (need, need))
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need if hard == resource.RLIM_INFINITY else min(need, hard), hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    problems = []
    for n in counts:
        if soft != resource.RLIM_INFINITY and n + FD_RESERVE > soft:
            problems.append(
                f"{n:,} agents need {n + FD_RESERVE:,} open files in each of two processes (one keep-alive "
                f"connection per agent in the agents' process and one in the master's, as MasterClient keeps it, "
                f"plus {FD_RESERVE:,} for the rest), but RLIMIT_NOFILE here is {soft:,} (hard limit {hard:,}; this "
                f"process may not raise it: that needs CAP_SYS_RESOURCE, or `ulimit -Hn` raised by an "
                f"administrator): at most {soft - FD_RESERVE:,} agents on this machine")
        sources = source_addresses(n, forced_sources)
        if sources > 254:
            problems.append(f"{n:,} agents need {sources} loopback source addresses (127.0.0.1-254 available)")
        elif forced_sources and -(-n // sources) > _ephemeral_ports():
            problems.append(f"{n:,} agents over {sources} source address(es) need {-(-n // sources):,} ports each; "
                            f"the ephemeral range has {_ephemeral_ports():,}")
    return problems


def measure(n: int, args: argparse.Namespace, console: Console) -> dict[str, Any]:
    """Start a master for ``n`` nodes, drive ``n`` agents against it, return the numbers."""
    if args.wait_quiet_s > 0:
        deadline = time.monotonic() + args.wait_quiet_s
        while (busy := _others_cpu_pct()) > 30 and time.monotonic() < deadline:
            console.print(f"  other processes use {busy:.0f} % of a core; waiting for quiet")
    log_dir = tempfile.mkdtemp(prefix=f"master-scale-{n}-")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_master_process, name="master", args=(
        n, args.heartbeat_interval_s, args.heartbeat_timeout_s, not args.no_journal, log_dir, child))
    proc.start()
    profiler = None
    try:
        if not parent.poll(120):
            raise RuntimeError(f"the master did not start; see {log_dir}/master.log")
        _, port, pid = parent.recv()
        if args.profile_master:  # py-spy from outside: where the master's GIL time goes
            out = Path(args.profile_master) / f"master_{n}.txt"
            out.parent.mkdir(parents=True, exist_ok=True)
            spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
            profiler = subprocess.Popen([spy, "record", "--pid", str(pid), "--output", str(out), "--rate", "200",
                                         "--format", "raw", "--gil"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        started = time.monotonic()
        gc.collect()
        gc.disable()  # a collection here would stall 10,000 agents at once and read as master latency
        try:
            row = _run_async(_drive(n, port, pid, parent, args))
        finally:
            gc.enable()
        row["measure_s"] = round(time.monotonic() - started, 1)
        parent.send("stop")
        while (msg := parent.recv())[0] != "done":
            pass
        row.update({f"master_{k}": (round(v, 2) if isinstance(v, float) else v) for k, v in msg[1].items()})
        proc.join(30)
    finally:
        if profiler is not None:
            profiler.send_signal(signal.SIGINT)
            profiler.wait(30)
        if proc.is_alive():
            proc.kill()
            proc.join()
        if args.keep_logs:
            console.print(f"  master logs: {log_dir}")
        else:
            shutil.rmtree(log_dir, ignore_errors=True)
    return row


def node_memory(n: int, nproc: int = 8) -> dict[str, Any]:
    """The master's memory per node, by ``tracemalloc``: a :class:`JobMaster` (its journal
    on, no HTTP) whose ``n`` nodes of ``nproc`` workers each registered, joined, were told
    their place and heartbeat once (worker pids and steps), after a journal snapshot (which
    drops the log lines it includes). The HTTP server's per-connection memory is not in it
    (see the RSS per agent in the table's JSON)."""
    import tracemalloc

    log_dir = Path(tempfile.mkdtemp(prefix="master-scale-memory-"))
    fd, saved = os.open(os.devnull, os.O_WRONLY), os.dup(2)
    os.dup2(fd, 2)  # the master logs a line per node
    try:
        gc.collect()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        master = JobMaster(job_spec(n, None, None), "memory", store_host="127.0.0.1",
                           store_factory=lambda *_: (1, None), log_dir=log_dir,
                           journal=Journal(log_dir / "master_journal.json"))
        empty = tracemalloc.get_traced_memory()[0]
        for i in range(n):
            token = master.register(Register(node_id=i, host=f"host-{i:06d}.cluster.local", pid=10_000 + i)).token
            master.join(Join(node_id=i, nproc=nproc, token=token))
        master.tick()
        for i in range(n):
            token = master.nodes[i].token
            master.poll(Poll(node_id=i, token=token))
            ranks = range(i * nproc, (i + 1) * nproc)
            master.heartbeat(Heartbeat(node_id=i, round=0, workers={r: 20_000 + r for r in ranks},
                                       steps=dict.fromkeys(ranks, 1000), pid=10_000 + i, token=token))
        master.write_journal()
        gc.collect()
        after, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    finally:
        os.dup2(saved, 2)
        os.close(fd)
        os.close(saved)
        shutil.rmtree(log_dir, ignore_errors=True)
    return {"nodes": n, "workers_per_node": nproc, "bytes_per_node": round((after - empty) / n),
            "master_state_mb": round((after - before) / 2**20, 1), "peak_mb": round((peak - before) / 2**20, 1)}


# ----- report --------------------------------------------------------------------------------


def _median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per number, the median over the runs of one N; ``min_max``: each number's
    ``[min, max]`` over the runs (``runs``: how many)."""
    out: dict[str, Any] = {}
    spread: dict[str, list[float]] = {}
    for key, value in runs[0].items():
        values = [r[key] for r in runs]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "agents":
            clean = [v for v in values if v == v]  # not NaN
            out[key] = statistics.median(clean) if clean else float("nan")
            spread[key] = [min(clean), max(clean)] if clean else [float("nan")] * 2
        elif isinstance(value, bool):
            out[key] = any(values) if key == "agents_saturated" else value
        else:
            out[key] = value
    out["runs"] = len(runs)
    out["min_max"] = spread
    return out


def _fmt(row: dict[str, Any], key: str, spec: str) -> str:
    """``row[key]`` formatted; with more than one run, its min-max over the runs after it."""
    text = format(row[key], spec)
    lo, hi = row.get("min_max", {}).get(key, (row[key], row[key]))
    if row.get("runs", 1) > 1 and lo == lo:
        text += f" ({format(lo, spec)}–{format(hi, spec)})"
    return text


def print_table(rows: list[dict[str, Any]], console: Console, title: str) -> None:
    table = Table(title=title)
    for col in ("agents", "rendezvous s", "heartbeats /s (interval)", "hb ms min / p50 / p99 / max",
                "relaunch ms min / med / max", "restore s (req/rank)", "CPU % rdzv M / A / O", "CPU % hb M / A / O",
                "timeouts / lost"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            f"{r['agents']:,}", _fmt(r, "rendezvous_s", ".2f"),
            f"{r['heartbeat_rate_per_s']:,.0f} of {r['heartbeat_offered_rate_per_s']:,.0f} "
            f"({r['heartbeat_interval_s']:g} s{'' if r['heartbeat_is_product_default'] else ', not the default'})",
            f"{r['heartbeat_min_ms']:.1f} / {_fmt(r, 'heartbeat_p50_ms', '.1f')} / {_fmt(r, 'heartbeat_p99_ms', '.1f')}"
            f" / {r['heartbeat_max_ms']:.0f}",
            f"{r['relaunch_decision_min_ms']:.0f} / {_fmt(r, 'relaunch_decision_ms', '.0f')} / "
            f"{r['relaunch_decision_max_ms']:.0f}",
            f"{_fmt(r, 'restore_agreement_s', '.2f')} ({r['restore_requests_per_rank']:.2f})",
            f"{r['master_cpu_pct_rendezvous']:.0f} / {r['agents_cpu_pct_rendezvous']:.0f} / "
            f"{r['others_cpu_pct_rendezvous']:.0f}",
            f"{r['master_cpu_pct_heartbeats']:.0f} / {r['agents_cpu_pct_heartbeats']:.0f} / "
            f"{r['others_cpu_pct_heartbeats']:.0f}",
            f"{r['timeouts']:g} / {r['spurious_losses']:g}",
        )
    console.print(table)
    console.print("CPU %: of one core, used by the master (M), the simulated agents (A) and other processes (O); "
                  "restore s: from the last rank's restore_plan to the last answer"
                  + ("; x (a–b): median (min–max) over the runs" if any(r.get("runs", 1) > 1 for r in rows) else ""))
    for r in rows:
        if r.get("agents_saturated"):
            console.print(f"[yellow]{r['agents']:,} agents: the simulated agents used more than {SATURATED_PCT:g} % of "
                          f"their one core (rendezvous {r['agents_cpu_pct_rendezvous']:.0f} %, heartbeats "
                          f"{r['agents_cpu_pct_heartbeats']:.0f} %): these figures may be the simulator's, not the "
                          f"master's[/yellow]")
    for key, (n, goal) in GOALS.items():
        row = next((r for r in rows if r["agents"] == n), None)
        if row is not None:
            verdict = "[green]met[/green]" if row[key] <= goal else "[red]missed[/red]"  # (NaN: missed)
            console.print(f"goal: {key} <= {goal:g} with {n:,} agents: {row[key]:g} {verdict}")


def _no_nan(value: Any) -> Any:
    """``value`` with NaN (a number not measured) as ``None``, for strict JSON readers."""
    if isinstance(value, float) and value != value:
        return None
    if isinstance(value, dict):
        return {k: _no_nan(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_no_nan(v) for v in value]
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--agents", default="1000,10000", help="agent counts, comma-separated (e.g. 1000,10000,30000)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--repeat", type=int, default=1, help="runs per agent count (the table shows medians)")
    parser.add_argument("--heartbeat-interval-s", type=float, default=None,
                        help="default: the product's for N nodes (JobSpec.heartbeat_interval_s)")
    parser.add_argument("--heartbeat-timeout-s", type=float, default=None,
                        help="default: the product's for N nodes (JobSpec.heartbeat_timeout_s)")
    parser.add_argument("--no-restore", action="store_true", help="leave out the restore agreement")
    parser.add_argument("--memory-nodes", type=int, default=10_000,
                        help="measure the master's memory per node with this many nodes (0: skip)")
    parser.add_argument("--window-intervals", type=float, default=3.0,
                        help="heartbeat latencies are taken over this many intervals")
    parser.add_argument("--silent-agents", type=int, default=3, help="agents that go silent (relaunch decisions)")
    parser.add_argument("--max-connecting", type=int, default=512, help="agents starting (connecting) at once")
    parser.add_argument("--rendezvous-limit-s", type=float, default=120.0, help="give up on a rendezvous after this")
    parser.add_argument("--no-journal", action="store_true", help="leave out the master's journal")
    parser.add_argument("--wait-quiet-s", type=float, default=0.0,
                        help="before each run, wait up to this long for other processes to leave the CPUs")
    parser.add_argument("--keep-logs", action="store_true", help="keep the master's log directory")
    parser.add_argument("--profile-master", metavar="DIR", help="py-spy the master into DIR/master_N.txt")
    parser.add_argument("--source-addresses", type=int, default=None,
                        help="loopback source addresses the agents connect from (default: as many as the ephemeral "
                             "port range needs; 1 up to about 26,000 agents)")
    parser.add_argument("--no-rendezvous-heartbeats", action="store_true",
                        help="the older protocol: heartbeats start after ready (one at once), not at registration")
    args = parser.parse_args(argv)
    argv_used = list(argv if argv is not None else sys.argv[1:])
    counts = [int(x.replace("_", "")) for x in args.agents.split(",") if x.strip()]
    if not counts or min(counts) < 1:
        parser.error(f"--agents needs positive counts, got {args.agents!r}")
    if args.source_addresses is not None and not 1 <= args.source_addresses <= 254:
        parser.error("--source-addresses must be 1..254")

    console = Console(width=None if sys.stdout.isatty() else 150)
    problems = check_limits(counts, args.source_addresses)
    if problems:
        for problem in problems:
            console.print(f"[red]cannot run honestly here[/red]: {problem}")
        console.print("nothing was run; choose fewer agents (--agents) or run on a machine with higher limits")
        return 2
    started = time.monotonic()
    runs: dict[int, list[dict[str, Any]]] = {}
    for n in counts:
        for i in range(args.repeat):
            console.print(f"[bold]{n:,} agents[/bold] (run {i + 1} of {args.repeat}) ...")
            runs.setdefault(n, []).append(measure(n, args, console))
    rows = [_median_row(runs[n]) for n in counts]
    total_s = time.monotonic() - started
    notes = [f"median of {args.repeat} runs"] * (args.repeat > 1) + [f"{os.cpu_count()} CPUs"]
    notes += ["no journal"] * args.no_journal
    print_table(rows, console, f"the job master with N simulated agents ({', '.join(notes)})")
    memory = node_memory(args.memory_nodes) if args.memory_nodes > 0 else None
    if memory is not None:
        console.print(f"master state per node ({memory['workers_per_node']} workers each, tracemalloc): "
                      f"{memory['bytes_per_node']:,} bytes ({memory['master_state_mb']} MiB for "
                      f"{memory['nodes']:,} nodes)")
    console.print(f"benchmark took {total_s:.0f} s")
    if args.json:
        largest = max(rows, key=lambda r: r["agents"])
        out = {
            "command": shlex.join(["python", "benchmarks/master_scale.py", *argv_used]),
            "python_executable": sys.executable,
            **{k: largest[k] for k in HEADLINE}, "agents": largest["agents"],
            "goals": {k: list(v) for k, v in GOALS.items()},
            "per_agents": {str(r["agents"]): r for r in rows},
            "runs": {str(n): runs[n] for n in counts},
            "settings": {k: v for k, v in vars(args).items() if k not in ("json", "profile_master")}
                        | {"poll_s": POLL_S, "tick_s": TICK_S, "poll_hold_max_s": POLL_HOLD_MAX_S,
                           "restore_poll_s": RESTORE_POLL_S,
                           "default_heartbeat": f"interval_s = max(0.5, nodes / {HEARTBEAT_RATE_PER_S}); "
                                                "timeout_s = max(30, 6 * interval_s)",
                           "product_default_heartbeat_s": {str(n): dict(zip(("interval_s", "timeout_s"),
                                                                             auto_heartbeat(n), strict=True))
                                                           for n in counts},
                           "main_client": main_policy().as_dict(),
                           "heartbeat_client": "ElasticAgent._heartbeat_loop: timeout max(2, min(10, timeout_s / 2)) s; "
                                               "3 attempts within max(1, 2 * interval_s) s",
                           "rlimit_nofile": list(resource.getrlimit(resource.RLIMIT_NOFILE)),
                           "ephemeral_ports": _ephemeral_ports()},
            "memory": memory,
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
            "total_s": round(total_s, 1),
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        write_result(args.json, _no_nan(out), default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
