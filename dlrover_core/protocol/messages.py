"""Messages between the master, the agents, the workers and the scheduler backends.

Each is a frozen attrs class; :mod:`dlrover_core.protocol.codec` turns it into JSON and back
(field names are the JSON keys on the wire). ``docs/architecture.md`` has the table of who
sends which, and when; :data:`ENDPOINTS` maps each of the master's ``/v1/*`` endpoints to
its request and answer classes.

Calls an agent makes for its node carry ``node_id`` and ``token`` (the fencing token
:class:`Registered` gave it; ``None`` before, or from a process that has none). The master
answers a call from a replaced agent with ``fenced`` true and ``action`` ``stop``, and
changes nothing (see :mod:`dlrover_core.master.server`).

Endpoints (request → answer; the sender in each class's docstring): ``assign_node``
(:class:`AssignNode` → :class:`NodeAssigned`: a host's id when ``dlrover run`` runs on each
host), ``register``
(:class:`Register` → :class:`Registered`), ``join`` (:class:`Join` → :class:`Joined`),
``poll`` (:class:`Poll` → :class:`RoundAssignment`), ``heartbeat`` (:class:`Heartbeat` →
:class:`HeartbeatAnswer`), ``failure`` (:class:`FailureReport`), ``succeeded``
(:class:`Succeeded`), ``exited`` (:class:`Exited`), ``node_check``
(:class:`NodeCheckReport`), ``cancel`` (:class:`Cancel`), ``checkpoint_error``
(:class:`CheckpointErrorReport`) — these six answered with :class:`ActionAnswer` —,
``checkpoint_shard`` (:class:`ShardReport` → :class:`ShardAnswer`), ``restore_plan``
(:class:`RestorePlanRequest` → :class:`RestoreDecision`), ``restore_verify``
(:class:`RestoreVerify` → :class:`RestoreVerifyAnswer`), ``live_reform`` (a worker's
:class:`LiveReform` → :class:`LiveAssignment`: recovery without stopping), and the GETs ``status``
(:class:`~dlrover_core.protocol.status.MasterStatus`) and ``result``
(:class:`~dlrover_core.protocol.result.JobResult`).

Also here: :class:`NodeRelaunch` (master → scheduler backend), :class:`WorkerFailure` and
:class:`WorkerException` (a worker's failure as its agent reports it; the exception a worker
records in its progress file, defined with the other progress records in
:mod:`dlrover_core.protocol.progress`), :class:`NodeCheckResult` (what the node-check process
prints for its agent).
"""

from __future__ import annotations

import enum

import attrs

from dlrover_core.protocol.progress import ProgressRecord, WorkerException
from dlrover_core.protocol.result import JobResult
from dlrover_core.protocol.status import MasterStatus

__all__ = [
    "ENDPOINTS",
    "Action",
    "ActionAnswer",
    "AssignNode",
    "Cancel",
    "CheckpointErrorReport",
    "Endpoint",
    "Exited",
    "FailureReport",
    "Heartbeat",
    "HeartbeatAnswer",
    "Join",
    "Joined",
    "LiveAssignment",
    "LiveReform",
    "NodeCheckReport",
    "NodeAssigned",
    "NodeCheckResult",
    "NodeRelaunch",
    "Poll",
    "PollState",
    "Register",
    "Registered",
    "RestoreDecision",
    "RestorePlanRequest",
    "RestoreVerify",
    "RestoreVerifyAnswer",
    "RoundAssignment",
    "ShardAnswer",
    "ShardReport",
    "Succeeded",
    "WorkerException",
    "WorkerFailure",
]


class Action(str, enum.Enum):
    """What the master tells an agent to do (the ``action`` of an answer)."""

    #: carry on
    NONE = "none"
    #: stop your workers and join the next rendezvous round
    RESTART = "restart"
    #: the job is over for you (it ended, your node was excluded, or you were replaced): stop and exit
    STOP = "stop"
    #: the failed workers are replaced while the others keep training: start only those,
    #: as joiners of the running world (recovery without stopping, docs/design.md §5a)
    REPLACE = "replace"

    def __str__(self) -> str:
        return self.value


