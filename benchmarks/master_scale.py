"""Job master scale benchmark: the real master against thousands of simulated agents.

    python benchmarks/master_scale.py [--agents 1000,10000] [--json PATH]
        [--heartbeat-interval-s 3] [--heartbeat-timeout-s 6] [--silent-agents 3]

For each agent count N, a child process runs the real master exactly as
``python -m dlrover_core.master`` assembles it: :class:`~dlrover_core.master.job_master.JobMaster`
(a ``Job(nodes=N)`` with the dummy entrypoint ``json.tool``, a real TCPStore per round —
one store for the whole run, so it costs nothing measurable), served by
:class:`~dlrover_core.master.server.MasterServer`, with ``tick()`` every 0.1 s from a
ticker thread, its structlog output and ``events.jsonl`` going to files. Its ``relaunch``
callback records when it is called. This process runs the N agents: each is one asyncio
task that speaks the agents' protocol (``server.py``) over its own keep-alive HTTP/1.1
connection, the way ``MasterClient`` (httpx) does — reused while idle less than 5 s
(httpx's keep-alive expiry), a 5 s timeout per request, and up to 6 attempts within 30 s
with exponential backoff (``dlrover_core.retry.rpc_retrying``). The HTTP client is a
minimal one on ``asyncio.Protocol`` so that 10,000 agents cost one core at most and the
measurement is about the master; the table shows both processes' CPU use.

What is measured, per N:

* ``rendezvous_s``: every agent registers, joins and polls every 0.1 s (as ``ElasticAgent``
  does) until its answer is ``ready``; from the first join request sent to the last
  ``ready`` answer received, all N agents starting at once (the worst case).
* ``heartbeat_p50_ms`` / ``heartbeat_p99_ms``: after its ``ready`` an agent heartbeats at
  once (as ``ElasticAgent`` does) and then every ``--heartbeat-interval-s``, agent ``k`` at
  phase ``k/N`` of the interval so that the load is a steady ``N / interval`` requests per
  second. Latency is from the request being written to its answer being read, for the
  heartbeats sent in a window of ``--window-intervals`` intervals that starts one interval
  after the last agent became ready; ``heartbeat_rate_per_s`` is what was served in it.
  The body is the real agent's: one worker pid and step per node, node 0 also forwards a
  step record (rank 0's progress).
* ``relaunch_decision_ms``: ``--silent-agents`` agents go silent at spread moments in the
  window while the others keep heartbeating. For each: the time the master's relaunch
  callback ran, minus the time its last heartbeat was sent, minus
  ``Failure.heartbeat_timeout_s`` — the master's own detection overhead (the tick period
  plus the time to scan the node table and decide). The master stamps the heartbeat when it
  handles it, a little after it was sent, so this slightly over-counts (by the request's
  transit, well under a millisecond when the master keeps up). The median over the silent
  agents is reported, and the maximum. Both processes read the same system-wide
  ``CLOCK_MONOTONIC``. The first loss makes the master order every node to restart (a
  node of the round was lost); the simulated agents ignore the order and keep
  heartbeating, so the load stays steady.

Nothing here is a pass/fail test; the goals (10,000 agents: rendezvous within 5 s,
heartbeat p99 within 50 ms) are printed next to the results.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import platform
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table

#: Seconds between the ready-polls of an agent (``dlrover_core.agent.agent``).
POLL_S = 0.1
#: Seconds between master ticks (``dlrover_core.master.__main__``).
TICK_S = 0.1
#: httpx's default keep-alive expiry, seconds: an idle connection older than this is not reused.
KEEPALIVE_S = 5.0
#: ``MasterClient``'s per-request timeout, seconds.
REQUEST_TIMEOUT_S = 5.0
#: ``rpc_retrying``: attempts, total seconds, first and largest backoff.
RETRY_ATTEMPTS, RETRY_TOTAL_S, RETRY_FIRST_S, RETRY_MAX_S = 6, 30.0, 0.05, 2.0

GOALS = {"rendezvous_s": (10_000, 5.0), "heartbeat_p99_ms": (10_000, 50.0)}


# ----- the master (child process) ----------------------------------------------------------


def _master_process(n: int, interval_s: float, timeout_s: float, log_dir: str, conn: Any) -> None:
    """Run the real master for ``n`` nodes until the parent says stop; report by ``conn``."""
    log_path = Path(log_dir) / "master.log"
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 2)  # structlog prints to stderr: keep it in a file, as a deployed master does
    sys.stderr = os.fdopen(2, "w", buffering=1)

    import torch.distributed as dist

    from dlrover_core import Failure, Job, Nodes
    from dlrover_core.master.job_master import JobMaster
    from dlrover_core.master.server import MasterServer

    send_lock = threading.Lock()

    def send(*msg: Any) -> None:
        with send_lock:
            conn.send(msg)

    def store_factory() -> tuple[int, Any]:  # what `python -m dlrover_core.master` does
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=True)
        return store.port, store

    job = Job(name="master-scale", entrypoint="json.tool", nodes=Nodes(min=n, max=n),
              failure=Failure(heartbeat_interval_s=interval_s, heartbeat_timeout_s=timeout_s))
    master = JobMaster(job, "master-scale", store_host="127.0.0.1", store_factory=store_factory,
                       relaunch=lambda node_id: send("relaunch", node_id, time.monotonic()),
                       log_dir=Path(log_dir))
    server = MasterServer(master, "127.0.0.1", 0)
    server.start()
    stop = threading.Event()
    ticks: list[float] = []

    def ticker() -> None:  # the loop of `python -m dlrover_core.master`, without the journal
        while not stop.is_set():
            t = time.monotonic()
            master.tick()
            ticks.append(time.monotonic() - t)
            stop.wait(TICK_S)

    thread = threading.Thread(target=ticker, name="ticker", daemon=True)
    thread.start()
    send("ready", server.port, os.getpid())
    conn.recv()  # "stop"
    stop.set()
    thread.join()
    status = master.status()
    lost = sum(1 for node in status["node_table"] if node["state"] == "dead")
    send("done", {"ticks": len(ticks), "tick_mean_ms": 1e3 * statistics.fmean(ticks) if ticks else 0.0,
                  "tick_max_ms": 1e3 * max(ticks, default=0.0), "lost_nodes": lost, "state": status["state"]})
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
        status = int(head[9:12])
        body = bytes(self._buf[end + 4:end + 4 + length])
        del self._buf[:end + 4 + length]
        if "connection: close" in head:
            self.closed = True
        waiter.set_result((status, body))

    def request(self, raw: bytes) -> asyncio.Future[tuple[int, bytes]]:
        assert self.transport is not None
        self._waiter = asyncio.get_running_loop().create_future()
        self.transport.write(raw)
        return self._waiter

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


class Stats:
    """Counters shared by every simulated agent."""

    def __init__(self) -> None:
        self.requests = 0
        self.retries = 0
        self.timeouts = 0
        self.connects = 0
        self.heartbeats: list[tuple[float, float]] = []  # (sent at, latency s)


class SimAgent:
    """A simulated agent: the protocol of ``ElasticAgent``, no workers."""

    def __init__(self, node_id: int, port: int, stats: Stats) -> None:
        self.node_id = node_id
        self.port = port
        self.stats = stats
        self.pid = 100_000 + node_id
        self._conn: _Http | None = None
        self._host = f"Host: 127.0.0.1:{port}\r\n".encode()
        self.join_sent: float | None = None
        self.ready_at: float | None = None
        self.last_heartbeat_sent: float | None = None

    async def _once(self, name: str, payload: bytes) -> dict[str, Any]:
        conn = self._conn
        if conn is None or conn.closed or time.monotonic() - conn.last_used > KEEPALIVE_S:
            if conn is not None:
                conn.close()
            loop = asyncio.get_running_loop()
            _, conn = await loop.create_connection(_Http, "127.0.0.1", self.port)
            self._conn = conn
            self.stats.connects += 1
        raw = (b"POST /v1/" + name.encode() + b" HTTP/1.1\r\n" + self._host
               + b"Content-Type: application/json\r\nContent-Length: " + str(len(payload)).encode()
               + b"\r\n\r\n" + payload)
        self.stats.requests += 1
        status, body = await conn.request(raw)
        conn.last_used = time.monotonic()
        if status >= 400:
            raise RuntimeError(f"master answered {status} to /v1/{name}: {body[:200]!r}")
        return json.loads(body)

    async def call(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """One RPC with ``MasterClient``'s timeout and retry policy."""
        payload = json.dumps(body).encode()
        start = time.monotonic()
        for attempt in range(RETRY_ATTEMPTS):
            try:
                return await asyncio.wait_for(self._once(name, payload), REQUEST_TIMEOUT_S)
            except (OSError, asyncio.TimeoutError) as exc:
                if isinstance(exc, asyncio.TimeoutError):
                    self.stats.timeouts += 1
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
                wait = min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** attempt) + random.uniform(0, RETRY_FIRST_S)
                if attempt == RETRY_ATTEMPTS - 1 or time.monotonic() - start + wait > RETRY_TOTAL_S:
                    raise
                self.stats.retries += 1
                await asyncio.sleep(wait)
        raise AssertionError("unreachable")

    async def rendezvous(self) -> None:
        await self.call("register", {"node_id": self.node_id, "host": f"sim-{self.node_id}", "pid": self.pid})
        self.join_sent = time.monotonic()
        await self.call("join", {"node_id": self.node_id, "nproc": 1})
        while True:
            answer = await self.call("poll", {"node_id": self.node_id})
            if answer["state"] == "ready":
                self.ready_at = time.monotonic()
                return
            if answer["state"] == "stop":
                raise RuntimeError(f"node {self.node_id}: the master said stop during rendezvous")
            if answer["state"] == "rejoin":
                await self.call("join", {"node_id": self.node_id, "nproc": 1})
            await asyncio.sleep(POLL_S)

    async def heartbeat(self, step: int) -> None:
        body: dict[str, Any] = {"node_id": self.node_id, "round": 0, "workers": {str(self.node_id): self.pid + 1},
                                "steps": {str(self.node_id): step}, "records": [], "pid": self.pid}
        if self.node_id == 0:  # rank 0's progress goes to the master
            body["records"] = [{"type": "step", "step": step, "dt": 0.1, "t": time.time(), "metrics": {"loss": 1.0}}]
        sent = time.monotonic()
        self.last_heartbeat_sent = sent
        await self.call("heartbeat", body)
        self.stats.heartbeats.append((sent, time.monotonic() - sent))


