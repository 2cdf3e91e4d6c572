"""``python -m dlrover_core.master``: run a job's master until the job ends.

The Job comes as JSON in ``DLROVER_JOB_SPEC``. The master journals its state in
``--log-dir`` (:mod:`~dlrover_core.master.journal`): every decision is written ahead, and
soft state (progress, metrics) every half second (nodes / 500 s above 250 nodes); a master started where a journal exists
resumes from it (the local scheduler restarts a master that died). On exit it writes
``goodput.json`` (the timeline) and ``result.json`` (the JobResult) atomically.

With ``DLROVER_MASTER_ADDR_FILE`` set, the master writes its ``host:port`` there once it
listens; if ``--port`` is taken (a restarted master whose port another process got
meanwhile), it listens on a free port instead, and agents find it through that file.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from dlrover_core import env
from dlrover_core.control_plane import decode_job
from dlrover_core.logging import configure, get_logger
from dlrover_core.master.job_master import JobMaster
from dlrover_core.master.journal import Journal
from dlrover_core.master.journal import write_atomic as _write_atomic
from dlrover_core.master.server import MasterServer
from dlrover_core.plugins import get_host
from dlrover_core.protocol.messages import Cancel
from dlrover_core.rundir import RunDir
from dlrover_core.scheduler_backend import JobHandle
from dlrover_core.signals import SignalWatcher

#: Seconds between writes of soft state (progress, metrics, goodput) to the journal in a
#: small job; every decision is written ahead, at once, whatever this says.
_JOURNAL_S = 0.5
#: Nodes per second of soft-state journal interval in a large job (see soft_state_journal_s).
_JOURNAL_NODES_PER_S = 500


def soft_state_journal_s(nodes: int) -> float:
    """Seconds between soft-state snapshots for a job of ``nodes`` nodes:
    ``max(0.5, nodes / 500)`` — 0.5 s up to 250 nodes, 20 s at 10,000. A snapshot of the
    whole node table costs about 20 ms per 1,000 nodes of the master's time (measured with
    ``benchmarks/master_scale.py``, ``docs/scale.md``), during which requests wait; spacing
    them keeps that under about 1% of the master's time. What a master restarted from its
    journal may lose is soft state only (progress and metrics of that interval), which the
    next heartbeats bring back."""
    return max(_JOURNAL_S, nodes / _JOURNAL_NODES_PER_S)
#: Seconds a master retries a taken ``--port`` before it takes a free one (with an address file).
_PORT_RETRY_S = 2.0


def _import_torch() -> None:
    import torch.distributed  # noqa: F401  (heavy)


#: The thread importing torch, started once the master serves (before, it would slow the
#: master's own start: both need the interpreter lock). Round stores need torch.
_TORCH_IMPORT = threading.Thread(target=_import_torch, name="dlrover-import-torch", daemon=True)


def _store_factory():
    """``make(port=0) -> (port, store)``: a TCPStore server for a round (``port`` 0: a free one).

    While torch is still being imported (a master that just started), the round is answered
    at once with a reserved port and a :class:`_LateStore` whose server starts on that port
    as soon as torch is in: workers import torch themselves before they connect, and a
    TCPStore client retries its connection meanwhile.
    """

    def make(port: int = 0):
        if "torch.distributed" not in sys.modules or _TORCH_IMPORT.is_alive():
            return _late_store(port)
        import torch.distributed as dist  # heavy: imported already (on a thread at start)

        store = dist.TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False, use_libuv=True)
        return store.port, store

    return make


def _late_store(port: int):
    reserved = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    reserved.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    reserved.bind(("0.0.0.0", port))
    store = _LateStore(reserved)
    return store.port, store


class _LateStore:
    """A round's TCPStore server that starts once torch is imported; until then its port is
    held by a bound (not listening) socket so that no other process takes it. Its methods
    wait for the server."""

    def __init__(self, reserved: socket.socket) -> None:
        self.port: int = reserved.getsockname()[1]
        self._reserved = reserved
        self._store = None
        self._error: BaseException | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._start, name="dlrover-late-store", daemon=True).start()

    def _start(self) -> None:
        try:
            if _TORCH_IMPORT.is_alive():
                _TORCH_IMPORT.join()
            import torch.distributed as dist  # heavy: imported by now

            self._reserved.close()
            self._store = dist.TCPStore("0.0.0.0", self.port, is_master=True, wait_for_workers=False,
                                        use_libuv=True)
        except BaseException as exc:  # noqa: BLE001 - re-raised on use
            self._error = exc
            get_logger().error("round_store_failed", port=self.port, error=f"{type(exc).__name__}: {exc}")
        finally:
            self._ready.set()

    def __getattr__(self, name: str):
        self._ready.wait()
        if self._store is None:
            raise RuntimeError(f"the round's TCPStore on port {self.port} did not start: {self._error!r}")
        return getattr(self._store, name)

    def set(self, key: str, value: str) -> None:
        self.__getattr__("set")(key, value)


def _await_launcher(request) -> None:
    """``relaunch(NodeRelaunch)`` under ``dlrover run`` on each host: the lost node's own
    launcher restarts its agent (``dlrover_core.hostrun``); the master awaits its register
    (re-ordered after ``Failure.heartbeat_timeout_s``, up to its relaunch cap)."""
    get_logger().info("node_relaunch_awaited", node_id=request.node_id, by="its host's dlrover run")


def _relauncher(job, job_id: str, log_dir: Path):
    """``relaunch(NodeRelaunch)`` through the job's scheduler backend, if it can relaunch nodes."""
    backend = get_host().registries.scheduler.get(job.scheduler)()
    if not backend.capabilities.relaunch_node:
        return None
    handle = JobHandle(scheduler=job.scheduler, job_id=job_id, log_dir=str(log_dir))
    return lambda request: backend.relaunch_node(handle, request)


