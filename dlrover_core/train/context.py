"""What a worker knows about itself: :class:`WorkerInfo`, read from its environment."""

from __future__ import annotations

import functools
import os
from typing import Any

import attrs

from dlrover_core import env
from dlrover_core.control_plane import job_from_environ
from dlrover_core.spec import JobSpec

__all__ = ["WorkerInfo", "current_job", "is_joiner", "is_live", "worker_info"]


@attrs.frozen(kw_only=True)
class WorkerInfo:
    """The worker's place in the job (torch elastic's terms).

    Attributes:
        rank: global rank, ``0 <= rank < world_size``.
        local_rank: rank on this node.
        world_size: processes in the job this round.
        local_world_size: processes on this node.
        node_rank: this node's rank this round (``GROUP_RANK``).
        num_nodes: nodes this round.
        restart_count: restarts the job has taken so far (``TORCHELASTIC_RESTART_COUNT``).
        round: rendezvous round.
        job_id: the job run's id ("" outside dlrover).
        accelerator: resolved accelerator name.
        device: the ``torch.device`` this worker should use (set by ``init()``).
    """

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    num_nodes: int
    restart_count: int
    round: int
    job_id: str
    accelerator: str
    device: Any = None

    @property
    def is_launched(self) -> bool:
        """Whether a dlrover agent (or torchrun) started this process."""
        return "RANK" in os.environ and "WORLD_SIZE" in os.environ

    @property
    def is_joiner(self) -> bool:
        """Whether this worker replaces a failed one: ``train.steps()`` gives it its rank and
        its live peers' state (``rank`` and ``world_size`` here are its slot's at round start)."""
        return is_live() and is_joiner()


def worker_info() -> WorkerInfo:
    """Read the worker's place from the environment (a one-process world when absent)."""
    e = os.environ
    world_size = int(e.get("WORLD_SIZE", "1"))
    return WorkerInfo(
        rank=int(e.get("RANK", "0")),
        local_rank=int(e.get("LOCAL_RANK", "0")),
        world_size=world_size,
        local_world_size=int(e.get("LOCAL_WORLD_SIZE", str(world_size))),
        node_rank=int(e.get("GROUP_RANK", "0")),
        num_nodes=int(e.get("GROUP_WORLD_SIZE", "1")),
        restart_count=int(e.get("TORCHELASTIC_RESTART_COUNT", "0")),
        round=int(e.get(env.ROUND, "0")),
        job_id=e.get(env.JOB_ID, ""),
        accelerator=e.get(env.ACCELERATOR, "auto"),
    )


@functools.cache
def current_job() -> JobSpec | None:
    """The :class:`~dlrover_core.spec.Job` this worker belongs to, or ``None`` outside dlrover."""
    return job_from_environ()


def is_live() -> bool:
    """Whether this worker can be re-formed without stopping (``train.steps()``): launched by
    a dlrover agent for a Job whose failures can be recovered live (``Failure(live_recovery=True)``
    and every parallel strategy keeping the state replicated: ``JobSpec.live_blocker`` is
    empty, as the master and the agent see it too)."""
    job = current_job()
    return (job is not None and not job.live_blocker and bool(os.environ.get(env.MASTER_ADDR))
            and "RANK" in os.environ)


def is_joiner() -> bool:
    """Whether this worker replaces a failed one and joins the running world (its agent set
    ``DLROVER_LIVE_JOIN``): it takes its state from a live peer, not from a checkpoint."""
    return os.environ.get(env.LIVE_JOIN) == "1"
