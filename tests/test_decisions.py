"""The job master's decisions (``dlrover_core.master.decisions``), as tables: each row is a
view of the job and an event's facts, and what the rule decides. No master, lock, journal,
clock or server: these are the rules; the tests of ``JobMaster`` check that it applies them."""

from __future__ import annotations

import attrs
import pytest

from dlrover_core.master.decisions import (
    HANG_NOT_REPLACEABLE,
    FailureFacts,
    JobView,
    LiveAnswer,
    Outcome,
    RoundView,
    below_min_reason,
    decide_exit,
    decide_recovery,
    decide_success,
    live_candidate,
    not_retryable_reason,
    success_end,
    triage_failure,
    waiting_message,
)
from dlrover_core.protocol.messages import WorkerException, WorkerFailure
from dlrover_core.protocol.state import JobState

ROUND1 = RoundView(index=1, node_ids=(0, 1), world_size=2)
RUNNING = JobView(state=JobState.RUNNING, required_round=1, current=ROUND1, restarts=1, max_restarts=3, live_round=1)
KILLED = WorkerFailure(rank=1, local_rank=0, exit_code=-9, kind="signal")
EARLY = WorkerFailure(rank=1, local_rank=0, exit_code=1, kind="exception",
                      exception=WorkerException(exc_type="ImportError", message="no module x", step=-1))
HUNG = WorkerFailure(rank=1, local_rank=0, kind="hang", replaceable=False)
NODE = WorkerFailure(kind="node_lost", detail="no heartbeat for 30 s")
SAME = ("script", WorkerException(exc_type="ValueError", message="bad", step=-1, traceback="Traceback ...\nValueError"))


def facts(*failures, round_index=1, verdict=None, node_id=1):
    return FailureFacts(node_id=node_id, round=round_index, failures=tuple(failures), verdict=verdict)


def view(**changes):
    return attrs.evolve(RUNNING, **changes)


@pytest.mark.parametrize(("job", "report", "outcome", "action", "release"), [
    (view(state=JobState.CANCELLED), facts(KILLED), Outcome.ENDED, "none: the job had already ended CANCELLED", False),
    (view(required_round=2), facts(KILLED), Outcome.CONSEQUENCE, "none: round 1 was already being restarted", False),
    (view(), facts(KILLED, round_index=0), Outcome.CONSEQUENCE, "none: round 0 was already being restarted", False),
    (view(current=None), facts(KILLED), Outcome.CONSEQUENCE, "none: round 1 was already being restarted", False),
    # a held round: another early error keeps the hold, a different failure releases it
    (view(held=(1, 0)), facts(EARLY), Outcome.HELD, "none: round 1 already failed (its restart waits for the other "
                                                    "ranks)", False),
    (view(held=(1, 0)), facts(KILLED), Outcome.HELD, "none: round 1 already failed (its restart waits for the other "
                                                     "ranks)", True),
    (view(held=(1, 0)), facts(EARLY, verdict=SAME), Outcome.HELD, "none: round 1 already failed (its restart waits "
                                                                  "for the other ranks)", False),
    (view(), facts(EARLY, verdict=SAME), Outcome.NOT_RETRYABLE, "stopped the job: the error is not retryable", False),
    (view(), facts(KILLED), None, None, False),  # a new failure: decide_recovery
])
def test_a_failure_that_changes_nothing_is_told_from_a_new_one(job, report, outcome, action, release):
    decision = triage_failure(job, report)
    if outcome is None:
        assert decision is None
        return
    assert (decision.outcome, decision.action, decision.release_held, decision.counted) == (outcome, action, release,
                                                                                           False)
    assert decision.restarts == job.restarts


@pytest.mark.parametrize(("job", "report", "expected"), [
    (view(), facts(KILLED), None),  # ask the live world
    (view(), facts(NODE), None),
    (view(), facts(EARLY), LiveAnswer(replaced=False)),  # never live: maybe the script's error
    (view(live_round=None, live_why="failure.live_recovery=False"), facts(KILLED),
     LiveAnswer(replaced=False, why="failure.live_recovery=False")),
    (view(live_round=0), facts(KILLED), LiveAnswer(replaced=False)),  # the live world of another round
    (view(restarts=3), facts(KILLED), LiveAnswer(replaced=False)),  # no budget left
    (view(), facts(HUNG), LiveAnswer(replaced=False, why=HANG_NOT_REPLACEABLE, close=True)),
])
def test_the_live_world_is_asked_only_when_it_could_replace_the_failed_workers(job, report, expected):
    assert live_candidate(job, report) == expected


