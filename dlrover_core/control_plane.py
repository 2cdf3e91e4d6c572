"""The job's control plane described once: the master's and the agents' processes.

Every backend starts the same two programs — one master (``python -m dlrover_core.master``)
and one agent per node (``python -m dlrover_core.agent``) — with the Job as JSON in
``DLROVER_JOB_SPEC``. This module builds their descriptions; a backend only places them (a
process, a container, a pod, an ``srun`` step):

- :func:`encode_job` / :func:`decode_job` (and :func:`job_from_environ`): the one encoder
  of ``DLROVER_JOB_SPEC`` and its one decoder (the master, the agents, the k8s controller,
  the docker backend, the workers);
- :func:`master_argv`, :func:`agent_argv`: the command lines; :func:`for_node` makes an
  agent's command line the one of another node, :func:`with_master_addr` points it at a
  master that moved;
- :func:`job_env`: the variables the master and every agent get; :func:`agent_env` adds an
  agent's;
- :func:`omp_num_threads`: the ``OMP_NUM_THREADS`` rule (a share of the cores the workers
  see, or ``"1"`` for an agent that starts several workers, as torchrun does);
- :func:`master_process`, :func:`agent_process`, :func:`node_process`: the same as
  :class:`~dlrover_core.scheduler_backend.ProcessSpec`.

Plugins reach it through :mod:`dlrover_core.backend`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import PurePath

import attrs

from dlrover_core import env, rundir
from dlrover_core.errors import SchedulerError
from dlrover_core.scheduler_backend import ProcessSpec
from dlrover_core.spec import JobSpec

__all__ = [
    "AGENT_MODULE",
    "MASTER_MODULE",
    "OMP_NUM_THREADS",
    "agent_argv",
    "agent_env",
    "agent_process",
    "decode_job",
    "encode_job",
    "for_node",
    "host_cores",
    "job_env",
    "job_from_environ",
    "master_argv",
    "master_process",
    "node_process",
    "omp_num_threads",
    "with_master_addr",
]

#: The module the master runs as (``python -m``).
MASTER_MODULE = "dlrover_core.master"
#: The module an agent runs as (``python -m``).
AGENT_MODULE = "dlrover_core.agent"
#: The variable of OpenMP's (and torch's intra-op) thread count.
OMP_NUM_THREADS = "OMP_NUM_THREADS"

_NODE_ID_FLAG = "--node-id"
_MASTER_ADDR_FLAG = "--master-addr"


# ----- the Job as DLROVER_JOB_SPEC -------------------------------------------------------------


def encode_job(job: JobSpec, *, sort_keys: bool = False) -> str:
    """``job`` as the compact JSON of ``DLROVER_JOB_SPEC``.

    Args:
        job: the Job as the processes see it (paths as they are where they run).
        sort_keys: keys in sorted order (the slurm backend's script; any order decodes the same).
    """
    return json.dumps(job.to_dict(), separators=(",", ":"), sort_keys=sort_keys)


def decode_job(text: str) -> JobSpec:
    """The Job of a ``DLROVER_JOB_SPEC`` value.

    Raises:
        ValueError: ``text`` is not JSON.
        JobSpecError: (a ``ValueError``) a field is missing or invalid.
    """
    return JobSpec.from_dict(json.loads(text))


def job_from_environ(environ: Mapping[str, str] | None = None) -> JobSpec | None:
    """The Job in ``environ``'s ``DLROVER_JOB_SPEC`` (default ``os.environ``); ``None`` where
    it is unset or empty (outside dlrover).

    Raises:
        ValueError, JobSpecError: as :func:`decode_job`.
    """
    raw = (os.environ if environ is None else environ).get(env.JOB_SPEC)
    return decode_job(raw) if raw else None


# ----- command lines ---------------------------------------------------------------------------


def master_argv(python: str, *, job_id: str, host: str, port: int | str, store_host: str, log_dir: str,
                extra: Sequence[str] = ()) -> tuple[str, ...]:
    """The master's command line.

    Args:
        python: the interpreter, as it is where the master runs.
        job_id: the run's id.
        host: the address the master listens on (``0.0.0.0``: every interface).
        port: its port (a shell expansion such as ``"$MASTER_PORT"`` in a script).
        store_host: the address the workers reach each round's store at.
        log_dir: the run directory, as it is where the master runs.
        extra: more arguments, appended.
    """
    return (python, "-m", MASTER_MODULE, "--job-id", job_id, "--host", host, "--port", str(port),
            "--store-host", store_host, "--log-dir", log_dir, *extra)


def agent_argv(python: str, *, job_id: str, node_id: int | str, master_addr: str, log_dir: str,
               module: str = AGENT_MODULE) -> tuple[str, ...]:
    """An agent's command line.

    Args:
        python: the interpreter, as it is where the agent runs.
        job_id: the run's id.
        node_id: the node (a shell expansion such as ``"$SLURM_NODEID"`` in a script).
        master_addr: the master's ``host:port``.
        log_dir: the run directory, as it is where the agent runs.
        module: the module run (a backend's wrapper that takes the agent's arguments and runs
            it, e.g. ``dlrover_plugin_slurm.node_task``).
    """
    return (python, "-m", module, "--job-id", job_id, _NODE_ID_FLAG, str(node_id), _MASTER_ADDR_FLAG, master_addr,
            "--log-dir", log_dir)


def _replace_value(argv: Sequence[str], flag: str, value: str) -> tuple[str, ...]:
    out = list(argv)
    try:
        out[out.index(flag) + 1] = value
    except (ValueError, IndexError):
        raise SchedulerError(f"not an agent's command line (no {flag} <value>): {' '.join(argv)}") from None
    return tuple(out)


def for_node(argv: Sequence[str], node_id: int | str) -> tuple[str, ...]:
    """Agent command line ``argv`` (of :func:`agent_argv`) for node ``node_id``.

    Raises:
        SchedulerError: ``argv`` has no ``--node-id <id>``.
    """
    return _replace_value(argv, _NODE_ID_FLAG, str(node_id))


def with_master_addr(argv: Sequence[str], master_addr: str) -> tuple[str, ...]:
    """Agent command line ``argv`` (of :func:`agent_argv`) with the master at ``master_addr``.

    Raises:
        SchedulerError: ``argv`` has no ``--master-addr <addr>``.
    """
    return _replace_value(argv, _MASTER_ADDR_FLAG, master_addr)


# ----- environment -----------------------------------------------------------------------------


def job_env(job: JobSpec | str, *, job_id: str, log_dir: str, extra: Mapping[str, str] | None = None,
            sort_keys: bool = False) -> dict[str, str]:
    """The variables of the master and of every agent: ``DLROVER_JOB_SPEC``, ``DLROVER_JOB_ID``,
    ``DLROVER_LOG_DIR``, ``PYTHONUNBUFFERED=1``, then ``extra``, in this order.

    Args:
        job: the Job, or its :func:`encode_job` text.
        job_id: the run's id.
        log_dir: the run directory, as it is where the processes run.
        extra: the backend's variables (added last).
        sort_keys: passed to :func:`encode_job`.
    """
    text = job if isinstance(job, str) else encode_job(job, sort_keys=sort_keys)
    return {env.JOB_SPEC: text, env.JOB_ID: job_id, env.LOG_DIR: log_dir, "PYTHONUNBUFFERED": "1", **(extra or {})}


def agent_env(base: Mapping[str, str], *, accelerator: str, master_addr: str) -> dict[str, str]:
    """An agent's variables: ``base`` (:func:`job_env`), its accelerator's name and the master's
    ``host:port``."""
    return {**base, env.ACCELERATOR: accelerator, env.MASTER_ADDR: master_addr}


def host_cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def omp_num_threads(job: JobSpec, *, nproc: int, environ: Mapping[str, str] | None = None,
                    cores: float | None = None, nodes_sharing: int = 1) -> str | None:
    """The ``OMP_NUM_THREADS`` to set for ``job``'s workers; ``None``: set none.

    ``job.env`` setting it wins, then ``environ`` (the environment the processes inherit;
    ``None``: none is inherited, as in a pod). With ``cores`` (the cores the workers see), each
    worker gets its share: ``max(1, cores // (nodes_sharing * nproc))`` — ``nodes_sharing``
    is the number of nodes on one machine (local processes and containers: every node of the
    job; a pod: 1, and ``cores`` its CPU request). Without, an agent that starts more than one
    worker gives each ``"1"``, as torchrun does, and one worker keeps the library's default.

    Args:
        job: the Job.
        nproc: workers per node (at least 1).
        environ: the inherited environment, or ``None``.
        cores: cores the workers of ``nodes_sharing`` nodes share, or ``None``.
        nodes_sharing: nodes on the machine whose cores are ``cores``.
    """
    if OMP_NUM_THREADS in job.env or (environ is not None and OMP_NUM_THREADS in environ):
        return None
    if cores is not None:
        return str(max(1, int(cores // (nodes_sharing * nproc))))
    return "1" if nproc > 1 else None


# ----- processes -------------------------------------------------------------------------------


def master_process(*, python: str, job_id: str, host: str, port: int | str, store_host: str, log_dir: str,
                   variables: Mapping[str, str], cwd: str, log_file: str | None = None) -> ProcessSpec:
    """The master as a :class:`ProcessSpec` named ``master``: :func:`master_argv` with ``variables``
    (:func:`job_env`), its output in ``log_file`` (default ``<log_dir>/master.log``)."""
    return ProcessSpec(role="master", name="master",
                       argv=master_argv(python, job_id=job_id, host=host, port=port, store_host=store_host,
                                        log_dir=log_dir),
                       env=dict(variables), cwd=cwd, log_file=log_file or str(rundir.RunDir(log_dir).master_log))


def agent_process(*, python: str, job_id: str, node_id: int, master_addr: str, log_dir: str,
                  variables: Mapping[str, str], cwd: str, log_file: str | None = None) -> ProcessSpec:
    """Node ``node_id``'s agent as a :class:`ProcessSpec` named ``node-<id>``: :func:`agent_argv`
    with ``variables`` (:func:`agent_env`), its output in ``log_file`` (default
    ``<log_dir>/node_<id>.log``)."""
    return ProcessSpec(role="agent", name=f"node-{node_id}",
                       argv=agent_argv(python, job_id=job_id, node_id=node_id, master_addr=master_addr,
                                       log_dir=log_dir),
                       env=dict(variables), cwd=cwd, log_file=log_file or str(rundir.RunDir(log_dir).node_log(node_id)))


def node_process(agent: ProcessSpec, node_id: int) -> ProcessSpec:
    """Agent ``agent`` (of :func:`agent_process`) for node ``node_id``: its command line
    (:func:`for_node`), name ``node-<id>`` and log file ``node_<id>.log`` beside the original.

    Raises:
        SchedulerError: ``agent`` is not an agent's process.
    """
    if agent.role != "agent":
        raise SchedulerError(f"process {agent.name!r} is a {agent.role}, not an agent: no node to change")
    log_file = str(PurePath(agent.log_file).with_name(rundir.node_log(node_id)))
    return attrs.evolve(agent, name=f"node-{node_id}", argv=for_node(agent.argv, node_id), log_file=log_file)