class PollState(str, enum.Enum):
    """Where a node stands in the rendezvous (the ``state`` of a :class:`RoundAssignment`)."""

    #: the round is still forming: poll again
    WAITING = "waiting"
    #: the round formed: the assignment holds this node's place in it
    READY = "ready"
    #: the master does not know this node as waiting (it restarted, or the round's store is
    #: gone): join again
    REJOIN = "rejoin"
    #: run a node check first: the assignment holds the check group (``check_round``...)
    CHECK = "check"
    #: the job is over for this node
    STOP = "stop"

    def __str__(self) -> str:
        return self.value


# ----- master → scheduler backend ----------------------------------------------------------


@attrs.frozen(kw_only=True)
class NodeRelaunch:
    """The master asks the scheduler backend for a new agent (master → backend).

    Attributes:
        node_id: the id the new agent takes (``--node-id``).
        replaces: the node id whose agent it replaces (the same id when the node is replaced
            in place; ``None`` for a node added to scale up).
        reason: why, in words (``"node 1 lost its heartbeat"``).
        attempt: how many times this node id was launched before (0 for the first).
    """

    node_id: int
    replaces: int | None = None
    reason: str = ""
    attempt: int = 0


# ----- answers shared by several endpoints ----------------------------------------------------


@attrs.frozen(kw_only=True)
class ActionAnswer:
    """The master's answer to a report (``failure``, ``succeeded``, ``exited``,
    ``node_check``, ``cancel``, ``checkpoint_error``).

    Attributes:
        action: what the agent is to do now.
        fenced: the call came from a replaced agent: it changed nothing; stop and exit
            without touching the node's workers, memory or files.
    """

    action: Action = Action.NONE
    fenced: bool = False


# ----- register, join, poll ---------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class AssignNode:
    """A host's launcher asks which node it is (``dlrover run`` on each host without
    ``--node-rank``; agent or launcher → master, ``/v1/assign_node``). Idempotent: the same
    ``key`` always gets the same node id, so a retried call, an agent restarted by its host's
    launcher and the launcher's own reports all name one node.

    Attributes:
        key: what identifies the host's launcher for the job's life (``host:pid``).
        rdzv_id: the job id the launcher was started with (``--rdzv-id``); ``""``: any.
    """

    key: str
    rdzv_id: str = ""


@attrs.frozen(kw_only=True)
class NodeAssigned:
    """The answer to :class:`AssignNode`.

    Attributes:
        node_id: the node's id (ids given with ``--node-rank`` are never handed out); -1 with
            ``action`` none: no place yet (the job has ``nodes.max`` nodes), ask again.
        job_id: the job's id (the run id every host's agent and workers use).
        action: ``stop`` when the job is over (then ``node_id`` is -1).
        reason: why ``stop`` (the job ended, or ``rdzv_id`` names another job), or why no place yet.
    """

    node_id: int
    job_id: str
    action: Action = Action.NONE
    reason: str = ""


@attrs.frozen(kw_only=True)
class Register:
    """An agent starts for a node (agent → master, ``/v1/register``).

    Attributes:
        node_id: the node's stable id (``--node-id``).
        host: the agent's host name.
        pid: the agent's process id on that host.
        token: unused (an agent has no token before it registers); accepted for symmetry.
        replica_addr: ``host:port`` of the agent's replica server (its node's snapshots and
            the replicas it holds: ``dlrover_core.agent.replicas``); empty without replicas.
    """

    node_id: int
    host: str = ""
    pid: int = 0
    token: int | None = None
    replica_addr: str = ""


@attrs.frozen(kw_only=True)
class Registered:
    """The answer to :class:`Register`.

    Attributes:
        action: ``stop`` when the job is over or the node was excluded, else ``none``.
        job_id: the run's id.
        token: the agent's fencing token (> 0): every later call of the agent carries it,
            and its workers' shared-memory segments are named with it. A newer agent of the
            same node gets a greater one, and from then on this agent is fenced.
    """

    action: Action = Action.NONE
    job_id: str = ""
    token: int = 0


@attrs.frozen(kw_only=True)
class Join:
    """A node joins the next rendezvous round (agent → master, ``/v1/join``).

    Attributes:
        node_id: the node.
        nproc: workers the node runs (its ranks in the round).
        token: the agent's fencing token.
    """

    node_id: int
    nproc: int
    token: int | None = None


