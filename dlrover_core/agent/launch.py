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
from dlrover_core.protocol.messages import PollState, RoundAssignment
from dlrover_core.scheduler_backend import ProcessSpec
from dlrover_core.spec import JobSpec

__all__ = ["preview_workers", "worker_argv", "worker_env"]


def worker_argv(job: JobSpec, python: str | None = None) -> list[str]:
    """The worker command for ``job.entrypoint`` (a script, ``pkg.mod`` or ``pkg.mod:fn``);
    the entrypoint itself, as an executable, when ``DLROVER_WORKER_EXEC`` is ``1``
    (``dlrover run --no-python``, as torchrun's)."""
    python = python or sys.executable
    ep = job.entrypoint
    if os.environ.get(env.WORKER_EXEC) == "1":
        return [ep, *job.args]
    if ep.endswith(".py") or "/" in ep:
        return [python, "-u", ep, *job.args]
    if ":" in ep:
        return [python, "-u", "-m", "dlrover_core.train.call", ep, *job.args]
    return [python, "-u", "-m", ep, *job.args]


def worker_env(
    job: JobSpec,
    *,
    job_id: str,
    node_id: int,
    world: RoundAssignment,
    local_rank: int,
    master_addr: str,
    accelerator: Any,
    progress_file: str,
    log_dir: str,
    agent_pid: int,
    agent_token: int = 0,
    error_file: str = "",
) -> dict[str, str]:
    """The variables set for one worker on top of the agent's environment.

    ``world`` is the master's answer to a rendezvous poll: the round the node's workers start in.
    ``error_file``: the worker's ``TORCHELASTIC_ERROR_FILE`` (one per worker and incarnation,
    as torchrun gives it), where torch's ``@record`` writes the exception the worker dies of.
    """
    nproc = world.nproc
    rank = world.rank_offset + local_rank
    variables = {
        # torch elastic's contract (torchrun sets the same names)
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world.world_size),
        "LOCAL_WORLD_SIZE": str(nproc),
        "GROUP_RANK": str(world.node_rank),
        "GROUP_WORLD_SIZE": str(world.num_nodes),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world.world_size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": world.store_host,
        "MASTER_PORT": str(world.store_port),
        "TORCHELASTIC_RESTART_COUNT": str(world.restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(world.max_restarts),
        "TORCHELASTIC_RUN_ID": job_id,
        # the store is served by the master, fresh for every round: clients only
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        **({"TORCHELASTIC_ERROR_FILE": error_file} if error_file else {}),
        "PYTHONUNBUFFERED": "1",
        # dlrover's own
        env.JOB_ID: job_id,
        env.JOB_SPEC: json.dumps(job.to_dict(), separators=(",", ":")),
        env.LOG_DIR: log_dir,
        env.MASTER_ADDR: master_addr,
        env.NODE_ID: str(node_id),
        env.ROUND: str(world.round),
        env.AGENT_TOKEN: str(agent_token),
        env.ACCELERATOR: accelerator.name,
        env.PROGRESS_FILE: progress_file,
        env.WATCH_PID: str(agent_pid),
    }
    if nproc > 1 and "OMP_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in job.env:
        variables["OMP_NUM_THREADS"] = "1"  # as torchrun does: N workers must not each take every core
    variables.update(accelerator.worker_env(local_rank, nproc))
    variables.update(job.env)
    return variables


def preview_workers(
    job: JobSpec,
    *,
    job_id: str,
    nproc: int,
    master_addr: str,
    store_host: str,
    accelerator: Any,
    log_dir: str,
    python: str | None = None,
    cwd: str | None = None,
    extra_env: dict[str, str] | None = None,
) -> tuple[Any, ...]:
    """The worker processes of the first rendezvous round, as the agents will start them:
    one ``ProcessSpec`` (role ``"worker"``) per rank, for ``Plan.workers`` (a preview;
    later rounds differ in ranks, store port and restart count).

    Args:
        nproc: workers per node.
        master_addr: ``host:port`` of the master, as the workers see it.
        store_host: host of the round's TCPStore, as the workers see it (its port is chosen
            by the master per round and shown as a placeholder).
        log_dir: the job's log directory as the workers see it.
        python: the interpreter path (default: this one).
        cwd: the workers' working directory (default: ``job.workdir``).
        extra_env: variables set on top (e.g. a backend's own copy of the job spec).
    """

    workers = []
    for node_rank in range(job.nodes.max):
        world = RoundAssignment(
            state=PollState.READY, round=0, node_rank=node_rank, num_nodes=job.nodes.max,
            rank_offset=node_rank * nproc, nproc=nproc, world_size=job.nodes.max * nproc, store_host=store_host,
            restart_count=0, max_restarts=job.failure.max_restarts,
        )
        for local_rank in range(nproc):
            rank = node_rank * nproc + local_rank
            variables = worker_env(
                job, job_id=job_id, node_id=node_rank, world=world, local_rank=local_rank,
                master_addr=master_addr, accelerator=accelerator,
                progress_file=f"{log_dir}/node_{node_rank}/round_0/progress_rank{rank}.jsonl",
                log_dir=log_dir, agent_pid=0,
            )
            variables.update(extra_env or {})
            variables["MASTER_PORT"] = "<fresh port per round, chosen by the master>"
            variables[env.WATCH_PID] = "<pid of the agent>"
            workers.append(ProcessSpec(
                role="worker", name=f"rank-{rank}", argv=tuple(worker_argv(job, python)), env=variables,
                cwd=cwd or job.workdir, log_file=f"{log_dir}/node_{node_rank}/rank_{rank}.log",
            ))
    return tuple(workers)
