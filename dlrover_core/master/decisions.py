"""The job master's decisions, as pure functions of a small view of the job (docs/design.md §5d).

Each function takes a frozen :class:`JobView` — what the master knows that the decision needs —
and the facts of one event (a failure report, a node's success, its exit, too few nodes), and
returns a frozen decision: what to do, and why in words. They read no clock, take no lock,
write no journal and start nothing; :class:`~dlrover_core.master.job_master.JobMaster`
applies a decision in one place (journal ahead, one event that also logs, then the
effects), and ``tests/test_decisions.py`` checks them as tables.

The rules (README "Self-healing"):

* a failure reported after the job ended, or in a round already being restarted, is a
  consequence and costs nothing; one in a round whose restart is held (below) neither;
* the same exception on every rank (:class:`~dlrover_core.master.failures.DeterministicErrorDetector`)
  stops the job: restarting cannot help;
* otherwise a failure costs one restart of the job-wide budget (``Failure.max_restarts``):
  live, when the live world can go on without the failed workers (the survivors keep
  training, replacements rejoin with their state); else every worker restarts into the next
  round, which an exception raised before the first step first holds for
  ``_SCRIPT_ERROR_WAIT_S`` (every rank may be about to report the same: the script's error);
  with the budget spent, the job fails naming its root cause;
* a node succeeds when all its workers did; the job, when every node it needs did — FAILED
  if its final checkpoint is not durable;
* a member of the running round that exits makes the others go on live without it, or
  restart into a round without it (a membership change, not a failure);
* fewer live nodes than ``nodes.min``, with none coming back, fails the job at once.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence

import attrs

from dlrover_core.master.failures import before_first_step, describe
from dlrover_core.master.nodes import plural
from dlrover_core.protocol.messages import WorkerException, WorkerFailure
from dlrover_core.protocol.state import JobState

__all__ = [
    "HANG_NOT_REPLACEABLE",
    "FailureDecision",
    "FailureFacts",
    "JobView",
    "LiveAnswer",
    "Outcome",
    "RoundView",
    "SuccessDecision",
    "below_min_reason",
    "decide_exit",
    "decide_recovery",
    "decide_success",
    "success_end",
    "describe_reported",
    "first_failure_text",
    "live_candidate",
    "not_retryable_reason",
    "triage_failure",
    "waiting_message",
]

#: The live world's own words when it cannot tell which process hung workers wait on.
HANG_NOT_REPLACEABLE = "workers hang and their agent cannot tell which process the others wait on"


@attrs.frozen(kw_only=True)
class RoundView:
    """The newest rendezvous round that formed: its number, nodes and world size."""

    index: int
    node_ids: tuple[int, ...]
    world_size: int


@attrs.frozen(kw_only=True)
class JobView:
    """What the master knows that a decision needs.

    Attributes:
        state: the job's state (terminal once it ended).
        required_round: the round every node must run (a restart raises it).
        current: the newest round that formed (``None``: none yet).
        restarts, max_restarts: restarts taken from the job-wide budget, and the budget.
        held: ``(round, node_id)`` of a restart held for the other ranks' reports (an
            exception before the first step), ``None`` when none is.
        live_round: the round whose live world is open (``None``: none, or it closed).
        live_why: why this job's failures cannot be recovered live at all, or why the
            running round's live world closed (``""``: they can).
    """

    state: JobState
    required_round: int
    current: RoundView | None
    restarts: int
    max_restarts: int
    held: tuple[int, int] | None = None
    live_round: int | None = None
    live_why: str = ""

    @property
    def budget_left(self) -> bool:
        return self.restarts < self.max_restarts


class Outcome(str, enum.Enum):
    """What became of a failure report."""

    ENDED = "ended"  #: the job had already ended
    CONSEQUENCE = "consequence"  #: its round was already being restarted
    HELD = "held"  #: its round already failed; that restart waits for the other ranks' reports
    NOT_RETRYABLE = "not_retryable"  #: every rank raised the same: the job stops
    LIVE = "live"  #: the survivors go on, the failed workers are replaced
    RESTART = "restart"  #: every worker restarts into the next round
    HOLD = "hold"  #: the restart waits for the other ranks' reports (an error before the first step)
    EXHAUSTED = "exhausted"  #: the restart budget is spent: the job fails


@attrs.frozen(kw_only=True)
class FailureFacts:
    """One failure report, with what the master derived from it.

    Attributes:
        node_id: the reporting node.
        round: the round the workers failed in.
        failures: the failed workers (or the node: ``rank`` ``None``).
        verdict: ``(kind, exception)`` when this report completed a
            :class:`~dlrover_core.master.failures.DeterministicErrorDetector` verdict
            (``"script"`` or ``"repeated"``), else ``None``.
    """

    node_id: int
    round: int
    failures: tuple[WorkerFailure, ...]
    verdict: tuple[str, WorkerException] | None = None

    @property
    def script(self) -> bool:
        """Every failure is an exception raised before its worker's first step (maybe the script's)."""
        return bool(self.failures) and all(before_first_step(f.exception) for f in self.failures)


@attrs.frozen(kw_only=True)
class LiveAnswer:
    """Whether a failure is recovered live: the live world's answer once the failed workers
    were marked dead in it, or why it was not asked (:func:`live_candidate`).

    Attributes:
        replaced: the survivors go on; the failed workers are replaced.
        why: why not (``""``: no reason worth saying, e.g. an error before the first step).
        survivors: members of the running generation still alive.
        close: the live world must close, saying ``why`` (the failure itself rules it out).
    """

    replaced: bool
    why: str = ""
    survivors: int = 0
    close: bool = False


@attrs.frozen(kw_only=True)
class FailureDecision:
    """What to do about a failure report.

    Attributes:
        outcome: the path taken.
        action: the failure record's words for it.
        counted: it takes a restart from the budget (and counts against its node).
        restarts: the restarts taken after it.
        release_held: order the held restart now (a different failure came in: not the
            script's error after all).
        reason: with ``EXHAUSTED``, why the job fails.
    """

    outcome: Outcome
    action: str
    counted: bool = False
    restarts: int = 0
    release_held: bool = False
    reason: str = ""

    @property
    def recovery(self) -> str:
        """The failure record's ``recovery``: ``live``, ``restart_all`` or ``""``."""
        if self.outcome == Outcome.LIVE:
            return "live"
        return "restart_all" if self.outcome in (Outcome.RESTART, Outcome.HOLD) else ""


def triage_failure(view: JobView, facts: FailureFacts) -> FailureDecision | None:
    """A failure that changes nothing (the job ended, its round was already restarted or
    its restart is held, every rank raised the same), or ``None``: a new failure, for
    :func:`decide_recovery`."""
    current = view.current
    if view.state.is_terminal:
        return FailureDecision(outcome=Outcome.ENDED, action=f"none: the job had already ended {view.state.value}",
                               restarts=view.restarts)
    if current is None or facts.round < view.required_round or facts.round != current.index:
        return FailureDecision(outcome=Outcome.CONSEQUENCE, restarts=view.restarts,
                               action=f"none: round {facts.round} was already being restarted")
    if view.held is not None and view.held[0] == facts.round:
        return FailureDecision(
            outcome=Outcome.HELD, restarts=view.restarts,
            action=f"none: round {facts.round} already failed (its restart waits for the other ranks)",
            release_held=facts.verdict is None and not facts.script)
    if facts.verdict is not None:
        return FailureDecision(outcome=Outcome.NOT_RETRYABLE, restarts=view.restarts,
                               action="stopped the job: the error is not retryable")
    return None


def live_candidate(view: JobView, facts: FailureFacts) -> LiveAnswer | None:
    """``None``: ask the live world to replace the failed workers. Else the failure is not
    live, and why (``""`` for an error before the first step, which is never live): no live
    world for its round, no budget left, or a hang nobody can pin on one process (then the
    live world closes)."""
    if facts.script:
        return LiveAnswer(replaced=False)
    if view.live_round is None or view.live_round != facts.round or not view.budget_left:
        return LiveAnswer(replaced=False, why=view.live_why)
    if not all(f.replaceable for f in facts.failures):
        return LiveAnswer(replaced=False, why=HANG_NOT_REPLACEABLE, close=True)
    return None


def decide_recovery(view: JobView, facts: FailureFacts, live: LiveAnswer, *, root_cause: str,
                    blame: str) -> FailureDecision:
    """A new failure: live (``live.why`` empty), a restart of every worker, the restart held
    for the other ranks' reports, or the end of the budget.

    Args:
        view, facts: the job and the report.
        live: the live world's answer (``why`` non-empty when the failure is not live).
        root_cause: the round's first failure in words, for an exhausted budget's reason.
        blame: the node table's failure counts in words (``NodeTable.blame``).
    """
    budget = view.max_restarts
    if view.budget_left and live.replaced and not facts.script:
        n = view.restarts + 1
        what = (f"node {facts.node_id} relaunched" if any(f.rank is None for f in facts.failures)
                else f"rank {', '.join(str(f.rank) for f in facts.failures)} replaced")
        return FailureDecision(outcome=Outcome.LIVE, counted=True, restarts=n, action=(
            f"live: {live.survivors} survivor(s) go on; {what}, rejoining with their state (restart {n}/{budget})"))
    if view.budget_left:
        n = view.restarts + 1
        if facts.script:
            return FailureDecision(outcome=Outcome.HOLD, counted=True, restarts=n, action=(
                f"restart {n}/{budget} ordered once the other ranks reported (an exception before the first step may "
                "be the script's)"))
        return FailureDecision(outcome=Outcome.RESTART, counted=True, restarts=n, action=(
            f"restarted all workers (round {facts.round + 1}, restart {n}/{budget})"
            + (f"; not live: {live.why}" if live.why else "")))
    return FailureDecision(
        outcome=Outcome.EXHAUSTED, counted=True, restarts=view.restarts,
        action="stopped the job: restart budget exhausted",
        reason=f"restart budget exhausted (failure.max_restarts={budget}) by {blame}; root cause: {root_cause}")


def not_retryable_reason(kind: str, exc: WorkerException) -> str:
    """Why a job whose ranks all raised ``exc`` stops (``kind``: the detector's verdict)."""
    when = ("before its first step (at import or start-up): an error of the script, not of a node"
            if kind == "script" else f"at step {exc.step}, in two failing rounds in a row")
    return (f"not retryable: every rank raised {exc.exc_type}: {exc.message} {when}; "
            f"restarting cannot help.\n{exc.traceback}").rstrip()


def first_failure_text(seen: Sequence[tuple[float, int | None, int, str, int | None]]) -> str:
    """``seen``: ``(unix time, rank, node, description, exit code)`` of a round's failures;
    the first by time, in words (its root cause)."""
    _, rank, node, text, code = min(seen, key=lambda t: t[0])
    return f"rank {rank} on node {node}, {text}" + (f" (exit code {code})" if code is not None else "")


def describe_reported(failure: WorkerFailure, node_id: int, now: float) -> tuple[float, int | None, int, str, int | None]:
    """A just-reported failure as :func:`first_failure_text` takes it."""
    when = failure.unix_time_s if failure.unix_time_s is not None else now
    return when, failure.rank, node_id, describe(failure), failure.exit_code


@attrs.frozen(kw_only=True)
class SuccessDecision:
    """What a node's success means for the job.

    Attributes:
        counts: the node succeeded in the running round (else: a late report, ignored).
        complete: every node the job needs has succeeded: it ends (:func:`success_end`).
    """

    counts: bool
    complete: bool = False


def decide_success(view: JobView, *, round_index: int, succeeded: frozenset[int],
                   needed: Sequence[int]) -> SuccessDecision:
    """A node reported that all its workers exited 0 in ``round_index``.

    Args:
        succeeded: the nodes that succeeded in the round, this one included.
        needed: the nodes the job needs to succeed (the round's, or the live world's).
    """
    current = view.current
    if current is None or round_index != current.index or round_index < view.required_round:
        return SuccessDecision(counts=False)
    # (the size test first: the set test scans the round, once per node otherwise)
    return SuccessDecision(counts=True, complete=len(succeeded) >= len(needed) and succeeded.issuperset(needed))


def success_end(*, final_problem: str | None, lost_steps: Sequence[int], latest: int | None,
                last_persist_error: str | None) -> tuple[JobState, str]:
    """How a job whose nodes all succeeded ends: FAILED when its final checkpoint is not
    durable (``final_problem``), else SUCCEEDED — saying which checkpoint steps storage
    errors kept from being persisted (``lost_steps``; ``latest``: the newest committed step)."""
    if final_problem is not None:  # never SUCCEEDED without the final checkpoint
        return JobState.FAILED, final_problem
    if lost_steps:
        return JobState.SUCCEEDED, (
            f"final checkpoint committed (step {latest}); checkpoint steps {list(lost_steps)} were not persisted "
            f"(storage errors; last: {last_persist_error}); see events.jsonl")
    return JobState.SUCCEEDED, ""


def decide_exit(view: JobView, *, node_id: int, was: str, succeeded: bool, live_why: str | None) -> str | None:
    """A node's agent exited. ``None``: nothing follows for the others (the job ended, the
    node was not running in the round, or it had succeeded). ``""``: the others go on live
    without it. Else why every node restarts into a round without it.

    Args:
        was: the node's state before it exited.
        succeeded: it had reported success in the running round.
        live_why: the live world's answer once the node was marked dead in it (``None``:
            no live world is open for the round).
    """
    current = view.current
    if (view.state.is_terminal or current is None or node_id not in current.node_ids
            or current.index < view.required_round or was not in ("running", "waiting") or succeeded):
        return None
    if live_why == "":
        return ""
    return f"node {node_id} exited"


def below_min_reason(*, live: Sequence[int], coming: int, done: int, min_nodes: int, gone_why: Mapping[int, str],
                     lost_without_relaunch: bool) -> str | None:
    """Why the job fails at once: fewer live nodes than ``nodes.min`` and none can come
    back (``None``: enough, or enough may come).

    Args:
        live: the live nodes' ids.
        coming: gone nodes whose relaunch was ordered (they may come back).
        done: members of the running round that finished (they need not come back).
        gone_why: why each gone node left.
        lost_without_relaunch: a node was lost and the scheduler cannot relaunch nodes.
    """
    if len(live) + coming + done >= min_nodes:
        return None
    gone = [f"node {n} {why}" for n, why in sorted(gone_why.items())]
    cannot = "; the scheduler cannot relaunch nodes" if lost_without_relaunch else ""
    return (f"{plural(len(live), 'live node')} < nodes.min={min_nodes} and none can come back: "
            f"{', '.join(gone) or 'no other node'}{cannot}; live: "
            f"{', '.join(f'node {n}' for n in sorted(live)) or 'none'}")


def waiting_message(*, live: Sequence[int], coming: Sequence[int], min_nodes: int) -> str:
    """While a round must form with fewer live nodes than ``nodes.min``: what it waits for
    (``""``: enough are live)."""
    need = min_nodes - len(live)
    if need <= 0:
        return ""
    return (f"waiting for {plural(need, 'more node')}; live: "
            f"{', '.join(f'node {n}' for n in sorted(live)) or 'none'} ({len(live)} < nodes.min={min_nodes})"
            + (f"; relaunching: {', '.join(f'node {n}' for n in coming)}" if coming else ""))