@attrs.frozen(kw_only=True)
class Joined:
    """The answer to :class:`Join`.

    Attributes:
        action: ``stop`` when the job is over for this node, else ``none``.
        round: the index of the round the node waits for (``None`` with ``stop``).
        fenced: the agent was replaced (see :class:`ActionAnswer`).
    """

    action: Action = Action.NONE
    round: int | None = None
    fenced: bool = False


@attrs.frozen(kw_only=True)
class Poll:
    """Has the round the node waits for formed? (agent → master, ``/v1/poll``; the master
    may hold the answer while the round forms.)

    Attributes:
        node_id: the node.
        token: the agent's fencing token.
    """

    node_id: int
    token: int | None = None


@attrs.frozen(kw_only=True)
class RoundAssignment:
    """The answer to :class:`Poll`: the round an agent and its workers start from.

    With ``state`` ``ready`` the round fields say where the node's workers stand (they
    become the workers' ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``...); with
    ``check`` the check fields say which node-check group to run in; otherwise only
    ``state`` and ``action`` mean anything.

    Attributes:
        state: waiting, ready, rejoin, check or stop.
        action: ``stop`` with state ``stop``, else ``none``.
        fenced: the agent was replaced (see :class:`ActionAnswer`).
        round: the round's index.
        node_rank: the node's rank among the round's nodes (by node id).
        num_nodes: nodes in the round.
        rank_offset: global rank of the node's first worker.
        nproc: workers of this node.
        world_size: workers in the round.
        store_host: host of the round's TCPStore (fresh for every round).
        store_port: its TCP port (for ``check``: the check round's store).
        restart_count: restarts taken from the job-wide budget so far.
        max_restarts: the budget (``Failure.max_restarts``).
        check_round: the node check's round (0 or 1).
        group: node ids of the check group, in rank order.
        group_rank: this node's rank in the group.
        group_size: nodes in the group.
        prefix: the group's key prefix in the check store.
        timeout_s: seconds the check may take.
        live_join: the node joins a round that keeps running without it (its workers start
            as replacements: they get their ranks and their peers' live state in
            ``train.steps()``; the rank fields are their slots' at the round's start).
        replica_source: the node whose snapshots this node keeps replicas of (its buddy
            source; -1: none), at ``replica_source_addr``, for its ranks ``replica_source_ranks``.
        replica_holders: where this node's ranks' newest replicas are, as ``(rank, node whose
            rank it was, holder's replica address)``: a node that lost its memory fetches them
            before its workers start.
    """

    state: PollState
    action: Action = Action.NONE
    fenced: bool = False
    round: int = -1
    node_rank: int = 0
    num_nodes: int = 0
    rank_offset: int = 0
    nproc: int = 0
    world_size: int = 0
    store_host: str = ""
    store_port: int = 0
    restart_count: int = 0
    max_restarts: int = 0
    check_round: int = 0
    group: tuple[int, ...] = ()
    group_rank: int = 0
    group_size: int = 0
    prefix: str = ""
    timeout_s: float = 0.0
    live_join: bool = False
    replica_source: int = -1
    replica_source_addr: str = ""
    replica_source_ranks: tuple[int, ...] = ()
    replica_holders: tuple[tuple[int, int, str], ...] = ()


# ----- heartbeats and reports -------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Heartbeat:
    """An agent's periodic report (agent → master, ``/v1/heartbeat``).

    Attributes:
        node_id: the node.
        round: the round whose workers run (-1 between rounds).
        workers: pid of every live worker, by global rank.
        steps: newest step each local rank reported, by global rank (only ranks that did).
        records: rank 0's new progress records, in order (``train.report`` steps,
            checkpoint saves and restores, live re-forms...:
            :mod:`dlrover_core.protocol.progress`; on the wire the JSON objects of the
            progress files, tagged by ``type``; a type the master does not know is dropped).
        saves: steps each rank saved for storage since the last heartbeat, by global rank.
        pid: the agent's process id (fences an agent without a token).
        token: the agent's fencing token.
        replicas: the newest whole replica this node holds of each rank it keeps replicas
            of, as ``(node, rank, step, round)`` (``round``: the lineage of the snapshot).
    """

    node_id: int
    round: int = -1
    workers: dict[int, int] = attrs.field(factory=dict)
    steps: dict[int, int] = attrs.field(factory=dict)
    records: tuple[ProgressRecord, ...] = ()
    saves: dict[int, tuple[int, ...]] = attrs.field(factory=dict)
    pid: int | None = None
    token: int | None = None
    replicas: tuple[tuple[int, int, int, int], ...] = ()


