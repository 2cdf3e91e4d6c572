"""What a finished job reports: :class:`JobResult` and one :class:`FailureRecord` per failure."""

from __future__ import annotations

import signal
import time
from typing import Any

import attrs
import cattrs

from dlrover_core.protocol.state import JobState

__all__ = ["NO_STEPS_NOTE", "FailureRecord", "JobResult", "JobState", "format_exit_codes"]


@attrs.frozen(kw_only=True)
class FailureRecord:
    """One worker failure and what the master did about it.

    Attributes:
        time_s: seconds since the job started.
        round: rendezvous round the failure happened in.
        node_id: the failed worker's node.
        rank: global rank of the failed worker (``None`` when the node itself failed).
        local_rank: local rank on its node.
        exit_code: process exit code; negative means killed by a signal (``-9`` = SIGKILL).
        signal: signal name when killed by one (``"SIGKILL"``), else ``None``.
        step: newest step the job had reported when it failed.
        last_committed_step: newest committed checkpoint step at that time (``None``: none).
        action: what was done, in words (``"restarted all workers (round 2)"``).
        restored_step: the step training resumed from after this failure (``None``: fresh).
        restored_from: ``"storage"``, ``"memory"`` or ``None``.
        restored_why: where it resumed from storage although ranks held snapshots in
            memory, why memory could not serve (``"no step is in every rank's memory ..."``);
            ``""`` otherwise.
        kind: ``"signal"``, ``"exit"``, ``"exception"``, ``"hang"`` or ``"node_lost"``.
        detail: the failure in words (``"SIGKILL"``, ``"ValueError: ... at step 17"``).
        recovery: the path taken: ``"live"`` (the survivors went on, the failed workers were
            replaced and rejoined with their live state), ``"restart_all"`` (every worker
            restarted from a checkpoint; ``action`` says why not live), or ``""`` (no action:
            a consequence of an earlier failure, or the job stopped).
        unix_time_s: when it failed (seconds since the epoch; see ``WorkerFailure.unix_time_s``).
        root_cause: the first failure of its incident (torchrun's "first observed failure"):
            of a round's failures that restarted every worker (or ended the job) and those
            that followed from it, the earliest; a failure recovered live is its own.
        traceback: the end of the exception's traceback (``""``: no exception was recorded).
        error_file: the worker's ``TORCHELASTIC_ERROR_FILE`` when it wrote one (``""``: none).
    """

    time_s: float
    round: int
    node_id: int
    rank: int | None
    local_rank: int | None
    exit_code: int | None
    signal: str | None
    step: int
    last_committed_step: int | None
    action: str
    restored_step: int | None = None
    restored_from: str | None = None
    restored_why: str = ""
    kind: str = "exit"
    detail: str = ""
    recovery: str = ""
    unix_time_s: float | None = None
    root_cause: bool = False
    traceback: str = ""
    error_file: str = ""

    def who(self) -> str:
        """``rank 1 (node 0, local rank 1)``, or ``node 3`` for a node-level failure."""
        if self.rank is None:
            return f"node {self.node_id}"
        local = f", local rank {self.local_rank}" if self.local_rank is not None else ""
        return f"rank {self.rank} (node {self.node_id}{local})"

    def root_cause_lines(self, *, traceback_lines: int = 40) -> list[str]:
        """The failure as torchrun prints its root cause: time, rank, exit code, error
        file and the end of the traceback, one field a line."""
        when = (time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.unix_time_s))
                if self.unix_time_s is not None else "unknown")
        lines = [f"time      : {when} ({self.time_s:.1f} s into the job)",
                 "rank      : " + (f"{self.rank} (node {self.node_id}, local_rank {self.local_rank})"
                                       if self.rank is not None else f"none: node {self.node_id}"),
                 f"exitcode  : {self.exit_code if self.exit_code is not None else 'none (still running)'}"
                 + (f" ({self.signal})" if self.signal else ""),
                 f"error     : {self.detail}",
                 f"error_file: {self.error_file or '<N/A>'}",
                 f"action    : {self.action}"]
        if self.traceback:
            tb = self.traceback.rstrip().splitlines()[-traceback_lines:]
            lines += ["traceback :", *(f"  {line}" for line in tb)]
        return lines


