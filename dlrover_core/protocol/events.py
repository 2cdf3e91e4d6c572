"""Job events: what happened, when, as plain JSON-safe data (observers and ``events.jsonl``).

:class:`EventKind` lists every kind the job master emits, with its data fields; it is
str-valued, so ``events.jsonl`` holds the same strings and a reader compares either. A
newer master may add kinds: readers (``dlrover plot``, observers) skip kinds they do not
know. ``tests/test_events.py`` checks that every kind emitted in ``dlrover_core`` is
declared here and every one declared is emitted.
"""

from __future__ import annotations

import enum
from typing import Any

import attrs

__all__ = ["EventKind", "JobEvent"]


class EventKind(str, enum.Enum):
    """What a :class:`JobEvent` says happened, and its ``data`` fields (besides ``kind``,
    ``job_id``, ``time_s`` and ``unix_time_s``, which every event has)."""

    # ----- rounds and membership
    #: a rendezvous round formed: ``round``, ``node_ids``, ``world_size``, ``store_port``
    RENDEZVOUS_COMPLETED = "rendezvous_completed"
    #: every node restarts into the next round, not counted as a failure (the job grows, a
    #: node left, a round unknown to the master): ``round``, ``reason``, and ``from_nodes``,
    #: ``to_nodes`` (``waiting`` when it grows) when the node count changes
    MEMBERSHIP_CHANGED = "membership_changed"
    #: a node joins the running round's live world (it replaces a lost one): ``node_id``,
    #: ``round``, ``nproc``
    LIVE_NODE_JOINING = "live_node_joining"
    #: the nodes of a forming round check their accelerators in pairs: ``nodes``, ``groups``
    NODE_CHECK_STARTED = "node_check_started"
    #: the node check ended: ``faulty``, ``stragglers`` (node ids), ``best_s`` (node id -> seconds)
    NODE_CHECK_FINISHED = "node_check_finished"

    # ----- failures and recovery
    #: one failed worker (or node): the :class:`~dlrover_core.protocol.result.FailureRecord`'s
    #: fields, its ``kind`` as ``failure_kind``
    WORKER_FAILED = "worker_failed"
    #: every worker restarts into the next round: ``round``, ``restarts``
    WORKERS_RESTARTED = "workers_restarted"
    #: the round's failure cannot be recovered live (every worker restarts): ``round``, ``reason``
    LIVE_RECOVERY_UNAVAILABLE = "live_recovery_unavailable"
    #: a new generation of the live world formed: ``round``, ``generation``, ``world_size``,
    #: ``reason`` (``error``, ``grow``...), ``wait_s`` (seconds it took to form)
    LIVE_REFORMED = "live_reformed"
    #: a node was silent past the heartbeat timeout, or its agent exited: ``node_id``,
    #: ``silent_s``, ``reason``
    NODE_LOST = "node_lost"
    #: a node failed too often (or failed the node check) and is replaced: ``node_id``, ``reason``
    NODE_EXCLUDED = "node_excluded"
    #: the scheduler backend was asked to start an agent for a node: ``node_id``, ``replaces``
    NODE_RELAUNCHED = "node_relaunched"
    #: the scheduler backend refused that: ``node_id``, ``error``
    NODE_RELAUNCH_FAILED = "node_relaunch_failed"

    # ----- checkpoints
    #: every rank's shard of a step is durable: ``step``, ``world_size``, ``round``, ``mb``
    CHECKPOINT_COMMITTED = "checkpoint_committed"
    #: writing a step's commit marker failed: ``step``, ``storage``, ``error``
    CHECKPOINT_COMMIT_FAILED = "checkpoint_commit_failed"
    #: an agent's saver could not persist a shard: ``node_id``, ``rank``, ``step``, ``error``,
    #: ``storage``, ``fatal``
    CHECKPOINT_PERSIST_FAILED = "checkpoint_persist_failed"
    #: a save waited for a snapshot slot still being persisted (the storage is slower than
    #: the job saves): ``step``, ``waited_s``
    CHECKPOINT_BACKPRESSURE = "checkpoint_backpressure"
    #: rank 0 put a checkpoint back: ``step``, ``source`` (``memory``/``storage``), ``load_s``
    CHECKPOINT_RESTORED = "checkpoint_restored"
    #: a committed step failed its check before a storage load: ``step``, ``reason``,
    #: ``fallback`` (the step tried instead, ``None``: none), ``storage``
    CHECKPOINT_DAMAGED = "checkpoint_damaged"
    #: the master decided where a round restores from: ``round``, ``world_size``,
    #: ``committed``, ``held`` (rank -> steps in memory), ``source``, ``step``, and ``why`` where
    #: ranks held snapshots but the restore is not from memory
    RESTORE_DECIDED = "restore_decided"

    # ----- the job
    #: a restarted master took over from its journal: ``round``, ``nodes``, ``restarts``,
    #: ``logged_changes``
    MASTER_RECOVERED = "master_recovered"
    #: the job ended: ``state``, ``reason``, ``restarts``
    JOB_FINISHED = "job_finished"

    def __str__(self) -> str:
        return self.value


@attrs.frozen(kw_only=True)
class JobEvent:
    """One event of a job, seen by ``dlrover_on_job_event`` observers.

    Attributes:
        kind: what happened: an :class:`EventKind` (``worker_failed``, ``workers_restarted``,
            ``rendezvous_completed``, ``checkpoint_committed``...; str-valued; a kind a
            newer master adds is a plain string).
        job_id: the job run's id.
        time_s: seconds since the job master started.
        data: JSON-safe details (rank, exit_code, step...).
        unix_time_s: when it happened, as seconds since the Unix epoch (``time.time()`` on the
            master's host; ``None`` when unknown), to line events up with other hosts' logs.
    """

    kind: str
    job_id: str
    time_s: float
    data: dict[str, Any] = attrs.field(factory=dict)
    unix_time_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {"kind": self.kind, "job_id": self.job_id, "time_s": round(self.time_s, 3), **self.data}
        if self.unix_time_s is not None:
            out["unix_time_s"] = round(self.unix_time_s, 3)
        return out