@attrs.frozen(kw_only=True)
class HeartbeatAnswer:
    """The answer to :class:`Heartbeat`.

    Attributes:
        action: ``restart`` when the node's round is over (another node failed, the
            membership changed), ``stop`` when the job is over for it, else ``none``.
        fenced: the agent was replaced (see :class:`ActionAnswer`).
        replica_source, replica_source_addr, replica_source_ranks: as in
            :class:`RoundAssignment`, now: a source node relaunched within the round (a live
            recovery) serves its snapshots at a new address.
    """

    action: Action = Action.NONE
    fenced: bool = False
    replica_source: int = -1
    replica_source_addr: str = ""
    replica_source_ranks: tuple[int, ...] = ()


@attrs.frozen(kw_only=True)
class WorkerFailure:
    """One failed worker, or a failed node (``rank`` ``None``), as reported to the master.

    Attributes:
        rank: global rank (``None``: the node itself failed, e.g. lost or evicted).
        local_rank: rank on its node.
        exit_code: process exit code; negative: killed by that signal (``None``: still
            running, e.g. hung, or unknown).
        kind: ``"exit"``, ``"signal"``, ``"exception"``, ``"hang"``, ``"node_lost"``, or a
            scheduler's (``"evicted"``, ``"oom_killed"``...); ``""``: derive from the exit code.
        detail: the failure in words, when the kind needs them (a hang's timeout and stack
            file, a lost node's silence, an eviction's reason).
        exception: the exception the worker recorded, if any.
        silent_s: seconds without progress before the failure was seen (a hang's detection time).
        replaceable: the failed worker alone can be replaced while the others go on (its
            process is gone, or it is the stopped process the others wait on); ``False``
            for a hang whose cause its agent cannot tell (every worker waits on someone).
        unix_time_s: when it failed (seconds since the epoch): its exception's time, else
            when its agent saw it exit (torchrun's ``ProcessFailure.timestamp``); ``None``:
            unknown (the master then takes the time of the report). The first failure of a
            round by this time is its root cause.
        error_file: the worker's ``TORCHELASTIC_ERROR_FILE``, when it wrote one (torch's
            ``@record``); ``""``: none.
    """

    rank: int | None = None
    local_rank: int | None = None
    exit_code: int | None = None
    kind: str = ""
    detail: str = ""
    exception: WorkerException | None = None
    silent_s: float = 0.0
    replaceable: bool = True
    unix_time_s: float | None = None
    error_file: str = ""

    @classmethod
    def exited(cls, *, rank: int | None, local_rank: int | None, exit_code: int | None,
               exception: WorkerException | None = None, seen_at: float | None = None,
               error_file: str = "") -> WorkerFailure:
        """A worker that exited (or died of a signal), with the exception it recorded, if any.
        ``seen_at``: when its agent saw it exit (unix seconds), for a failure whose exception
        does not say when it was raised."""
        kind = "exception" if exception is not None else (
            "signal" if exit_code is not None and exit_code < 0 else "exit")
        when = exception.unix_time_s if exception is not None and exception.unix_time_s is not None else seen_at
        return cls(rank=rank, local_rank=local_rank, exit_code=exit_code, kind=kind, exception=exception,
                   unix_time_s=when, error_file=error_file)


@attrs.frozen(kw_only=True)
class FailureReport:
    """Workers of a node failed, or the node did (agent or scheduler backend → master,
    ``/v1/failure``).

    Attributes:
        node_id: the node.
        round: the round they failed in.
        failures: one per failed worker (or one with ``rank`` ``None`` for the node).
        token: the agent's fencing token (``None`` from a scheduler backend).
    """

    node_id: int
    round: int
    failures: tuple[WorkerFailure, ...] = ()
    token: int | None = None