@attrs.frozen(kw_only=True)
class JobResult:
    """How a job ended.

    Attributes:
        job_id: the run's id; ``log_dir`` holds its logs, ``events.jsonl`` and ``result.json``.
        state: SUCCEEDED, FAILED or CANCELLED.
        reason: why it failed or was cancelled ("" on success).
        final_step: newest step reported by rank 0 (``-1``: the script never called
            ``train.report``; then ``goodput`` and ``productive_s`` are 0 because unmeasured, and
            :meth:`summary` says so instead of showing them).
        restarts: restarts taken from the job-wide budget.
        wall_time_s: seconds from master start to the end.
        productive_s: seconds of step time that count toward the final model (rank 0).
        goodput: ``productive_s / wall_time_s`` (0..1).
        checkpoint_stall_s: seconds training waited on checkpoint saves (rank 0).
        restore_s: seconds spent restoring checkpoints (rank 0).
        recomputed_s: seconds of step time lost to failures and computed again.
        detection_s: seconds from the last progress before a failure to its report.
        restart_s: seconds from failure reports to the next rendezvous (stopping workers,
            saving at the breakpoint).
        rendezvous_s: seconds spent forming rounds (the first one included).
        startup_s: seconds from rounds' completion to their first step, restore excluded.
        failures: one record per failure, in order.
        reform_s: seconds the surviving workers spent re-forming the live world (leaving the
            process group, waiting for the next generation, catching up), rank 0's; the
            step each failure interrupted is not in it.
        metrics: newest value of every metric rank 0 reported.
        log_dir: the run's directory.
        worker_exit_codes: exit code of each global rank's last worker, as far as the master
            knows (0 for the workers of nodes that reported success; a failure's code for a
            failed worker; ranks as the newest round assigned them). Negative: killed by that
            signal.
        total_steps: the run's length in steps, as rank 0 gave it to ``train.report``
            (``None``: not given).
        samples_per_s, tokens_per_s: the throughput at the end, as the status showed it last
            (``None``: not reported).
    """

    job_id: str
    state: JobState
    reason: str
    final_step: int
    restarts: int
    wall_time_s: float
    productive_s: float
    goodput: float
    checkpoint_stall_s: float
    restore_s: float
    recomputed_s: float
    detection_s: float
    restart_s: float
    rendezvous_s: float
    startup_s: float
    failures: tuple[FailureRecord, ...]
    metrics: dict[str, float]
    log_dir: str
    reform_s: float = 0.0
    worker_exit_codes: dict[int, int] = attrs.field(factory=dict)
    total_steps: int | None = None
    samples_per_s: float | None = None
    tokens_per_s: float | None = None

    @property
    def root_cause(self) -> FailureRecord | None:
        """The root cause of the newest failing incident (see ``FailureRecord.root_cause``);
        ``None`` without failures."""
        return next((f for f in reversed(self.failures) if f.root_cause), self.failures[-1] if self.failures else None)

    @property
    def steps_reported(self) -> bool:
        """Whether rank 0 reported any step (``train.report``): else step and goodput are unknown."""
        return self.final_step >= 0

    def to_dict(self) -> dict[str, Any]:
        return _converter.unstructure(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> JobResult:
        return _converter.structure(data, cls)

    def to_record(self) -> dict[str, Any]:
        """The result as the last JSON Lines object of a run (``DLROVER_LOG_FORMAT=json``):
        ``{"event": "result", ...to_dict()}``, plus ``note`` (:data:`NO_STEPS_NOTE`) when no
        step was reported (then ``final_step`` -1 and ``goodput`` 0 mean "unknown")."""
        record: dict[str, Any] = {"event": "result", **self.to_dict()}
        if not self.steps_reported:
            record["note"] = NO_STEPS_NOTE
        return record

    def summary(self) -> str:
        """A few readable lines for the console."""
        lines = [f"job {self.job_id}: {self.state.value}" + (f" — {self.reason}" if self.reason else "")]
        if self.steps_reported:
            of = f" of {self.total_steps}" if self.total_steps is not None else ""
            lines += [
                f"  final step {self.final_step}{of}, restarts {self.restarts}, wall time {self.wall_time_s:.1f} s",
                f"  goodput {self.goodput:.1%}: productive {self.productive_s:.1f} s, checkpoint stall "
                f"{self.checkpoint_stall_s:.2f} s, restore {self.restore_s:.2f} s, recomputed {self.recomputed_s:.1f} s, "
                f"detection {self.detection_s:.1f} s, restart {self.restart_s:.1f} s, rendezvous "
                f"{self.rendezvous_s:.1f} s, startup {self.startup_s:.1f} s"
                + (f", live re-forms {self.reform_s:.2f} s" if self.reform_s else ""),
            ]
        else:
            lines.append(f"  wall time {self.wall_time_s:.1f} s, restarts {self.restarts}")
            if self.worker_exit_codes:
                lines.append(f"  worker exit codes: {format_exit_codes(self.worker_exit_codes)}")
            lines.append(f"  {NO_STEPS_NOTE}")
        for f in self.failures:
            who = f"rank {f.rank}" if f.rank is not None else f"node {f.node_id}"
            how = f.detail or f.signal or f"exit code {f.exit_code}"
            restored = ""
            if f.restored_from:
                why = f": {f.restored_why}" if f.restored_why else ""
                restored = f"; resumed from step {f.restored_step} ({f.restored_from}{why})"
            when = f"step {f.step}" if f.step >= 0 else "before any reported step"
            cause = " [root cause]" if f.root_cause and len(self.failures) > 1 else ""
            lines.append(f"  failure at {f.time_s:.1f} s, {when}: {who} {how} → {f.action}{restored}{cause}")
        root = self.root_cause
        if self.state == JobState.FAILED and root is not None:
            lines.append("  root cause (first observed failure):")
            lines += [f"    {line}" for line in root.root_cause_lines()]
        if self.metrics:
            lines.append("  metrics: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(self.metrics.items())))
        lines.append(f"  logs: {self.log_dir}")
        return "\n".join(lines)


#: What a summary or ``dlrover status`` says of a job whose script never called ``train.report``.
NO_STEPS_NOTE = ("no step was reported: the step, the goodput and the ETA need train.report(step, ...) in the "
                 "script, once per optimizer step on every rank")


def format_exit_codes(codes: dict[int, int]) -> str:
    """``{0: 0, 1: 0, 2: -9}`` as ``"ranks 0-1: 0, rank 2: -9 (SIGKILL)"``: runs of consecutive
    ranks with the same code together, a negative code with its signal's name."""
    runs: list[tuple[int, int, int]] = []  # (first rank, last rank, code)
    for rank, code in sorted(codes.items()):
        if runs and runs[-1][2] == code and runs[-1][1] == rank - 1:
            runs[-1] = (runs[-1][0], rank, code)
        else:
            runs.append((rank, rank, code))
    parts = []
    for first, last, code in runs:
        who = f"rank {first}" if first == last else f"ranks {first}-{last}"
        name = ""
        if code < 0:
            try:
                name = f" ({signal.Signals(-code).name})"
            except ValueError:
                pass
        parts.append(f"{who}: {code}{name}")
    return ", ".join(parts)


_converter = cattrs.Converter()