# ----- one measurement -----------------------------------------------------------------------


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered)) - 1))]


async def _drive(n: int, port: int, conn: Any, args: argparse.Namespace) -> dict[str, Any]:
    interval_s, timeout_s = args.heartbeat_interval_s, args.heartbeat_timeout_s
    stats = Stats()
    agents = [SimAgent(i, port, stats) for i in range(n)]
    stop, all_ready = asyncio.Event(), asyncio.Event()
    counter = [0]
    # the silent agents: spread over the node ids and over the first interval of the window
    k = min(args.silent_agents, n)
    silent_ids = [(i * n) // k + (n // (2 * k)) for i in range(k)] if k else []
    silent_pos = {nid: j for j, nid in enumerate(silent_ids)}
    anchor = time.monotonic()
    tasks: list[asyncio.Task[None]] = []
    deadlines: dict[int, float] = {}  # silent agent -> when it goes silent (set once all are ready)
    for agent in agents:
        nid = agent.node_id
        tasks.append(asyncio.ensure_future(_run_agent(agent, anchor, interval_s, nid / n, deadlines, nid in silent_pos,
                                                      stop, all_ready, counter, n)))
    me = psutil.Process()
    child = psutil.Process(args._child_pid)
    cpu0 = (me.cpu_times(), child.cpu_times(), time.monotonic())
    try:
        await asyncio.wait_for(all_ready.wait(), args.rendezvous_limit_s)
    except asyncio.TimeoutError:
        pass
    joins = [a.join_sent for a in agents if a.join_sent is not None]
    readies = [a.ready_at for a in agents if a.ready_at is not None]
    cpu1 = (me.cpu_times(), child.cpu_times(), time.monotonic())
    ready_all = len(readies) == n
    rendezvous_s = (max(readies) - min(joins)) if ready_all and joins else float("nan")
    # the window starts one interval after the last ready (or after giving up on the rest)
    window_start = (max(readies) if ready_all else time.monotonic()) + interval_s
    window_end = window_start + args.window_intervals * interval_s
    for j, nid in enumerate(silent_ids):  # silent from a slot in the window, spread over an interval
        deadlines[nid] = window_start + (j + 0.5) * interval_s / max(1, k)
    # wait for the window; then for the relaunch callbacks
    relaunches: dict[int, float] = {}
    spurious: list[int] = []
    expect_until = window_end
    if silent_ids:
        expect_until = max(window_end, window_start + interval_s * 2 + timeout_s + 2.0)
    cpu2: Any = None
    while True:
        now = time.monotonic()
        if cpu2 is None and now >= window_start:
            cpu2 = (me.cpu_times(), child.cpu_times(), now)
        while conn.poll():
            msg = conn.recv()
            if msg[0] == "relaunch":
                (relaunches if msg[1] in silent_pos else {}).setdefault(msg[1], msg[2])
                if msg[1] not in silent_pos:
                    spurious.append(msg[1])
        if now >= window_end and all(nid in relaunches for nid in silent_ids):
            break
        if now >= expect_until:
            break
        await asyncio.sleep(0.02)
    cpu3 = (me.cpu_times(), child.cpu_times(), time.monotonic())
    stop.set()
    for t in tasks:
        t.cancel()
    ended = await asyncio.gather(*tasks, return_exceptions=True)
    failed = [e for e in ended if isinstance(e, Exception)]

    def cpu_pct(a: Any, b: Any) -> tuple[float, float]:
        wall = b[2] - a[2]
        return (100 * (sum(b[0][:2]) - sum(a[0][:2])) / wall, 100 * (sum(b[1][:2]) - sum(a[1][:2])) / wall)

    hb = [lat for sent, lat in stats.heartbeats if window_start <= sent < window_end]
    window_s = window_end - window_start
    overheads = []
    for nid in silent_ids:
        agent = agents[nid]
        if nid in relaunches and agent.last_heartbeat_sent is not None:
            overheads.append(1e3 * (relaunches[nid] - agent.last_heartbeat_sent - timeout_s))
    rdzv_cpu = cpu_pct(cpu0, cpu1)
    hb_cpu = cpu_pct(cpu2, cpu3) if cpu2 is not None else (float("nan"), float("nan"))
    return {
        "agents": n,
        "rendezvous_s": round(rendezvous_s, 3),
        "ready_agents": len(readies),
        "start_to_all_ready_s": round(max(readies) - anchor, 3) if ready_all else float("nan"),
        "heartbeat_interval_s": interval_s,
        "heartbeat_rate_per_s": round(len(hb) / window_s, 1) if window_s > 0 else 0.0,
        "heartbeat_offered_rate_per_s": round(n / interval_s, 1),
        "heartbeat_samples": len(hb),
        "heartbeat_p50_ms": round(1e3 * _percentile(hb, 50), 2),
        "heartbeat_p99_ms": round(1e3 * _percentile(hb, 99), 2),
        "heartbeat_max_ms": round(1e3 * max(hb, default=float("nan")), 2),
        "relaunch_decision_ms": round(statistics.median(overheads), 1) if overheads else float("nan"),
        "relaunch_decision_max_ms": round(max(overheads), 1) if overheads else float("nan"),
        "relaunch_samples": len(overheads),
        "heartbeat_timeout_s": timeout_s,
        "spurious_losses": len(spurious),
        "requests": stats.requests,
        "connects": stats.connects,
        "timeouts": stats.timeouts,
        "retries": stats.retries,
        "failed_agents": len(failed),
        "master_cpu_pct_rendezvous": round(rdzv_cpu[1], 1),
        "client_cpu_pct_rendezvous": round(rdzv_cpu[0], 1),
        "master_cpu_pct_heartbeats": round(hb_cpu[1], 1),
        "client_cpu_pct_heartbeats": round(hb_cpu[0], 1),
    }


async def _run_agent(agent: SimAgent, anchor: float, interval_s: float, phase: float, deadlines: dict[int, float],
                     silent: bool, stop: asyncio.Event, all_ready: asyncio.Event, counter: list[int], n: int) -> None:
    """Run one agent; a silent one stops after its first heartbeat slot past its deadline,
    which is known only once every agent is ready."""
    try:
        await agent.rendezvous()
    finally:
        counter[0] += 1
        if counter[0] == n:
            all_ready.set()
    step = 0
    await agent.heartbeat(step)  # at once after ready, as ElasticAgent does
    slot = anchor + phase * interval_s
    while slot <= time.monotonic():
        slot += interval_s
    while not stop.is_set():
        await asyncio.sleep(max(0.0, slot - time.monotonic()))
        step += 1
        await agent.heartbeat(step)
        deadline = deadlines.get(agent.node_id) if silent else None
        if deadline is not None and slot >= deadline:
            break  # this node goes silent now (its host died)
        slot += interval_s
    if agent._conn is not None:
        agent._conn.close()


def measure(n: int, args: argparse.Namespace) -> dict[str, Any]:
    """Start a master for ``n`` nodes, drive ``n`` agents against it, return the numbers."""
    log_dir = tempfile.mkdtemp(prefix=f"master-scale-{n}-")
    ctx = mp.get_context("spawn")
    parent, child_conn = ctx.Pipe()
    proc = ctx.Process(target=_master_process, name="master",
                       args=(n, args.heartbeat_interval_s, args.heartbeat_timeout_s, log_dir, child_conn))
    proc.start()
    try:
        if not parent.poll(120):
            raise RuntimeError(f"the master did not start; see {log_dir}/master.log")
        kind, port, pid = parent.recv()
        assert kind == "ready"
        args._child_pid = pid
        if args.profile_master:  # py-spy from outside, for the whole run
            spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
            out = Path(args.profile_master) / f"master_{n}.svg"
            out.parent.mkdir(parents=True, exist_ok=True)
            import subprocess
            profiler = subprocess.Popen([spy, "record", "--pid", str(pid), "--output", str(out), "--rate", "200",
                                         "--idle", "--threads"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(1.0)
        started = time.monotonic()
        row = asyncio.run(_drive(n, port, parent, args))
        row["measure_s"] = round(time.monotonic() - started, 1)
        parent.send("stop")
        while True:
            msg = parent.recv()
            if msg[0] == "done":
                row.update({f"master_{k}": (round(v, 2) if isinstance(v, float) else v) for k, v in msg[1].items()})
                break
        if args.profile_master:
            profiler.terminate()
            profiler.wait(30)
        proc.join(30)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join()
        if args.keep_logs:
            row_dir = log_dir
            print(f"master logs of N={n}: {row_dir}", file=sys.stderr)
        else:
            shutil.rmtree(log_dir, ignore_errors=True)
    return row


# ----- report --------------------------------------------------------------------------------


def print_table(rows: list[dict[str, Any]], console: Console) -> None:
    table = Table(title="job master at scale (real JobMaster + MasterServer, simulated agents)")
    for col in ("agents", "rendezvous s", "hb interval s", "hb served/s", "hb p50 ms", "hb p99 ms",
                "relaunch decision ms (median / max)", "master CPU % (rdzv / hb)", "client CPU % (rdzv / hb)",
                "timeouts / retries / lost"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            f"{r['agents']:,}", f"{r['rendezvous_s']:.2f}", f"{r['heartbeat_interval_s']:g}",
            f"{r['heartbeat_rate_per_s']:,.0f} of {r['heartbeat_offered_rate_per_s']:,.0f}",
            f"{r['heartbeat_p50_ms']:.1f}", f"{r['heartbeat_p99_ms']:.1f}",
            f"{r['relaunch_decision_ms']:.0f} / {r['relaunch_decision_max_ms']:.0f}",
            f"{r['master_cpu_pct_rendezvous']:.0f} / {r['master_cpu_pct_heartbeats']:.0f}",
            f"{r['client_cpu_pct_rendezvous']:.0f} / {r['client_cpu_pct_heartbeats']:.0f}",
            f"{r['timeouts']} / {r['retries']} / {r['spurious_losses']}",
        )
    console.print(table)
    for key, (n, goal) in GOALS.items():
        row = next((r for r in rows if r["agents"] == n), None)
        if row is not None:
            ok = row[key] <= goal
            console.print(f"goal {key} <= {goal:g} at {n:,} agents: {row[key]:g} "
                          + ("[green]met[/green]" if ok else "[red]missed[/red]"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", default="1000,10000", help="agent counts, comma-separated")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--heartbeat-interval-s", type=float, default=3.0)
    parser.add_argument("--heartbeat-timeout-s", type=float, default=10.0)
    parser.add_argument("--window-intervals", type=float, default=3.0,
                        help="heartbeat latencies are taken over this many intervals")
    parser.add_argument("--silent-agents", type=int, default=3)
    parser.add_argument("--rendezvous-limit-s", type=float, default=120.0, help="give up on a rendezvous after this")
    parser.add_argument("--keep-logs", action="store_true", help="keep the master's log directory")
    parser.add_argument("--profile-master", metavar="DIR", help="record the master with py-spy into DIR/master_N.svg")
    args = parser.parse_args(argv)
    counts = [int(x.replace("_", "")) for x in args.agents.split(",") if x.strip()]
    need = max(counts) + 1000
    soft, hard = __import__("resource").getrlimit(__import__("resource").RLIMIT_NOFILE)
    if soft < need:
        __import__("resource").setrlimit(__import__("resource").RLIMIT_NOFILE, (min(need, hard), hard))

    console = Console()
    rows = []
    started = time.monotonic()
    for n in counts:
        console.print(f"[bold]{n:,} agents[/bold] ...")
        row = measure(n, args)
        rows.append(row)
        console.print({k: v for k, v in row.items()})
    print_table(rows, console)
    total_s = time.monotonic() - started
    console.print(f"benchmark took {total_s:.0f} s")
    if args.json:
        largest = max(rows, key=lambda r: r["agents"])
        out = {
            **{k: largest[k] for k in ("rendezvous_s", "heartbeat_p50_ms", "heartbeat_p99_ms", "relaunch_decision_ms")},
            "agents": largest["agents"],
            "runs": {str(r["agents"]): r for r in rows},
            "settings": {"heartbeat_interval_s": args.heartbeat_interval_s,
                         "heartbeat_timeout_s": args.heartbeat_timeout_s, "poll_s": POLL_S, "tick_s": TICK_S,
                         "window_intervals": args.window_intervals, "silent_agents": args.silent_agents},
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
            "total_s": round(total_s, 1),
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
