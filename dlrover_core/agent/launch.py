"""What a worker process is started with: its command line and environment.

Both the agent (for real) and ``Job.dryrun()`` (for the preview) use these, so the plan
shows exactly what runs.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from dlrover_core import env
from dlrover_core.accelerators.numa import cpu_ranges, cpus_to_bind
from dlrover_core.control_plane import OMP_NUM_THREADS, encode_job, omp_num_threads
from dlrover_core.errors import DeviceError
from dlrover_core.protocol.messages import PollState, RoundAssignment
from dlrover_core.rundir import RunDir
from dlrover_core.scheduler_backend import ProcessSpec
from dlrover_core.spec import JobSpec

__all__ = ["check_placement", "placement_env", "preview_workers", "worker_argv", "worker_env"]


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
    bind_cpus: bool = True,
) -> dict[str, str]:
    """The variables set for one worker on top of the agent's environment.

    ``world`` is the master's answer to a rendezvous poll: the round the node's workers start in.
    ``error_file``: the worker's ``TORCHELASTIC_ERROR_FILE`` (one per worker and incarnation,
    as torchrun gives it), where torch's ``@record`` writes the exception the worker dies of.
    ``bind_cpus``: with ``nodes.numa_binding``, choose the worker's CPUs here (:func:`placement_env`;
    ``False`` in a preview, where they are chosen on the node when the worker starts).
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
        env.JOB_SPEC: encode_job(job),
        env.LOG_DIR: log_dir,
        env.MASTER_ADDR: master_addr,
        env.NODE_ID: str(node_id),
        env.ROUND: str(world.round),
        env.AGENT_TOKEN: str(agent_token),
        env.ACCELERATOR: accelerator.name,
        env.PROGRESS_FILE: progress_file,
        env.WATCH_PID: str(agent_pid),
        # placement is a ring: a node that keeps another's replicas has its own kept too
        env.REPLICA_PINS: "1" if world.replica_source >= 0 and world.replica_source_addr else "0",
    }
    threads = omp_num_threads(job, nproc=nproc, environ=os.environ)  # "1" for N > 1, as torchrun does
    if threads is not None:
        variables[OMP_NUM_THREADS] = threads
    variables.update(accelerator.worker_env(local_rank, nproc))
    variables.update(job.env)
    variables.update(placement_env(job, local_rank, accelerator, environ={**os.environ, **job.env}, bind_cpus=bind_cpus))
    return variables


def placement_env(job: JobSpec, local_rank: int, accelerator: Any, *, environ: dict[str, str] | None = None,
                  bind_cpus: bool = True) -> dict[str, str]:
    """The variables that place one worker on its device and CPUs (torchrun's
    ``--virtual-local-rank`` and ``--numa-binding``):

    * always ``DLROVER_LOCAL_RANK``: the worker's local rank on its node;
    * with ``nodes.virtual_local_rank``: ``LOCAL_RANK=0`` and the accelerator's visibility
      variable (``accelerator.visible_devices_env``, ``CUDA_VISIBLE_DEVICES``) narrowed to the
      ``local_rank``-th entry of its value in ``environ`` (the agent's, with ``job.env`` on
      top), or to ``local_rank`` where it is unset, as torch's
      ``LocalElasticAgent._set_local_rank_env``; an accelerator without one (cpu) gets none
      (torchrun sets ``CUDA_VISIBLE_DEVICES`` whatever the device);
    * with ``nodes.numa_binding`` (and ``bind_cpus``): ``DLROVER_CPU_AFFINITY``, the CPUs near
      device ``local_rank`` (:func:`dlrover_core.accelerators.numa.cpus_to_bind`, from
      ``accelerator.numa_nodes()``), which the worker's launcher applies.

    Raises:
        DeviceError: a worker without a device of its own under ``virtual_local_rank``, or a
            binding that cannot apply here (no device with a NUMA node, no such topology);
            the message names the option.
    """
    environ = os.environ if environ is None else environ
    variables = {env.LOCAL_RANK: str(local_rank)}
    if job.nodes.virtual_local_rank:
        variables["LOCAL_RANK"] = "0"
        name = accelerator.visible_devices_env
        if name:
            parent = environ.get(name)
            if parent is None:
                variables[name] = str(local_rank)
            else:
                entries = [e.strip() for e in parent.split(",")]
                if local_rank >= len(entries):
                    raise DeviceError(f"--virtual-local-rank (nodes.virtual_local_rank): the worker with local rank "
                                      f"{local_rank} has no device of its own: {name}={parent!r} lists "
                                      f"{len(entries)}; start at most {len(entries)} workers per node")
                variables[name] = entries[local_rank]
    if job.nodes.numa_binding is not None and bind_cpus:
        cpus = cpus_to_bind(job.nodes.numa_binding, device=local_rank, device_nodes=accelerator.numa_nodes())
        variables[env.CPU_AFFINITY] = cpu_ranges(cpus)
    return variables


def check_placement(job: JobSpec, accelerator: Any, nproc: int) -> None:
    """Compute every local rank's placement (:func:`placement_env`) on this machine, so a
    binding that cannot apply stops the job before anything starts (``dlrover run``, and
    ``Job.run()`` on a scheduler whose nodes use this machine's devices) instead of failing
    each worker's start.

    Raises:
        DeviceError: as :func:`placement_env`.
    """
    if job.nodes.numa_binding is None and not job.nodes.virtual_local_rank:
        return
    for local_rank in range(nproc):
        placement_env(job, local_rank, accelerator, environ={**os.environ, **job.env})


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
    run = RunDir(log_dir)
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
                progress_file=str(run.progress_file(node_rank, 0, rank)),
                log_dir=log_dir, agent_pid=0, bind_cpus=False,
            )
            variables.update(extra_env or {})
            variables["MASTER_PORT"] = "<fresh port per round, chosen by the master>"
            if job.nodes.numa_binding is not None:
                variables[env.CPU_AFFINITY] = f"<CPUs near device {local_rank}, chosen on the node at start>"
            variables[env.WATCH_PID] = "<pid of the agent>"
            workers.append(ProcessSpec(
                role="worker", name=f"rank-{rank}", argv=tuple(worker_argv(job, python)), env=variables,
                cwd=cwd or job.workdir, log_file=str(run.rank_log(node_rank, rank)),
            ))
    return tuple(workers)
