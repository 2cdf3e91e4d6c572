"""A failure's fate: triaged, counted, decided, applied.

:class:`Recovery` is the job master's room for failure reports (an agent's, or the master's
own for a node it declared lost): it asks the pure rules
(:mod:`~dlrover_core.master.decisions`) what to do — triage (a stale or duplicate report, a
deterministic bug, a failure after the job ended), then live replacement or a restart of
every worker, within the restart budget — and applies the answer: the restart ordered (or
held for the other ranks' reports when it came before the first step), one record and one
event per failed worker, the root causes marked, the job ended or the failing node
excluded. It acts through the master's :class:`~dlrover_core.master.context.MasterContext`,
under the master's lock, inside one write-ahead batch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import attrs

from dlrover_core.logging import get_logger
from dlrover_core.master.context import MasterContext
from dlrover_core.master.decisions import (
    FailureDecision,
    FailureFacts,
    JobView,
    Outcome,
    decide_recovery,
    describe_reported,
    first_failure_text,
    live_candidate,
    not_retryable_reason,
    triage_failure,
)
from dlrover_core.master.failures import DeterministicErrorDetector, failure_record, mark_root_causes
from dlrover_core.master.fleet import Fleet
from dlrover_core.master.nodes import NodeRecord
from dlrover_core.master.rounds import Rounds
from dlrover_core.protocol.codec import encode
from dlrover_core.protocol.events import EventKind
from dlrover_core.protocol.messages import Action, ActionAnswer, FailureReport, WorkerFailure
from dlrover_core.protocol.state import JobState

__all__ = ["Recovery"]

log = get_logger()

#: Seconds the restart ordered by an exception raised before the first step waits for the
#: other ranks' reports: when they all raised the same, the job stops instead (the script's error).
SCRIPT_ERROR_WAIT_S = 10.0


class Recovery:
    """What becomes of a failure.

    Args:
        ctx: the master.
        fleet: its fleet (a lost node's report; a failing node's exclusion).
        rounds: its rounds (a restart of every worker).
    """

    def __init__(self, ctx: MasterContext, *, fleet: Fleet, rounds: Rounds) -> None:
        self._ctx, self._fleet, self._rounds = ctx, fleet, rounds
        self._errors = DeterministicErrorDetector()

    def failure(self, message: FailureReport, *, lost: bool = False) -> ActionAnswer:
        """Workers of a node failed (or the node was lost) in a round: decide and apply.
        ``lost``: the master's own report of a node it declared lost; a node-level report
        from outside, a scheduler's, is evidence that the node is lost."""
        ctx = self._ctx
        node = ctx.node(message.node_id)
        failures = message.failures
        if not lost and failures and message.token is None and all(f.kind == "node_lost" for f in failures):
            # evidence from the scheduler that the node is gone (its agent process exited):
            # act now, not after failure.heartbeat_timeout_s of silence; an agent that
            # exited because its node was done (succeeded, exited, excluded) is no failure
            if node.state in ("running", "waiting", "registered") and not ctx.state.is_terminal:
                self._fleet.lose(node, max(0.0, ctx.clock() - node.last_heartbeat), why=failures[0].detail)
            return ActionAnswer(action=ctx.action(message.round, node))
        if not node.gone:
            node.last_heartbeat = ctx.clock()
        view = ctx.view()
        world = view.current.world_size if view.current is not None else 0
        verdicts = [self._errors.record(message.round, world, f.rank, f.exception) for f in failures]
        verdict = next(((v, f.exception) for v, f in zip(verdicts, failures, strict=True) if v), None)
        facts = FailureFacts(node_id=node.node_id, round=message.round, failures=tuple(failures), verdict=verdict)
        decision = triage_failure(view, facts) or self._decide(view, facts, node)
        self._apply(decision, facts, node)
        if decision.outcome == Outcome.LIVE and not ctx.state.is_terminal:
            return ActionAnswer(action=Action.REPLACE)
        return ActionAnswer(action=ctx.action(message.round, node))

    def release_held(self) -> None:
        """Order the restart a failure before the first step held back: the other ranks did
        not all raise the same (or did not report in time)."""
        ctx = self._ctx
        if ctx.book.held is None:
            return
        round_index, _, node_id = ctx.book.held
        ctx.book.held = None
        if ctx.state.is_terminal or round_index < ctx.required_round:
            return
        self._rounds.restart(round_index)
        log.info("restart_released", round=round_index, node_id=node_id)
        ctx.event(EventKind.WORKERS_RESTARTED, round=ctx.required_round, restarts=ctx.book.restarts)
        node = ctx.nodes.get(node_id)
        if node is not None:
            self._fleet.exclude_if_failing(node)

    # ----- deciding --------------------------------------------------------------------

    def _decide(self, view: JobView, facts: FailureFacts, node: NodeRecord) -> FailureDecision:
        """A new failure: ask the live world, count it against its node, decide."""
        ctx = self._ctx
        live = live_candidate(view, facts)
        if live is None:
            live = ctx.livework.replace(node.node_id, facts.failures)
        elif live.close:
            ctx.livework.unavailable(facts.round, live.why)
        node.failed(ctx.now_s())
        if not live.replaced:
            ctx.goodput.failed(ctx.clock(), silent_s=max((f.silent_s for f in facts.failures), default=0.0))
        root_cause = self._first_of_round(facts.round, node.node_id, facts.failures)
        return decide_recovery(view, facts, live, root_cause=root_cause, blame=ctx.nodes.blame())

    def _first_of_round(self, round_index: int, node_id: int, failures: Sequence[WorkerFailure]) -> str:
        """The first failure of ``round_index`` known now, in words: one of ``failures``,
        just reported by ``node_id``, or one reported before (see ``mark_root_causes``)."""
        now = time.time()
        seen = [describe_reported(f, node_id, now) for f in failures]
        seen += [(r.unix_time_s if r.unix_time_s is not None else now, r.rank, r.node_id, r.detail, r.exit_code)
                 for r, _ in self._ctx.book.failures if r.round == round_index and r.recovery != "live"]
        return first_failure_text(seen)

    # ----- applying --------------------------------------------------------------------

    def _apply(self, decision: FailureDecision, facts: FailureFacts, node: NodeRecord) -> None:
        """Apply a failure decision: the budget, the restart (ordered or held), the records
        and events, the end of the job or its node's exclusion."""
        ctx = self._ctx
        if decision.release_held:
            self.release_held()
        ctx.book.restarts = decision.restarts
        if decision.outcome == Outcome.HOLD:
            ctx.book.held = (facts.round, ctx.clock() + SCRIPT_ERROR_WAIT_S, facts.node_id)
            log.info("restart_held", round=facts.round, node_id=facts.node_id, wait_s=SCRIPT_ERROR_WAIT_S)
        elif decision.outcome == Outcome.RESTART:
            self._rounds.restart(facts.round)
        elif decision.outcome == Outcome.EXHAUSTED:
            ctx.finish(JobState.FAILED, decision.reason)
        self._record(decision, facts)
        if decision.outcome == Outcome.RESTART and not ctx.state.is_terminal:
            ctx.event(EventKind.WORKERS_RESTARTED, round=ctx.required_round, restarts=ctx.book.restarts)
        if facts.verdict is not None and not ctx.state.is_terminal:
            kind, exc = facts.verdict
            held = ctx.book.held
            if kind == "script" and held is not None and held[0] == facts.round:
                blamed = ctx.nodes.get(held[2])
                if blamed is not None and blamed.failures > 0:
                    blamed.failures -= 1  # the script's error, not its node's
            ctx.finish(JobState.FAILED, not_retryable_reason(kind, exc))
        elif decision.counted and not ctx.state.is_terminal and ctx.book.held is None:
            self._fleet.exclude_if_failing(node)

    def _record(self, decision: FailureDecision, facts: FailureFacts) -> None:
        """One record, log line and event per failed worker; then the root causes again."""
        ctx, book = self._ctx, self._ctx.book
        ended = decision.outcome == Outcome.ENDED
        reported_at = time.time()
        for f in facts.failures:
            rec = failure_record(f, time_s=ctx.now_s(), round_index=facts.round, node_id=facts.node_id,
                                 step=ctx.goodput.last_step, last_committed_step=ctx.goodput.last_committed_step,
                                 action=decision.action, reported_at=reported_at)
            if decision.counted and not ctx.state.is_terminal:
                rec = attrs.evolve(rec, recovery=decision.recovery)
            # the result lists the job's failures, not what its end caused (a cancel); after
            # a failure that ended the job, its peers' reports may hold the root cause; nor a
            # worker that exited because the live world told it every worker restarts
            ordered = (decision.outcome == Outcome.CONSEQUENCE and f.exception is None
                       and ctx.livework.sent_away(facts.round, facts.node_id, f.local_rank))
            if (not ended or ctx.state == JobState.FAILED) and not ordered:
                book.failures.append((rec, decision.counted))
            ctx.event(EventKind.WORKER_FAILED, level="warning", log_fields={
                "node_id": facts.node_id, "rank": rec.rank, "kind": rec.kind, "detail": rec.detail, "step": rec.step,
                "action": decision.action}, **{("failure_kind" if k == "kind" else k): v for k, v in encode(rec).items()})
        marked = mark_root_causes([f for f, _ in book.failures])
        book.failures = [(m, counted) for m, (_, counted) in zip(marked, book.failures, strict=True)]