@pytest.mark.parametrize(("job", "report", "live", "outcome", "action", "restarts"), [
    (view(), facts(KILLED), LiveAnswer(replaced=True, survivors=1), Outcome.LIVE,
     "live: 1 survivor(s) go on; rank 1 replaced, rejoining with their state (restart 2/3)", 2),
    (view(), facts(NODE), LiveAnswer(replaced=True, survivors=3), Outcome.LIVE,
     "live: 3 survivor(s) go on; node 1 relaunched, rejoining with their state (restart 2/3)", 2),
    (view(), facts(KILLED), LiveAnswer(replaced=False, why="no worker of the round survived"), Outcome.RESTART,
     "restarted all workers (round 2, restart 2/3); not live: no worker of the round survived", 2),
    (view(), facts(KILLED), LiveAnswer(replaced=False), Outcome.RESTART, "restarted all workers (round 2, restart 2/3)",
     2),
    (view(), facts(EARLY), LiveAnswer(replaced=False), Outcome.HOLD,
     "restart 2/3 ordered once the other ranks reported (an exception before the first step may be the script's)", 2),
    (view(restarts=3), facts(KILLED), LiveAnswer(replaced=False), Outcome.EXHAUSTED,
     "stopped the job: restart budget exhausted", 3),
    (view(restarts=3), facts(KILLED), LiveAnswer(replaced=True), Outcome.EXHAUSTED,
     "stopped the job: restart budget exhausted", 3),
])
def test_a_new_failure_is_live_a_restart_a_held_restart_or_the_end_of_the_budget(job, report, live, outcome, action,
                                                                               restarts):
    decision = decide_recovery(job, report, live, root_cause="rank 1 on node 1, SIGKILL (exit code -9)",
                               blame="2 failures: node 1 (2)")
    assert (decision.outcome, decision.action, decision.restarts, decision.counted) == (outcome, action, restarts, True)
    assert decision.recovery == {Outcome.LIVE: "live", Outcome.RESTART: "restart_all", Outcome.HOLD: "restart_all",
                                 Outcome.EXHAUSTED: ""}[outcome]
    if outcome == Outcome.EXHAUSTED:
        assert decision.reason == ("restart budget exhausted (failure.max_restarts=3) by 2 failures: node 1 (2); root "
                                   "cause: rank 1 on node 1, SIGKILL (exit code -9)")


def test_every_rank_raising_the_same_stops_the_job_with_the_traceback():
    assert not_retryable_reason(*SAME) == ("not retryable: every rank raised ValueError: bad before its first step (at "
                                           "import or start-up): an error of the script, not of a node; restarting "
                                           "cannot help.\nTraceback ...\nValueError")
    repeated = not_retryable_reason("repeated", WorkerException(exc_type="KeyError", message="k", step=7))
    assert repeated == ("not retryable: every rank raised KeyError: k at step 7, in two failing rounds in a row; "
                        "restarting cannot help.")


@pytest.mark.parametrize(("job", "round_index", "succeeded", "needed", "counts", "complete"), [
    (view(), 1, {0}, (0, 1), True, False),
    (view(), 1, {0, 1}, (0, 1), True, True),
    (view(), 1, {1}, (1,), True, True),  # the live world runs without node 0
    (view(), 0, {0, 1}, (0, 1), False, False),  # a late report of an older round
    (view(required_round=2), 1, {0, 1}, (0, 1), False, False),  # the round is being restarted
    (view(current=None), 1, {0}, (), False, False),
])
def test_the_job_succeeds_when_every_node_it_needs_did(job, round_index, succeeded, needed, counts, complete):
    d = decide_success(job, round_index=round_index, succeeded=frozenset(succeeded), needed=needed)
    assert (d.counts, d.complete) == (counts, complete)


@pytest.mark.parametrize(("problem", "lost", "end"), [
    (None, [], (JobState.SUCCEEDED, "")),
    ("checkpoint step 9 not committed: ...", [], (JobState.FAILED, "checkpoint step 9 not committed: ...")),
    (None, [4, 6], (JobState.SUCCEEDED, "final checkpoint committed (step 9); checkpoint steps [4, 6] were not "
                                         "persisted (storage errors; last: OSError: disk full); see events.jsonl")),
])
def test_a_job_never_succeeds_without_its_final_checkpoint(problem, lost, end):
    assert success_end(final_problem=problem, lost_steps=lost, latest=9, last_persist_error="OSError: disk full") == end


@pytest.mark.parametrize(("job", "node_id", "was", "succeeded", "live_why", "expected"), [
    (view(), 1, "running", False, None, "node 1 exited"),  # no live world: every node restarts
    (view(), 1, "running", False, "no worker of the round survived", "node 1 exited"),
    (view(), 1, "running", False, "", ""),  # the others go on live
    (view(), 1, "succeeded", True, None, None),  # it had finished
    (view(), 1, "registered", False, None, None),  # it was not running in the round
    (view(), 5, "running", False, None, None),  # not a member of the round
    (view(state=JobState.FAILED), 1, "running", False, None, None),
    (view(required_round=2), 1, "running", False, None, None),
])
def test_a_node_leaving_makes_the_others_go_on_live_or_restart_without_it(job, node_id, was, succeeded, live_why,
                                                                           expected):
    assert decide_exit(job, node_id=node_id, was=was, succeeded=succeeded, live_why=live_why) == expected


@pytest.mark.parametrize(("live", "coming", "done", "lost", "expected"), [
    ([0, 1], 0, 0, False, None),
    ([0], 1, 0, False, None),  # a relaunch may bring it back
    ([0], 0, 1, False, None),  # it finished its part
    ([0], 0, 0, False, "1 live node < nodes.min=2 and none can come back: node 1 exited; live: node 0"),
    ([0], 0, 0, True, "1 live node < nodes.min=2 and none can come back: node 1 exited; the scheduler cannot "
                      "relaunch nodes; live: node 0"),
    ([], 0, 0, False, "0 live nodes < nodes.min=2 and none can come back: node 1 exited; live: none"),
])
def test_too_few_nodes_with_none_coming_back_fails_the_job_naming_them(live, coming, done, lost, expected):
    assert below_min_reason(live=live, coming=coming, done=done, min_nodes=2, gone_why={1: "exited"},
                            lost_without_relaunch=lost) == expected


@pytest.mark.parametrize(("live", "coming", "expected"), [
    ([0, 1], [], ""),
    ([0], [], "waiting for 1 more node; live: node 0 (1 < nodes.min=2)"),
    ([], [1], "waiting for 2 more nodes; live: none (0 < nodes.min=2); relaunching: node 1"),
])
def test_a_round_waiting_for_nodes_says_what_for(live, coming, expected):
    assert waiting_message(live=live, coming=coming, min_nodes=2) == expected
