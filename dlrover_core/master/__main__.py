"""``python -m dlrover_core.master``: run a job's master until the job ends.

The Job comes as JSON in ``DLROVER_JOB_SPEC``. Every half second the master journals its
state to ``master_journal.json`` in ``--log-dir``; a master started where a journal exists
resumes from it (the local scheduler restarts a master that died). On exit it writes
``goodput.json`` (the timeline) and ``result.json`` (the JobResult) atomically.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from dlrover_core import env
from dlrover_core.logging import configure, get_logger

#: Seconds between journal writes (what a restarted master can lose of its state).
_JOURNAL_S = 0.5


def _store_factory():
    import torch.distributed as dist

    def make():
        store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False, use_libuv=True)
        return store.port, store

    return make


def _relauncher(job, job_id: str, log_dir: Path):
    """``relaunch(node_id)`` through the job's scheduler backend, if it can relaunch nodes."""
    from dlrover_core.plugins import get_host
    from dlrover_core.schedulers.base import JobHandle

    backend = get_host().registries.scheduler.get(job.scheduler)()
    if not backend.capabilities.relaunch_node:
        return None
    handle = JobHandle(scheduler=job.scheduler, job_id=job_id, log_dir=str(log_dir))
    return lambda node_id: backend.relaunch_node(handle, node_id)


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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

    from dlrover_core.master.job_master import JobMaster
    from dlrover_core.master.server import MasterServer
    from dlrover_core.plugins import get_host
    from dlrover_core.spec import Job

    job = Job.from_dict(json.loads(os.environ[env.JOB_SPEC]))
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    host = get_host()
    storage = host.registries.storage.get(job.checkpoint.storage)(job.checkpoint.dir)
    master = JobMaster(job, args.job_id, store_host=args.store_host, store_factory=_store_factory(),
                       storage=storage, relaunch=_relauncher(job, args.job_id, log_dir), log_dir=log_dir,
                       emit=host.emit)
    journal = log_dir / "master_journal.json"
    if journal.exists():  # this master replaces one that died: resume its state
        master.restore(json.loads(journal.read_text()))
    server = MasterServer(master, args.host, args.port)
    server.start()
    log.info("master_started", job_id=args.job_id, addr=f"{args.host}:{server.port}", pid=os.getpid())

    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        master.cancel(f"master received {signal.Signals(signum).name}")
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    watch = int(os.environ.get(env.WATCH_PID, "0") or 0)

    drain_s = job.failure.stop_grace_s + 3 * job.failure.heartbeat_interval_s + 5.0
    finished_at: float | None = None
    last_journal, last_written = 0.0, ""
    while True:
        master.tick()
        if time.monotonic() - last_journal >= _JOURNAL_S:
            last_journal = time.monotonic()
            text = json.dumps(master.snapshot())
            if text != last_written:
                _write_atomic(journal, text)
                last_written = text
        if watch and not _alive(watch):
            master.cancel("the process that started the job exited")
        if master.state.is_terminal:
            finished_at = finished_at or time.monotonic()
            if master.drained() or time.monotonic() - finished_at > drain_s:
                break
        stop.wait(0.1)
    result = master.result()
    _write_atomic(log_dir / "goodput.json", json.dumps(master.status()["goodput"], indent=2))
    _write_atomic(log_dir / "result.json", json.dumps(result.to_dict(), indent=2))
    journal.unlink(missing_ok=True)
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
