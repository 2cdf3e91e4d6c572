"""What the job master shows: its live status (``/v1/status``) and the job's result.

Read-only views of the master's state, built while the master holds its lock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dlrover_core.master.checkpoints import CheckpointCoordinator
from dlrover_core.protocol.result import JobResult
from dlrover_core.protocol.status import JobState, MasterStatus

if TYPE_CHECKING:  # (annotations only: the master imports this module)
    from dlrover_core.master.job_master import JobMaster

__all__ = ["job_result", "master_status", "storage_warning"]


def storage_warning(checkpoints: CheckpointCoordinator | None) -> str:
    """A running job's storage trouble, for the status line (``""`` when none)."""
    error = checkpoints.persist_error if checkpoints is not None else None
    if error is None:
        return ""
    return (f"checkpoint storage failing: step {error.step} rank {error.rank}: {error.error} "
            f"(last commit: step {checkpoints.latest})")  # type: ignore[union-attr]


def master_status(master: JobMaster, *, message: str, elapsed_s: float, wall_s: float) -> MasterStatus:
    """The job's live status, with the node table (``elapsed_s``: since the master started;
    ``wall_s``: to the job's end, or now)."""
    rnd, rate = master.rdzv.latest, master.rate
    return MasterStatus(
        job_id=master.job_id, state=master.state, message=message, step=master.goodput.last_step,
        metrics=dict(master.metrics),
        # the running round's members still alive (not its size: a node that left is not counted)
        nodes=sum(1 for n in rnd.node_ids if master.nodes.is_live(n)) if rnd else 0,
        max_nodes=master.job.nodes.max, restarts=master.restarts, round=rnd.index if rnd else -1,
        elapsed_s=round(elapsed_s, 3), node_table=master.nodes.rows(),
        goodput=master.goodput.timeline(wall_s), total_steps=rate.total_steps,
        step_time_s=_rounded(rate.step_time_s), eta_s=_rounded(rate.eta_s),
        samples_per_s=_rounded(rate.samples_per_s), tokens_per_s=_rounded(rate.tokens_per_s),
        root_cause=next((f for f, _ in reversed(master.failures) if f.root_cause), None),
    )


def job_result(master: JobMaster, *, wall_s: float) -> JobResult:
    """The job's result (state ``UNKNOWN`` while it runs; ``wall_s``: to its end, or now)."""
    wall, g = wall_s, master.goodput
    return JobResult(
        job_id=master.job_id, state=master.state if master.state.is_terminal else JobState.UNKNOWN,
        reason=master.reason, final_step=g.last_step, restarts=master.restarts, wall_time_s=wall,
        productive_s=g.productive_s, goodput=min(1.0, g.productive_s / wall),
        checkpoint_stall_s=g.checkpoint_stall_s, restore_s=g.restore_s, recomputed_s=g.recomputed_s,
        detection_s=g.phases["detection_s"], restart_s=g.phases["restart_s"],
        rendezvous_s=g.phases["rendezvous_s"], startup_s=g.phases["startup_s"],
        reform_s=g.phases["reform_s"], failures=tuple(f for f, _ in master.failures),
        metrics=dict(master.metrics), log_dir=str(master.log_dir or ""),
        worker_exit_codes=worker_exit_codes(master), total_steps=master.rate.total_steps,
        samples_per_s=_rounded(master.rate.samples_per_s), tokens_per_s=_rounded(master.rate.tokens_per_s),
    )


def worker_exit_codes(master: JobMaster) -> dict[int, int]:
    """The exit code of each global rank's last worker, as far as the master knows: the
    failures' codes, then 0 for every worker of a node that reported success in the newest
    round (ranks as that round assigned them)."""
    codes = {f.rank: f.exit_code for f, _ in master.failures if f.rank is not None and f.exit_code is not None}
    rnd = master.rdzv.latest
    if rnd is not None:
        for node_id in sorted(master.book.succeeded):
            if node_id in rnd:
                offset = rnd.rank_offset(node_id)
                codes.update(dict.fromkeys(range(offset, offset + rnd.nproc[rnd.node_rank(node_id)]), 0))
    return dict(sorted(codes.items()))


def _rounded(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)