def _listen(master, host: str, port: int, *, fallback: bool):
    """A MasterServer on ``host:port``; when the port stays taken for ``_PORT_RETRY_S`` and
    ``fallback`` (agents can learn another address), on a free port instead."""
    log = get_logger()
    deadline = time.monotonic() + _PORT_RETRY_S
    while True:
        try:
            return MasterServer(master, host, port)
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or port == 0:
                raise
            if time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            if not fallback:
                raise OSError(exc.errno, f"the job master cannot listen on {host}:{port}: {exc.strerror}; free the "
                                         f"port or start the master with another --port") from exc
            log.warning("master_port_taken", addr=f"{host}:{port}", fallback="a free port, written to the address file")
            port = 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dlrover_core.master")
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--host", default="127.0.0.1", help="address to serve the HTTP API on")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--store-host", default="127.0.0.1", help="address workers use to reach round stores")
    parser.add_argument("--log-dir", required=True)
    parser.add_argument("--listen-fd", type=int, default=None,
                        help="serve on this inherited, listening socket (dlrover run binds the endpoint)")
    parser.add_argument("--relaunch-by-launchers", action="store_true",
                        help="nodes are relaunched by their hosts' launchers (dlrover run on each host restarts "
                             "its agent), not through the scheduler: a lost node is awaited")
    args = parser.parse_args(argv)
    configure()
    log = get_logger()

    job = decode_job(os.environ[env.JOB_SPEC])
    log_dir = Path(args.log_dir)
    run = RunDir(log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    host = get_host()
    storage = host.registries.storage.get(job.checkpoint.storage)(job.checkpoint.dir)
    journal = Journal(run.journal, log_path=run.journal_log)
    make_store = _store_factory()
    master = JobMaster(job, args.job_id, store_host=args.store_host, store_factory=make_store,
                       storage=storage, relaunch=_await_launcher if args.relaunch_by_launchers else _relauncher(job, args.job_id, log_dir),
                       log_dir=log_dir,
                       emit=host.emit, journal=journal, reopen_store=lambda port: make_store(port)[1])
    if journal.exists():  # this master replaces one that died: resume its state
        snapshot, entries = journal.load()
        if snapshot is not None:
            master.restore(snapshot, entries)
    addr_file = os.environ.get(env.MASTER_ADDR_FILE)
    if args.listen_fd is not None:
        server = MasterServer(master, sock=socket.socket(fileno=args.listen_fd))
    else:
        server = _listen(master, args.host, args.port, fallback=bool(addr_file))
    server.start()
    _TORCH_IMPORT.start()
    if addr_file:
        _write_atomic(Path(addr_file), f"{args.host}:{server.port}")
    log.info("master_started", job_id=args.job_id, addr=f"{args.host}:{server.port}", pid=os.getpid())

    # the cancel runs on the watcher's thread, not in the handler: the main thread may hold a
    # lock the cancel takes (a log write, the events file), which would deadlock the master
    SignalWatcher(lambda signum: master.cancel(Cancel(reason=f"master received {signal.Signals(signum).name}"))).start()
    watch = int(os.environ.get(env.WATCH_PID, "0") or 0)

    drain_s = job.failure.stop_grace_s + 3 * job.heartbeat_interval_s + 5.0
    journal_s = soft_state_journal_s(job.nodes.max)
    finished_at: float | None = None
    drained = False
    last_journal = 0.0
    while True:
        master.tick()
        if time.monotonic() - last_journal >= journal_s:
            last_journal = time.monotonic()
            master.write_journal()
        if watch and not _alive(watch):
            master.cancel(Cancel(reason="the process that started the job exited"))
        if master.state.is_terminal:
            finished_at = finished_at or time.monotonic()
            drained = master.drained()
            if drained or time.monotonic() - finished_at > drain_s:
                break
        time.sleep(0.1)  # (a signal cancels the job on the watcher's thread; the next pass sees it)
    result = master.result()
    _write_atomic(run.goodput, json.dumps(master.status().goodput, indent=2))
    _write_atomic(run.result, json.dumps(result.to_dict(), indent=2))
    journal.remove()
    if not drained:
        time.sleep(0.2)  # let agents still there read their last "stop" (drained: every one has exited)
    server.stop()
    log.info("master_exited", state=result.state.value)
    return 0


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


if __name__ == "__main__":
    sys.exit(main())