@attrs.frozen(kw_only=True)
class Succeeded:
    """Every worker of the node exited 0 (agent → master, ``/v1/succeeded``).

    Attributes:
        node_id: the node.
        round: the round they ran in.
        token: the agent's fencing token.
    """

    node_id: int
    round: int
    token: int | None = None


@attrs.frozen(kw_only=True)
class Exited:
    """The agent exits (agent → master, ``/v1/exited``): the job ended for it, or it was
    stopped (scaled down, preempted).

    Attributes:
        node_id: the node.
        token: the agent's fencing token.
    """

    node_id: int
    token: int | None = None


@attrs.frozen(kw_only=True)
class NodeCheckResult:
    """One node's result of a node-check round (the node-check process → its agent, one JSON
    line on stdout; then inside a :class:`NodeCheckReport`).

    Attributes:
        ok: the check passed (the matmul and, in a group, the all-reduce).
        local_ok: the node's own part (the matmul) passed, whatever its partners did
            (``None``: unknown, e.g. the check timed out).
        elapsed_s: seconds the check took (``None`` when unknown).
        matmul_tflops: measured matmul throughput (TFLOP/s).
        allreduce_gbps: measured all-reduce bandwidth (GB/s).
        error: why it failed ("" when ok).
    """

    ok: bool
    local_ok: bool | None = None
    elapsed_s: float | None = None
    matmul_tflops: float | None = None
    allreduce_gbps: float | None = None
    error: str = ""


@attrs.frozen(kw_only=True)
class NodeCheckReport:
    """A node's result of a node-check round (agent → master, ``/v1/node_check``).

    Attributes:
        node_id: the node.
        check_round: the check round it ran (:attr:`RoundAssignment.check_round`).
        result: what the check found.
        token: the agent's fencing token.
    """

    node_id: int
    check_round: int
    result: NodeCheckResult
    token: int | None = None


@attrs.frozen(kw_only=True)
class Cancel:
    """Cancel the job (runner or scheduler backend → master, ``/v1/cancel``).

    Attributes:
        reason: why, in words (the job's reason; ``""`` counts as "cancelled by the user").
    """

    reason: str = "cancelled by the user"


# ----- checkpoints ------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ShardReport:
    """A rank's shard of a checkpoint step is durable in storage (the agent's saver, or a
    worker saving without memory → master, ``/v1/checkpoint_shard``).

    Attributes:
        node_id: the node that wrote it.
        rank: the rank whose shard it is.
        step: the checkpoint step.
        world_size: ranks that save the step (the round's world size).
        round: the incarnation (rendezvous round) that took the snapshot.
        file: the shard's file name in the step's directory.
        crc32: CRC32 of the shard's data (``None``: not computed).
        bytes: size of the shard's data (bytes).
        persist_s: seconds the write took.
        token: the writing agent's fencing token.
        due: the rank saved the step for storage (a persist it asked for, or a forced
            save); ``False``: written only at a breakpoint, after a failure, on this node's
            own schedule (other nodes may not write the same step).
    """

    node_id: int
    rank: int
    step: int
    world_size: int
    round: int = 0
    file: str = ""
    crc32: int | None = None
    bytes: int = 0
    persist_s: float = 0.0
    token: int | None = None
    due: bool = True


@attrs.frozen(kw_only=True)
class ShardAnswer:
    """The answer to :class:`ShardReport`.

    Attributes:
        committed: the newest committed step (``None``: none yet).
        stale: the shard belongs to an abandoned lineage (or a replaced agent): not recorded.
        reason: why it is stale.
        fenced: the writing agent was replaced (see :class:`ActionAnswer`).
    """

    committed: int | None = None
    stale: bool = False
    reason: str = ""
    fenced: bool = False


@attrs.frozen(kw_only=True)
class CheckpointErrorReport:
    """Persisting a shard failed (the agent's saver or the agent → master,
    ``/v1/checkpoint_error``).

    Attributes:
        node_id: the node.
        rank: the rank whose shard failed (``None``: the node's final flush as a whole).
        step: the step (``None``: unknown).
        round: the incarnation that took the snapshot, when known.
        error: what failed, in words (names the storage, the step and the error when fatal).
        storage: the storage's URL.
        fatal: the job must fail (a write stuck past ``checkpoint.persist_timeout_s``, or a
            final checkpoint that is not durable); otherwise it is recorded and training goes on.
        token: the agent's fencing token.
    """

    node_id: int
    rank: int | None = None
    step: int | None = None
    round: int | None = None
    error: str = ""
    storage: str = ""
    fatal: bool = False
    token: int | None = None


