"""``python -m dlrover_core.master``: run a job's master until the job ends.

The Job comes as JSON in ``DLROVER_JOB_SPEC``. The master journals its state in
``--log-dir`` (:mod:`~dlrover_core.master.journal`): every decision is written ahead, and
soft state (progress, metrics) every half second; a master started where a journal exists
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
import sys
import threading
import time
from pathlib import Path

from dlrover_core import env
from dlrover_core.logging import configure, get_logger
from dlrover_core.master.job_master import JobMaster
from dlrover_core.master.journal import Journal
from dlrover_core.master.journal import write_atomic as _write_atomic
from dlrover_core.master.server import MasterServer
from dlrover_core.plugins import get_host
from dlrover_core.protocol.messages import Cancel
from dlrover_core.scheduler_backend import JobHandle
from dlrover_core.spec import JobSpec

#: Seconds between writes of soft state (progress, metrics, goodput) to the journal; every
#: decision is written ahead, at once, whatever this says.
_JOURNAL_S = 0.5
#: Seconds a master retries a taken ``--port`` before it takes a free one (with an address file).
_PORT_RETRY_S = 2.0


def _store_factory():
    """``make(port=0) -> (port, store)``: a TCPStore server for a round (``port`` 0: a free one)."""
    import torch.distributed as dist  # heavy: only a serving master needs it

    def make(port: int = 0):
        store = dist.TCPStore("0.0.0.0", port, is_master=True, wait_for_workers=False, use_libuv=True)
        return store.port, store

    return make


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
    args = parser.parse_args(argv)
    configure()
    log = get_logger()

    job = JobSpec.from_dict(json.loads(os.environ[env.JOB_SPEC]))
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    host = get_host()
    storage = host.registries.storage.get(job.checkpoint.storage)(job.checkpoint.dir)
    journal = Journal(log_dir / "master_journal.json")
    make_store = _store_factory()
    master = JobMaster(job, args.job_id, store_host=args.store_host, store_factory=make_store,
                       storage=storage, relaunch=_relauncher(job, args.job_id, log_dir), log_dir=log_dir,
                       emit=host.emit, journal=journal, reopen_store=lambda port: make_store(port)[1])
    if journal.exists():  # this master replaces one that died: resume its state
        snapshot, entries = journal.load()
        if snapshot is not None:
            master.restore(snapshot, entries)
    addr_file = os.environ.get(env.MASTER_ADDR_FILE)
    server = _listen(master, args.host, args.port, fallback=bool(addr_file))
    server.start()
    if addr_file:
        _write_atomic(Path(addr_file), f"{args.host}:{server.port}")
    log.info("master_started", job_id=args.job_id, addr=f"{args.host}:{server.port}", pid=os.getpid())

    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        master.cancel(Cancel(reason=f"master received {signal.Signals(signum).name}"))
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    watch = int(os.environ.get(env.WATCH_PID, "0") or 0)

    drain_s = job.failure.stop_grace_s + 3 * job.failure.heartbeat_interval_s + 5.0
    finished_at: float | None = None
    last_journal = 0.0
    while True:
        master.tick()
        if time.monotonic() - last_journal >= _JOURNAL_S:
            last_journal = time.monotonic()
            master.write_journal()
        if watch and not _alive(watch):
            master.cancel(Cancel(reason="the process that started the job exited"))
        if master.state.is_terminal:
            finished_at = finished_at or time.monotonic()
            if master.drained() or time.monotonic() - finished_at > drain_s:
                break
        stop.wait(0.1)
    result = master.result()
    _write_atomic(log_dir / "goodput.json", json.dumps(master.status().goodput, indent=2))
    _write_atomic(log_dir / "result.json", json.dumps(result.to_dict(), indent=2))
    journal.remove()
    time.sleep(0.2)  # let agents read their last "stop"
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
