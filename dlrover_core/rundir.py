"""The files of a run directory, named once.

A run directory is ``<Job.log_dir>/<job_id>``; every process of a job writes into it (the
backend that submits, the master, each agent, each worker) and every reader (``dlrover
status|logs|plot``, the runner, a backend after a restart) finds things there by these names.
Nothing else in the core or a plugin spells a file name of a run directory. ::

    <run dir>/
      plan.txt              the dry-run plan (``SchedulerBackend.submit``)
      request.json          the typed request as submitted (``SchedulerBackend.submit``)
      job.json              what ``dlrover status|logs|cancel`` look for (the runner, ``dlrover run``)
      handle.json           pids and the master address (local, ``dlrover run``)
      master_addr           the master's current host:port (the master, ``DLROVER_MASTER_ADDR_FILE``)
      master.log            the master's output
      master_journal.json   the master's snapshot; master_journal.log, one line per node change after it
      events.jsonl          the job's events (the master)
      goodput.json          the goodput breakdown (the master, at the end)
      result.json           the JobResult (the master, at the end)
      node_<id>.log         an agent's output (``.<attempt>`` appended for a container's later attempts)
      node_<id>/
        rank_<r>.log                                each worker's output
        stacks_round<R>_rank<r>.txt                 a hung worker's stacks
        round_<R>/progress_rank<r>[_r<n>].jsonl     a worker's progress records (``_r<n>``: its n-th replacement)
        round_<R>/error_rank<r>[_r<n>].json         a worker's uncaught exception
      # the built-in backends' and plugins' own files
      containers.json, docker.json                  (docker)
      k8s.json, manifests.yaml, cancelled.json, pods/<pod>.log   (k8s)
      job.sbatch, slurm.out, slurm/{submit.json, nodes.json, master_addr, relaunch_node_<id>.log}  (slurm)

Names are module constants (a file name) and functions (a name with a number in it);
:class:`RunDir` joins them to a directory. Standard library only: every layer may import it,
and plugins reach it as ``dlrover_core.backend.rundir``.
"""

from __future__ import annotations

import re
from pathlib import Path

import attrs

__all__ = [
    "CONTAINERS",
    "DOCKER_STATE",
    "EVENTS",
    "GOODPUT",
    "HANDLE",
    "JOB",
    "JOURNAL",
    "JOURNAL_LOG",
    "K8S_CANCELLED",
    "K8S_MANIFESTS",
    "K8S_POD_LOGS",
    "K8S_STATE",
    "MASTER_ADDR",
    "MASTER_LOG",
    "MASTER_LOG_GLOB",
    "NODE_LOG_GLOB",
    "PLAN",
    "REQUEST",
    "RESULT",
    "SLURM_DIR",
    "SLURM_MASTER_ADDR",
    "SLURM_NODES",
    "SLURM_OUT",
    "SLURM_SCRIPT",
    "SLURM_SUBMIT",
    "STANDBY_LOG",
    "SHARED_STANDBY_LOG",
    "RunDir",
    "error_file",
    "node_dir",
    "node_log",
    "node_of_dir",
    "node_of_log",
    "progress_file",
    "progress_glob",
    "rank_log",
    "round_dir",
    "round_of_dir",
    "slurm_relaunch_log",
    "stack_file",
]

# ----- the job's files (every backend) ----------------------------------------------------------

#: The dry-run plan as text, written by ``SchedulerBackend.submit``.
PLAN = "plan.txt"
#: The typed request as submitted (``Plan.request`` encoded), written by ``SchedulerBackend.submit``.
REQUEST = "request.json"
#: What ``dlrover status|logs|cancel`` look for in a run directory (the runner, ``dlrover run``).
JOB = "job.json"
#: Pids and the master address (the local backend, ``dlrover run``).
HANDLE = "handle.json"
#: The master's current ``host:port``, written by the master once it listens.
MASTER_ADDR = "master_addr"
#: The master's output.
MASTER_LOG = "master.log"
#: ``master.log`` and the copies a container backend saves of earlier attempts.
MASTER_LOG_GLOB = "master.log*"
#: The master's snapshot (``master/journal.py``).
JOURNAL = "master_journal.json"
#: One JSON line per change of one node after the snapshot (``master/journal.py``).
JOURNAL_LOG = "master_journal.log"
#: The job's events, one JSON object a line (the master).
EVENTS = "events.jsonl"
#: The goodput breakdown (the master, at the end).
GOODPUT = "goodput.json"
#: The :class:`~dlrover_core.protocol.JobResult` (the master, at the end).
RESULT = "result.json"
#: Every agent's output file (``node_<id>.log``; a container backend adds ``.<attempt>``).
NODE_LOG_GLOB = "node_*.log"

