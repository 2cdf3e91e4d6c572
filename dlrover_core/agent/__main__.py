"""``python -m dlrover_core.agent``: run one node's elastic agent until the job ends.

The Job comes as JSON in ``DLROVER_JOB_SPEC``; the master's address in
``DLROVER_MASTER_ADDR`` (or ``--master-addr``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from dlrover_core import env
from dlrover_core.agent.agent import ElasticAgent
from dlrover_core.logging import configure, get_logger
from dlrover_core.plugins import get_host
from dlrover_core.protocol.client import MasterClient
from dlrover_core.retry import rpc_retrying
from dlrover_core.spec import JobSpec


def _watch(pid: int, on_gone: Callable[[], None]) -> None:
    def loop() -> None:
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                on_gone()
                return
            except PermissionError:
                pass
            time.sleep(1.0)

    threading.Thread(target=loop, name="dlrover-parent-watch", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dlrover_core.agent")
    parser.add_argument("--job-id", required=True)
    parser.add_argument("--node-id", type=int, required=True)
    parser.add_argument("--master-addr", default=os.environ.get(env.MASTER_ADDR))
    parser.add_argument("--log-dir", required=True)
    args = parser.parse_args(argv)
    if not args.master_addr:
        parser.error(f"--master-addr or {env.MASTER_ADDR} is required")
    configure()
    log = get_logger()

    job = JobSpec.from_dict(json.loads(os.environ[env.JOB_SPEC]))
    accelerator = get_host().create_accelerator(os.environ.get(env.ACCELERATOR) or job.accelerator)
    nproc = job.nodes.nproc_per_node
    nproc = accelerator.default_nproc_per_node() if nproc == "auto" else int(nproc)
    storage = get_host().registries.storage.get(job.checkpoint.storage)(job.checkpoint.dir)
    # The master may be down for a while (restarted from its journal by the scheduler): keep
    # retrying for as long as the master would wait before declaring this node lost.
    patience_s = max(30.0, job.failure.heartbeat_timeout_s)
    client = MasterClient(args.master_addr,
                          retrying=lambda: rpc_retrying(attempts=10_000, max_total_s=patience_s, max_wait_s=1.0))
    agent = ElasticAgent(job=job, job_id=args.job_id, node_id=args.node_id, client=client,
                         log_dir=Path(args.log_dir), accelerator=accelerator, nproc=nproc, storage=storage)
    agent.install_signal_handlers()
    watch = int(os.environ.get(env.WATCH_PID, "0") or 0)
    if watch:
        _watch(watch, agent.request_stop)
    log.info("agent_started", node_id=args.node_id, pid=os.getpid(), accelerator=accelerator.name, nproc=nproc)
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