@attrs.frozen(kw_only=True)
class RestorePlanRequest:
    """What a rank holds in memory, to agree on a restore (worker → master,
    ``/v1/restore_plan``; a long poll: the master holds a ``waiting`` answer until the last
    rank reported or :data:`~dlrover_core.protocol.client.POLL_HOLD_MAX_S` passed, and the
    rank asks again while the answer is ``waiting``).

    Attributes:
        round: the rank's round.
        rank: the rank.
        world_size: ranks in the round.
        memory: complete snapshots the rank holds, as ``(step, round that took it)``.
        memory_steps: the same steps without rounds (from older workers; they count as round 0
            when ``memory`` is empty).
    """

    round: int
    rank: int
    world_size: int
    memory: tuple[tuple[int, int], ...] = ()
    memory_steps: tuple[int, ...] = ()


@attrs.frozen(kw_only=True)
class RestoreDecision:
    """The answer to :class:`RestorePlanRequest`: where every rank restores from.

    Attributes:
        state: ``"waiting"`` (not every rank reported), ``"ready"`` or ``"failed"``.
        source: with ``ready``: ``"memory"``, ``"storage"`` or ``"fresh"``.
        step: the step to restore (``None``: a fresh start).
        snapshot_round: with ``memory``: the round that took the snapshot to load.
        reason: with ``failed``: why no restore is possible (every committed step is damaged).
    """

    state: str
    source: str | None = None
    step: int | None = None
    snapshot_round: int | None = None
    reason: str = ""


@attrs.frozen(kw_only=True)
class RestoreVerify:
    """A rank checked its shard of the storage step it is about to load (worker → master,
    ``/v1/restore_verify``; a long poll like :class:`RestorePlanRequest`).

    Attributes:
        round: the rank's round.
        rank: the rank.
        world_size: ranks in the round.
        step: the step it checked.
        ok: the shard's header and CRC32 are intact.
        error: what is wrong with it ("" when ok).
    """

    round: int
    rank: int
    world_size: int
    step: int
    ok: bool
    error: str = ""


@attrs.frozen(kw_only=True)
class RestoreVerifyAnswer:
    """The answer to :class:`RestoreVerify`.

    Attributes:
        state: ``"waiting"`` (ask again), ``"ok"`` (every rank's shard is intact: load it),
            ``"retry"`` (a shard of ``step`` was damaged: check ``step``, an older one,
            next) or ``"failed"`` (no intact committed step is left).
        step: with ``ok`` and ``retry``: the step.
        reason: with ``retry`` and ``failed``: why.
    """

    state: str
    step: int | None = None
    reason: str = ""


# ----- recovery without stopping (worker <-> master) -----------------------------------------------


@attrs.frozen(kw_only=True)
class LiveReform:
    """A worker asks for its place in the next generation of the live world (worker →
    master, ``/v1/live_reform``; asked again until the answer is ``ready``).

    A *generation* is one process group of the running round: generation 0 is the round's
    own; each failure or rejoin makes the next, of the workers still alive (docs/design.md §5a).

    Attributes:
        node_id: the worker's node.
        local_rank: its rank on the node (``(node_id, local_rank)`` names a worker slot).
        pid: its process id (a replacement in the same slot has another).
        round: the rendezvous round it runs in.
        generation: the generation it ran in last (``-1``: a replacement that has none yet).
        step: the last step whose optimizer update it applied (``-1``: none).
        reason: ``"ready"`` (it trains inside ``train.steps()`` and can be re-formed: no
            wait, the answer says ``ready`` at once), ``"error"`` (a collective failed),
            ``"grow"`` (the generation ends at this step boundary for a joiner), ``"join"``
            (a replacement waits to join), ``"caught_up"`` (a replacement received the live
            state: it can give it on) or ``"done"`` (it finished the last step).
        error: with ``error``: the collective's error message; with ``ready``: why this
            worker cannot be re-formed (its backend: every failure restarts every worker).
        replica: it holds the training state (``False``: a replacement that has not caught
            up yet; a generation forms only with a replica in it).
        memory_steps: the steps of this rank's complete snapshots in its node's shared
            memory (a sharded job's world agrees on the newest step every rank can resume
            from: its applied step, or one of these).
    """

    node_id: int
    local_rank: int
    pid: int
    round: int
    generation: int
    step: int = -1
    reason: str = "error"
    error: str = ""
    replica: bool = True
    memory_steps: tuple[int, ...] = ()