# ----- the backends' own files ------------------------------------------------------------------

#: docker: the job's containers by name.
CONTAINERS = "containers.json"
#: docker: the network, image and volumes of the job.
DOCKER_STATE = "docker.json"
#: k8s: the namespace, names and master address of the job.
K8S_STATE = "k8s.json"
#: k8s: the manifests as applied.
K8S_MANIFESTS = "manifests.yaml"
#: k8s: the result written when the job was cancelled.
K8S_CANCELLED = "cancelled.json"
#: k8s: the directory of the pods' saved output (``<pod>.log``).
K8S_POD_LOGS = "pods"
#: slurm: the sbatch script.
SLURM_SCRIPT = "job.sbatch"
#: slurm: the batch step's output.
SLURM_OUT = "slurm.out"
#: slurm: the directory of the backend's state.
SLURM_DIR = "slurm"
#: slurm: the submission (job id, argv, env), under :data:`SLURM_DIR`.
SLURM_SUBMIT = f"{SLURM_DIR}/submit.json"
#: slurm: node id → host, under :data:`SLURM_DIR`.
SLURM_NODES = f"{SLURM_DIR}/nodes.json"
#: slurm: the master's ``host:port`` as the batch script wrote it, under :data:`SLURM_DIR`.
SLURM_MASTER_ADDR = f"{SLURM_DIR}/master_addr"


def slurm_relaunch_log(node_id: int | str) -> str:
    """slurm: ``slurm/relaunch_node_<id>.log``, the output of the ``srun`` that relaunched a node."""
    return f"{SLURM_DIR}/relaunch_node_{node_id}.log"


# ----- a node's files ---------------------------------------------------------------------------


def node_log(node_id: int | str, attempt: int | str | None = None) -> str:
    """``node_<id>.log``: an agent's output; with a later ``attempt`` (a container's n-th
    start, n > 0) ``node_<id>.log.<attempt>``."""
    return f"node_{node_id}.log" + (f".{attempt}" if attempt not in (None, 0, "0", "") else "")


def node_dir(node_id: int | str) -> str:
    """``node_<id>``: a node's directory (its workers' logs, stacks and rounds)."""
    return f"node_{node_id}"


#: A node's warm standby's own output (its warm-up's warnings and errors), inside its node's directory.
STANDBY_LOG = "standby.log"
#: The output of the standby the nodes of one host share (``DLROVER_SHARED_STANDBY``: the
#: process that forks each node's standby), in the run's directory.
SHARED_STANDBY_LOG = "shared_standby.log"


def round_dir(round_index: int | str) -> str:
    """``round_<R>``: a rendezvous round's directory inside a node's."""
    return f"round_{round_index}"


def rank_log(rank: int | str) -> str:
    """``rank_<r>.log``: a worker's output, inside its node's directory."""
    return f"rank_{rank}.log"


def stack_file(round_index: int, rank: int) -> str:
    """``stacks_round<R>_rank<r>.txt``: a hung worker's stacks, inside its node's directory."""
    return f"stacks_round{round_index}_rank{rank}.txt"


def progress_file(rank: int | str, replacement: int = 0) -> str:
    """``progress_rank<r>.jsonl`` (``progress_rank<r>_r<n>.jsonl`` for the n-th replacement,
    n > 0): a worker's progress records, inside its round's directory."""
    return f"progress_rank{rank}" + (f"_r{replacement}" if replacement else "") + ".jsonl"


def error_file(rank: int | str, replacement: int = 0) -> str:
    """``error_rank<r>.json`` (``error_rank<r>_r<n>.json`` for the n-th replacement, n > 0):
    a worker's uncaught exception, inside its round's directory."""
    return f"error_rank{rank}" + (f"_r{replacement}" if replacement else "") + ".json"


