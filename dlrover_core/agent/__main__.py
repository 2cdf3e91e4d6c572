"""``python -m dlrover_core.agent``: run one node's elastic agent until the job ends.

The Job comes as JSON in ``DLROVER_JOB_SPEC``; the master's address in
``DLROVER_MASTER_ADDR`` (or ``--master-addr``).
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from dlrover_core import env
from dlrover_core.agent.agent import ElasticAgent
from dlrover_core.control_plane import decode_job
from dlrover_core.errors import MasterUnavailableError
from dlrover_core.logging import bind_process, configure, get_logger
from dlrover_core.plugins import get_host
from dlrover_core.protocol.client import MasterClient
from dlrover_core.protocol.messages import Action, AssignNode, NodeAssigned
from dlrover_core.retry import rpc_retrying


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
    parser.add_argument("--job-id", default="", help="the job's id (with --node-key: checked against the master's)")
    parser.add_argument("--node-id", type=int, default=None)
    parser.add_argument("--node-key", default=None,
                        help="instead of --node-id: ask the master for this launcher's node id (dlrover run)")
    parser.add_argument("--master-addr", default=os.environ.get(env.MASTER_ADDR))
    parser.add_argument("--log-dir", default=None, help="the job's log directory")
    parser.add_argument("--log-root", default=None, help="instead of --log-dir: <log-root>/<job id>")
    parser.add_argument("--result-file", default=None, help="write the job's result (JSON) there when it ends")
    args = parser.parse_args(argv)
    if not args.master_addr:
        parser.error(f"--master-addr or {env.MASTER_ADDR} is required")
    if (args.node_id is None) == (args.node_key is None):
        parser.error("give one of --node-id and --node-key")
    if (args.log_dir is None) == (args.log_root is None):
        parser.error("give one of --log-dir and --log-root")
    configure()
    log = get_logger()

    job = decode_job(os.environ[env.JOB_SPEC])
    accelerator = get_host().create_accelerator(os.environ.get(env.ACCELERATOR) or job.accelerator)
    nproc = job.nodes.nproc_per_node
    nproc = accelerator.default_nproc_per_node() if nproc == "auto" else int(nproc)
    storage = get_host().registries.storage.get(job.checkpoint.storage)(job.checkpoint.dir)
    # The master may be down for a while (restarted from its journal by the scheduler): keep
    # retrying for as long as the master would wait before declaring this node lost.
    patience_s = max(30.0, job.heartbeat_timeout_s)
    client = MasterClient(args.master_addr,
                          retrying=lambda: rpc_retrying(attempts=10_000, max_total_s=patience_s, max_wait_s=1.0))
    if args.node_key is not None or not args.job_id:
        try:
            assigned = _assigned_node(client, AssignNode(key=args.node_key or f"node-{args.node_id}",
                                                         rdzv_id=args.job_id))
        except MasterUnavailableError as exc:
            log.error("master_unreachable", master_addr=args.master_addr, error=str(exc))
            return 1
        if assigned.action == Action.STOP:
            log.error("job_not_joined", reason=assigned.reason)
            return 2
        args.job_id = assigned.job_id
        if args.node_id is None:
            args.node_id = assigned.node_id
    bind_process(node=args.node_id)  # every event of this agent names its node (JSON logs)
    if args.log_root is not None:
        args.log_dir = str(Path(args.log_root) / args.job_id)
    agent = ElasticAgent(job=job, job_id=args.job_id, node_id=args.node_id, client=client,
                         log_dir=Path(args.log_dir), accelerator=accelerator, nproc=nproc, storage=storage,
                         result_file=Path(args.result_file) if args.result_file else None)
    agent.install_signal_handlers()
    watch = int(os.environ.get(env.WATCH_PID, "0") or 0)
    if watch:
        _watch(watch, agent.request_stop)
    log.info("agent_started", node_id=args.node_id, pid=os.getpid(), accelerator=accelerator.name, nproc=nproc)
    return agent.run()


#: How often a host that has no place in the job yet asks again (seconds).
_PLACE_POLL_S = 0.5


def _assigned_node(client: MasterClient, message: AssignNode) -> NodeAssigned:
    """The master's answer to ``message`` once it gives a node id or says stop: while the job
    has all its nodes (``node_id`` -1, no action), ask again every ``_PLACE_POLL_S``."""
    waiting = False
    while True:
        assigned = client.assign_node(message)
        if assigned.node_id >= 0 or assigned.action == Action.STOP:
            return assigned
        if not waiting:
            get_logger().info("node_place_awaited", reason=assigned.reason)
            waiting = True
        time.sleep(_PLACE_POLL_S)


if __name__ == "__main__":
    sys.exit(main())
