"""What a worker process is started with: its command line and environment.

Both the agent (for real) and ``Job.dryrun()`` (for the preview) use these, so the plan
shows exactly what runs.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

from dlrover_core import env
from dlrover_core.spec import Job

__all__ = ["worker_argv", "worker_env"]


def worker_argv(job: Job, python: str | None = None) -> list[str]:
    """The worker command for ``job.entrypoint`` (a script, ``pkg.mod`` or ``pkg.mod:fn``)."""
    python = python or sys.executable
    ep = job.entrypoint
    if ep.endswith(".py") or "/" in ep:
        return [python, "-u", ep, *job.args]
    if ":" in ep:
        return [python, "-u", "-m", "dlrover_core.train.call", ep, *job.args]
    return [python, "-u", "-m", ep, *job.args]


def worker_env(
    job: Job,
    *,
    job_id: str,
    node_id: int,
    world: dict[str, Any],
    local_rank: int,
    master_addr: str,
    accelerator: Any,
    progress_file: str,
    log_dir: str,
    agent_pid: int,
) -> dict[str, str]:
    """The variables set for one worker on top of the agent's environment.

    ``world`` is the master's answer to a rendezvous poll (round, node_rank, num_nodes,
    rank_offset, nproc, world_size, store_host, store_port, restart_count, max_restarts).
    """
    nproc = int(world["nproc"])
    rank = int(world["rank_offset"]) + local_rank
    variables = {
        # torch elastic's contract (torchrun sets the same names)
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world["world_size"]),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": str(world["node_rank"]),
        "GROUP_WORLD_SIZE": str(world["num_nodes"]),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world["world_size"]),
        "ROLE_NAME": "default",
        "MASTER_ADDR": str(world["store_host"]),
        "MASTER_PORT": str(world["store_port"]),
        "TORCHELASTIC_RESTART_COUNT": str(world["restart_count"]),
        "TORCHELASTIC_MAX_RESTARTS": str(world["max_restarts"]),
        "TORCHELASTIC_RUN_ID": job_id,
        # the store is served by the master, fresh for every round: clients only
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "PYTHONUNBUFFERED": "1",
        # dlrover's own
        env.JOB_ID: job_id,
        env.JOB_SPEC: json.dumps(job.to_dict(), separators=(",", ":")),
        env.LOG_DIR: log_dir,
        env.MASTER_ADDR: master_addr,
        env.NODE_ID: str(node_id),
        env.ROUND: str(world["round"]),
        env.ACCELERATOR: accelerator.name,
        env.PROGRESS_FILE: progress_file,
        env.WATCH_PID: str(agent_pid),
    }
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in job.env:
        variables["OMP_NUM_THREADS"] = "1"  # as torchrun does: N workers must not each take every core
    variables.update(accelerator.worker_env(local_rank, nproc))
    variables.update(job.env)
    return variables