def progress_glob(node_id: int | None = None, round_index: int | None = None) -> str:
    """The glob, relative to the run directory, of the progress files of one node and round
    (``None``: every one)."""
    node = "*" if node_id is None else node_id
    rnd = "*" if round_index is None else round_index
    return f"{node_dir(node)}/{round_dir(rnd)}/progress_*.jsonl"


_NODE_DIR = re.compile(r"node_(\d+)")
_ROUND_DIR = re.compile(r"round_(\d+)")
_NODE_LOG = re.compile(r"node_(\d+)\.log(?:\.(\d+))?")


def node_of_dir(name: str) -> int | None:
    """The node id of a directory named ``node_<id>``; ``None`` for any other name."""
    m = _NODE_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def round_of_dir(name: str) -> int | None:
    """The round of a directory named ``round_<R>``; ``None`` for any other name."""
    m = _ROUND_DIR.fullmatch(name)
    return int(m.group(1)) if m else None


def node_of_log(name: str) -> int | None:
    """The node id of a file named ``node_<id>.log[.<attempt>]``; ``None`` for any other name."""
    m = _NODE_LOG.fullmatch(name)
    return int(m.group(1)) if m else None


@attrs.frozen
class RunDir:
    """A run directory: the paths of its files.

    Attributes:
        path: the directory, ``<Job.log_dir>/<job_id>``.
    """

    path: Path = attrs.field(converter=Path)

    def __truediv__(self, name: str) -> Path:
        return self.path / name

    @property
    def plan(self) -> Path:
        """``plan.txt``."""
        return self.path / PLAN

    @property
    def request(self) -> Path:
        """``request.json``."""
        return self.path / REQUEST

    @property
    def job(self) -> Path:
        """``job.json``."""
        return self.path / JOB

    @property
    def handle(self) -> Path:
        """``handle.json``."""
        return self.path / HANDLE

    @property
    def master_addr(self) -> Path:
        """``master_addr``."""
        return self.path / MASTER_ADDR

    @property
    def master_log(self) -> Path:
        """``master.log``."""
        return self.path / MASTER_LOG

    @property
    def journal(self) -> Path:
        """``master_journal.json``."""
        return self.path / JOURNAL

    @property
    def journal_log(self) -> Path:
        """``master_journal.log``."""
        return self.path / JOURNAL_LOG

    @property
    def events(self) -> Path:
        """``events.jsonl``."""
        return self.path / EVENTS

    @property
    def goodput(self) -> Path:
        """``goodput.json``."""
        return self.path / GOODPUT

    @property
    def result(self) -> Path:
        """``result.json``."""
        return self.path / RESULT

    def node_log(self, node_id: int | str, attempt: int | str | None = None) -> Path:
        """``node_<id>.log[.<attempt>]``: see :func:`node_log`."""
        return self.path / node_log(node_id, attempt)

    def node_dir(self, node_id: int | str) -> Path:
        """``node_<id>/``."""
        return self.path / node_dir(node_id)

    def round_dir(self, node_id: int | str, round_index: int | str) -> Path:
        """``node_<id>/round_<R>/``."""
        return self.node_dir(node_id) / round_dir(round_index)

    def rank_log(self, node_id: int | str, rank: int | str) -> Path:
        """``node_<id>/rank_<r>.log``."""
        return self.node_dir(node_id) / rank_log(rank)

    def stack_file(self, node_id: int | str, round_index: int, rank: int) -> Path:
        """``node_<id>/stacks_round<R>_rank<r>.txt``."""
        return self.node_dir(node_id) / stack_file(round_index, rank)

    def progress_file(self, node_id: int | str, round_index: int | str, rank: int | str,
                      replacement: int = 0) -> Path:
        """``node_<id>/round_<R>/progress_rank<r>[_r<n>].jsonl``."""
        return self.round_dir(node_id, round_index) / progress_file(rank, replacement)

    def error_file(self, node_id: int | str, round_index: int | str, rank: int | str,
                   replacement: int = 0) -> Path:
        """``node_<id>/round_<R>/error_rank<r>[_r<n>].json``."""
        return self.round_dir(node_id, round_index) / error_file(rank, replacement)

    def progress_files(self, node_id: int | None = None, round_index: int | None = None) -> list[Path]:
        """The progress files present of one node and round (``None``: every one), sorted."""
        return sorted(self.path.glob(progress_glob(node_id, round_index)))