@attrs.frozen(kw_only=True)
class LiveAssignment:
    """The answer to :class:`LiveReform`.

    Attributes:
        state: ``"waiting"`` (ask again), ``"ready"`` (the generation formed: join its
            process group), ``"restart"`` (the live world cannot go on: exit, the agent
            restarts every worker from a checkpoint), ``"finished"`` (the members finished
            training: a replacement has nothing left to join) or ``"stop"`` (the job ended).
        generation: the new generation.
        rank, world_size: the worker's place in it.
        store_host, store_port: the round's TCPStore; the generation's keys are under ``prefix``.
        prefix: the generation's store prefix (``"live/<generation>/"``).
        grow_key: the key (under no prefix) that the master sets when a replacement waits
            to join this generation: the workers end it at the next step boundary.
        reason: why (``restart``, ``stop``).
        resume_step: in a sharded job's world (which keeps its size: a replacement takes
            the dead rank's place and shard), the step every member resumes after: a member
            whose applied step is newer goes back to it from its own memory snapshot, a
            replacement loads it from its node's (``None``: a replicated world, which
            catches up by broadcast).
    """

    state: str
    generation: int = 0
    rank: int = 0
    world_size: int = 0
    store_host: str = ""
    store_port: int = 0
    prefix: str = ""
    grow_key: str = ""
    reason: str = ""
    resume_step: int | None = None


# ----- the endpoint table -------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Endpoint:
    """One of the master's ``/v1/<name>`` endpoints.

    Attributes:
        name: the path's last part.
        request: the class of the POSTed body (``None``: a GET without one).
        answer: the class of the answer.
        fenced: calls carry ``node_id`` and ``token``, and a replaced agent's are answered
            with ``fenced`` and change nothing.
        held: a long poll: the master may hold a ``waiting`` answer for up to
            :data:`~dlrover_core.protocol.client.POLL_HOLD_MAX_S` (until what the caller
            waits for happens), so the client's timeout for it is that much longer.
    """

    name: str
    request: type | None
    answer: type
    fenced: bool = False
    held: bool = False


#: Every endpoint of the master, by name.
ENDPOINTS: dict[str, Endpoint] = {e.name: e for e in (
    Endpoint(name="assign_node", request=AssignNode, answer=NodeAssigned),
    Endpoint(name="register", request=Register, answer=Registered),
    Endpoint(name="join", request=Join, answer=Joined, fenced=True),
    Endpoint(name="poll", request=Poll, answer=RoundAssignment, fenced=True, held=True),
    Endpoint(name="heartbeat", request=Heartbeat, answer=HeartbeatAnswer, fenced=True),
    Endpoint(name="failure", request=FailureReport, answer=ActionAnswer, fenced=True),
    Endpoint(name="succeeded", request=Succeeded, answer=ActionAnswer, fenced=True),
    Endpoint(name="exited", request=Exited, answer=ActionAnswer, fenced=True),
    Endpoint(name="node_check", request=NodeCheckReport, answer=ActionAnswer, fenced=True),
    Endpoint(name="cancel", request=Cancel, answer=ActionAnswer),
    Endpoint(name="checkpoint_shard", request=ShardReport, answer=ShardAnswer, fenced=True),
    Endpoint(name="checkpoint_error", request=CheckpointErrorReport, answer=ActionAnswer, fenced=True),
    Endpoint(name="restore_plan", request=RestorePlanRequest, answer=RestoreDecision, held=True),
    Endpoint(name="restore_verify", request=RestoreVerify, answer=RestoreVerifyAnswer, held=True),
    Endpoint(name="live_reform", request=LiveReform, answer=LiveAssignment),
    Endpoint(name="status", request=None, answer=MasterStatus),
    Endpoint(name="result", request=None, answer=JobResult),
)}
