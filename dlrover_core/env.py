"""Names of the environment variables dlrover processes hand to each other.

Workers also get torch elastic's standard variables (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``ROLE_RANK``,
``ROLE_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``TORCHELASTIC_RESTART_COUNT``,
``TORCHELASTIC_MAX_RESTARTS``, ``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_USE_AGENT_STORE``),
so scripts written for torchrun run unchanged.
"""

from __future__ import annotations

__all__ = [
    "ACCELERATOR",
    "AGENT_TOKEN",
    "JOB_ID",
    "JOB_SPEC",
    "LOG_DIR",
    "MASTER_ADDR",
    "MASTER_ADDR_FILE",
    "NODE_ID",
    "PROGRESS_FILE",
    "ROUND",
    "REPLICA_PINS",
    "LIVE_JOIN",
    "WATCH_PID",
    "WORKER_EXEC",
    "CONSOLE_LOCAL_RANKS",
    "STANDBY_FD",
    "SHARED_STANDBY",
    "LOCAL_RANK",
    "CPU_AFFINITY",
    "GC_AT_EXIT",
]

#: The job spec as JSON (``Job.to_dict()``).
JOB_SPEC = "DLROVER_JOB_SPEC"
#: The job run's id.
JOB_ID = "DLROVER_JOB_ID"
#: The run's log directory.
LOG_DIR = "DLROVER_LOG_DIR"
#: ``host:port`` of the job master's HTTP API.
MASTER_ADDR = "DLROVER_MASTER_ADDR"
#: A file holding the job master's current ``host:port`` (the local scheduler's master
#: rewrites it when a restart had to take another port; agents and workers re-read it when
#: the master stops answering).
MASTER_ADDR_FILE = "DLROVER_MASTER_ADDR_FILE"
#: The node's id (stable across rounds; node *rank* can change).
NODE_ID = "DLROVER_NODE_ID"
#: The resolved accelerator name (never "auto").
ACCELERATOR = "DLROVER_ACCELERATOR"
#: The fencing token the master gave the node's agent (names the node's shared memory).
AGENT_TOKEN = "DLROVER_AGENT_TOKEN"
#: The rendezvous round the worker belongs to.
ROUND = "DLROVER_ROUND"
#: File the worker appends progress records to (read by its agent).
PROGRESS_FILE = "DLROVER_PROGRESS_FILE"
#: A pid to watch: the process exits when that process is gone (local scheduler).
WATCH_PID = "DLROVER_WATCH_PID"
#: ``1`` when another node keeps replicas of this node's snapshots in the worker's round:
#: every snapshot is published pinned until the agent releases it (:mod:`dlrover_core.checkpoint.memory`)
REPLICA_PINS = "DLROVER_REPLICA_PINS"
#: "1" in a worker that replaces a failed one and joins the running world with its peers' live state
LIVE_JOIN = "DLROVER_LIVE_JOIN"
#: "1" in an agent's environment: run the entrypoint as an executable, without ``python``
#: (``dlrover run --no-python``)
WORKER_EXEC = "DLROVER_WORKER_EXEC"
#: In an agent's environment: the local ranks whose output it copies to its console,
#: comma-separated (``dlrover run --local-ranks-filter``, ``--redirects``); unset: all.
#: Every rank's output is written to its ``rank_<r>.log`` either way.
CONSOLE_LOCAL_RANKS = "DLROVER_CONSOLE_LOCAL_RANKS"
#: In a standby's environment: its end of the socket the agent sends worker commands on
#: (``dlrover_core.agent.standby``)
STANDBY_FD = "DLROVER_STANDBY_FD"
#: "1" in an agent's environment where several nodes share the host (the local scheduler): the
#: nodes' standbys are forked from one warm process of the host instead of each importing
#: torch itself (``dlrover_core.agent.zygote``); "0" in the environment of the process that
#: submits a local job: a standby process per node
SHARED_STANDBY = "DLROVER_SHARED_STANDBY"
#: In a worker: its local rank on its node, whatever ``LOCAL_RANK`` says (``dlrover run
#: --virtual-local-rank`` makes ``LOCAL_RANK`` 0 for every worker, as torchrun's does)
LOCAL_RANK = "DLROVER_LOCAL_RANK"
#: In a worker's environment: the CPUs it is bound to (``"0-7,16-23"``, the form of sysfs and
#: ``numactl --physcpubind``; ``dlrover run --numa-binding``), applied with ``sched_setaffinity``
#: by the worker's launcher before the script starts (a warm standby: when it is activated)
CPU_AFFINITY = "DLROVER_CPU_AFFINITY"
#: In a worker's environment, set by the user: ``1`` keeps the garbage collector's passes over
#: every object (by default a worker freezes the objects alive when it joins its group and
#: when its script returns: ``dlrover_core.train.process_group._freeze_imports`` and
#: ``_freeze_for_exit``)
GC_AT_EXIT = "DLROVER_GC_AT_EXIT"
