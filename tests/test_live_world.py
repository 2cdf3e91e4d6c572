"""The master's live world (``dlrover_core.master.live``): how generations form, and a seeded
stress test of random schedules of deaths, re-forms, joins and clock jumps that checks its
invariants after every event."""

from __future__ import annotations

import os
import random

import pytest

from dlrover_core.master.live import LiveWorld
from dlrover_core.protocol.messages import LiveReform


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def world(members, clock=None, timeout_s=30.0):
    keys: list[str] = []
    w = LiveWorld(round_index=0, members=members, store_host="h", store_port=1, set_key=keys.append,
                  clock=clock or Clock(), straggler_timeout_s=timeout_s)
    w.keys = keys  # type: ignore[attr-defined]
    return w


def ask(w, slot, pid, generation, reason="error", step=5):
    """A worker asks; a replacement (``join``) does not hold the state yet."""
    return w.reform(LiveReform(node_id=slot[0], local_rank=slot[1], pid=pid, round=0, generation=generation,
                               step=step, reason=reason, replica=reason != "join"))


def test_survivors_form_the_next_generation_once_every_live_member_asked():
    w = world([(0, 0), (1, 0), (2, 0)])
    for slot, pid in (((0, 0), 10), ((1, 0), 11), ((2, 0), 12)):
        assert ask(w, slot, pid, 0, reason="ready").state == "ready"
    assert w.can_go_on() == ""
    w.worker_died((1, 0))
    assert ask(w, (0, 0), 10, 0).state == "waiting"  # (2, 0) has not asked yet
    a2 = ask(w, (2, 0), 12, 0)
    a0 = ask(w, (0, 0), 10, 0)
    assert (a0.state, a0.generation, a0.rank, a0.world_size) == ("ready", 1, 0, 2)
    assert (a2.state, a2.generation, a2.rank, a2.world_size) == ("ready", 1, 1, 2)
    assert a0.prefix == "live/1/" and a0.grow_key == "live/grow/1"


def test_a_replacement_raises_the_grow_flag_and_joins_at_the_boundary():
    w = world([(0, 0), (1, 0)])
    ask(w, (0, 0), 10, 0, reason="ready")
    ask(w, (1, 0), 11, 0, reason="ready")
    w.worker_died((1, 0))
    assert ask(w, (0, 0), 10, 0).generation == 1
    assert ask(w, (1, 0), 20, -1, reason="join", step=-1).state == "waiting"
    assert w.keys == ["live/abort/0", "live/grow/1"]  # (the dead member's generation aborted)
    grown = ask(w, (0, 0), 10, 1, reason="grow")
    joined = ask(w, (1, 0), 20, -1, reason="join", step=-1)
    assert (grown.generation, grown.world_size, joined.generation, joined.rank) == (2, 2, 2, 1)
    assert [t.reason for t in w.transitions] == ["error", "grow"]


def test_a_silent_member_is_left_out_after_the_straggler_timeout_and_rejoins_later():
    clock = Clock()
    w = world([(0, 0), (1, 0), (2, 0)], clock, timeout_s=5.0)
    for i in range(3):
        ask(w, (i, 0), 10 + i, 0, reason="ready")
    w.worker_died((2, 0))
    assert ask(w, (0, 0), 10, 0).state == "waiting"
    clock.t = 6.0
    w.tick()
    a = ask(w, (0, 0), 10, 0)
    assert (a.generation, a.world_size) == (1, 1)
    # the straggler comes back with its state: it is a joiner of generation 2
    assert ask(w, (1, 0), 11, 0).state == "waiting" and w.keys == ["live/abort/0", "live/grow/1"]
    ask(w, (0, 0), 10, 1, reason="grow")
    assert ask(w, (1, 0), 11, 0).generation == 2


def test_no_live_recovery_without_train_steps_or_without_survivors():
    w = world([(0, 0), (1, 0)])
    ask(w, (0, 0), 10, 0, reason="ready")
    w.worker_died((0, 0))
    assert "train.steps()" in w.can_go_on()
    w.worker_died((1, 0))
    assert w.can_go_on() == "no worker of the round survived"
    w.close("restart")
    assert ask(w, (1, 0), 11, 0).state == "restart"


def test_a_waiting_replacement_is_told_finished_when_the_members_are_done():
    w = world([(0, 0), (1, 0)])
    ask(w, (0, 0), 10, 0, reason="ready")
    ask(w, (1, 0), 11, 0, reason="ready")
    w.worker_died((1, 0))
    ask(w, (0, 0), 10, 0)
    assert ask(w, (1, 0), 20, -1, reason="join").state == "waiting"
    assert ask(w, (0, 0), 10, 1, reason="done").state == "finished"
    assert ask(w, (1, 0), 20, -1, reason="join").state == "finished"


def test_a_member_that_dies_after_finishing_the_last_step_is_not_replaced_live():
    """A worker that crashes on its way out (after ``train.steps()`` ended: a native
    teardown abort) has no running world to rejoin: its peers are finished or finishing.
    The live world says so, and the master restarts every worker instead."""
    w = world([(0, 0), (1, 0)])
    ask(w, (0, 0), 10, 0, reason="ready")
    ask(w, (1, 0), 11, 0, reason="ready")
    assert ask(w, (1, 0), 11, 0, reason="done").state == "finished"
    w.worker_died((0, 0))
    assert "finished the last step" in w.can_go_on() and "node 1 local rank 0" in w.can_go_on()


def test_replacements_alone_never_form_a_generation():
    """Without a replica (every worker that held the state died) the replacements would start
    from nothing: they wait (the master restarts every worker meanwhile)."""
    w = world([(0, 0), (1, 0)])
    w.worker_died((0, 0))
    w.worker_died((1, 0))
    assert ask(w, (0, 0), 20, -1, reason="join", step=-1).state == "waiting"
    assert ask(w, (1, 0), 21, -1, reason="join", step=-1).state == "waiting"
    w.tick()
    assert w.generation == 0


def grown_with_a_replacement():
    """Generation 2 of a 2-worker world: rank 0 (it held the state all along) and rank 1's
    replacement (pid 20), which has not received the state yet."""
    w = world([(0, 0), (1, 0)])
    ask(w, (0, 0), 10, 0, reason="ready")
    ask(w, (1, 0), 11, 0, reason="ready")
    w.worker_died((1, 0), 11)
    ask(w, (0, 0), 10, 0)
    ask(w, (1, 0), 20, -1, reason="join", step=-1)
    ask(w, (0, 0), 10, 1, reason="grow")
    assert ask(w, (1, 0), 20, -1, reason="join", step=-1).generation == 2
    return w


def test_the_holder_dying_while_it_sends_the_state_leaves_no_world_to_go_on_with():
    """The repro live-grow-state: rank 0 dies during the broadcast to rank 1's replacement.
    The replacement is alive but holds nothing: the live world says so (the master restarts
    every worker from the newest checkpoint), and never forms a generation of it alone."""
    w = grown_with_a_replacement()
    w.worker_died((0, 0), 10)
    why = w.can_go_on()
    assert "no surviving worker holds the training state" in why and "node 1 local rank 0" in why, why
    # its collective failed: it asks, still without the state
    assert w.reform(LiveReform(node_id=1, local_rank=0, pid=20, round=0, generation=2, step=-1, reason="error",
                               replica=False)).state == "waiting"
    ask(w, (0, 0), 30, -1, reason="join", step=-1)  # rank 0's replacement
    w.tick()
    assert w.generation == 2 and w.can_go_on() == why


def test_a_replacement_that_caught_up_can_give_the_state_on():
    w = grown_with_a_replacement()
    ask(w, (1, 0), 20, 2, reason="caught_up")
    w.worker_died((0, 0), 10)
    assert w.can_go_on() == ""
    a = ask(w, (1, 0), 20, 2)
    assert (a.state, a.generation, a.world_size, a.rank) == ("ready", 3, 1, 0)


def test_a_generation_of_replacements_only_never_forms():
    """Every member is a joiner (its state lost with the workers that held it): no one to
    send the state, so nothing forms and the master is told why."""
    w = world([(0, 0), (0, 1)])
    for lr in (0, 1):
        ask(w, (0, lr), 10 + lr, 0, reason="ready")
    w.node_died(0)
    assert ask(w, (0, 0), 20, -1, reason="join", step=-1).state == "waiting"
    assert ask(w, (0, 1), 21, -1, reason="join", step=-1).state == "waiting"
    w.tick()
    assert w.generation == 0 and w.can_go_on() == "no worker of the round survived"


def test_a_dead_node_takes_all_its_workers():
    w = world([(0, 0), (0, 1), (1, 0), (1, 1)])
    for slot, pid in zip(w.members, range(10, 14), strict=True):
        ask(w, slot, pid, 0, reason="ready")
    w.node_died(1)
    assert w.nodes() == {0} and not w.has_node(1)
    # its workers may only be cut off: the survivors' collectives must not wait for them
    assert w.keys == ["live/abort/0"]
    w.node_died(1)  # told twice (the agent's report, then the heartbeat timeout): set once
    assert w.keys == ["live/abort/0"]
    ask(w, (0, 0), 10, 0)
    a = ask(w, (0, 1), 11, 0)
    assert (a.generation, a.world_size, a.rank) == (1, 2, 1)


STRESS_SEEDS = int(os.environ.get("DLROVER_STRESS_SEEDS", "30"))


@pytest.mark.parametrize("seed", range(STRESS_SEEDS))
def test_random_schedules_keep_the_invariants(seed):
    """Workers die (one, or a node's) or freeze, survivors ask at random moments, replacements
    join and catch up (receive the state), answers are lost and asked again, the clock jumps
    past the straggler timeout, members finish; the last workers holding the state die while
    they send it to a replacement. After every event: generations only grow; a generation's
    members are distinct slots ranked in order, and at least one of them holds the state; no
    dead process is ever placed; two processes never hold the same rank of a generation; a
    process asking again gets the same answer; the live world says it can go on only while a
    live process holds the state. At the end: with a holder left, every live process is
    placed in the newest generation (no deadlock); with none, the live world says why (the
    master restarts every worker: no endless wait)."""
    rng = random.Random(seed)
    clock = Clock()
    nodes, nproc = rng.randint(1, 3), rng.randint(1, 3)
    slots = [(n, lr) for n in range(nodes) for lr in range(nproc)]
    w = world(list(slots), clock, timeout_s=5.0)
    next_pid = 100
    # pid -> {"slot", "gen" (its generation, -1: joining), "alive", "holds" (the training state), "frozen"}
    procs: dict[int, dict] = {}
    for s in slots:
        procs[next_pid] = {"slot": s, "gen": 0, "alive": True, "holds": True}
        assert ask(w, s, next_pid, 0, reason="ready").state == "ready"
        next_pid += 1
    placed: dict[tuple[int, int], int] = {(0, r): pid for r, pid in enumerate(procs)}
    dead: set[int] = set()
    last_generation = 0

    def send(pid: int, reason: str):
        v = procs[pid]
        return w.reform(LiveReform(node_id=v["slot"][0], local_rank=v["slot"][1], pid=pid, round=0,
                                   generation=v["gen"], step=5 if v["holds"] else -1, reason=reason,
                                   replica=v["holds"]))

    def check(answer, pid):
        nonlocal last_generation
        procs[pid]["waiting"] = answer.state == "waiting"
        if answer.state != "ready":
            return
        assert pid not in dead, f"dead process {pid} placed in generation {answer.generation}"
        key = (answer.generation, answer.rank)
        assert placed.setdefault(key, pid) == pid, f"rank {key} given to {placed[key]} and {pid}"
        assert 0 <= answer.rank < answer.world_size
        procs[pid]["gen"] = answer.generation

    def holders_left(gone: set[int] = frozenset()) -> list[int]:
        return [p for p, v in procs.items() if v["alive"] and v["holds"] and p not in gone]

    def kill(pids: set[int]) -> None:
        for p in pids:
            procs[p]["alive"] = False
            dead.add(p)

    closed = ""
    for _ in range(150):
        alive = [p for p, v in procs.items() if v["alive"]]
        roll = rng.random()
        if roll < 0.10 and alive:  # a worker dies (not the last holder: see the broadcast below)
            pid = rng.choice(alive)
            if not holders_left({pid}):
                continue
            kill({pid})
            w.worker_died(procs[pid]["slot"], pid)
        elif roll < 0.14 and alive:  # a whole node dies
            node = rng.choice([procs[p]["slot"][0] for p in alive])
            on_node = {p for p in alive if procs[p]["slot"][0] == node}
            if not holders_left(on_node):
                continue
            kill(on_node)
            w.node_died(node)
        elif roll < 0.17:  # the holders of the running generation die while they send the state
            joining = [p for p in alive if procs[p]["gen"] == w.generation and not procs[p]["holds"]]
            senders = {p for p in holders_left() if procs[p]["gen"] == w.generation}
            if not joining or not senders or set(holders_left()) - senders:
                continue
            kill(senders)
            for p in senders:
                w.worker_died(procs[p]["slot"], p)
        elif roll < 0.20 and alive:  # a worker freezes (SIGSTOP): alive, it never asks again
            procs[rng.choice(alive)]["frozen"] = True
        elif roll < 0.26:  # a replacement for a slot with no live process
            taken = {procs[p]["slot"] for p in alive}
            free = [s for s in slots if s not in taken]
            if free:
                s = rng.choice(free)
                procs[next_pid] = {"slot": s, "gen": -1, "alive": True, "holds": False}
                check(send(next_pid, "join"), next_pid)
                next_pid += 1
        elif roll < 0.32:  # a placed replacement receives the state from a live holder of its generation
            ready = [p for p in alive if not procs[p]["holds"] and not procs[p].get("frozen")
                     and procs[p]["gen"] == w.generation and procs[p]["slot"] in w.members
                     and not procs[p].get("waiting")]
            sources = [p for p in holders_left() if procs[p]["gen"] == w.generation and not procs[p].get("frozen")]
            if ready and sources:
                pid = rng.choice(ready)
                procs[pid]["holds"] = True
                send(pid, "caught_up")
        elif roll < 0.4:
            clock.t += rng.choice([0.1, 1.0, 6.0])
            w.tick()
        else:  # a live process asks (again): error, or grow once flagged
            awake = [p for p in alive if not procs[p].get("frozen")]
            if not awake:
                continue
            pid = rng.choice(awake)
            v = procs[pid]
            reason = "join" if v["gen"] < 0 else ("grow" if f"live/grow/{v['gen']}" in w.keys else "error")
            if v["gen"] >= 0 and v["slot"] not in w.members and reason != "grow":
                reason = "error"
            answer = send(pid, reason)
            again = send(pid, reason) if answer.state == "ready" else None
            check(answer, pid)
            if again is not None:  # the answer was lost: asking again gives the same place
                assert (again.generation, again.rank) == (answer.generation, answer.rank)
        if w.generation > last_generation:  # a new generation: one of its members holds the state
            members = [p for p in procs if procs[p]["alive"] and procs[p]["slot"] in w.members]
            assert any(procs[p]["holds"] for p in members), f"generation {w.generation} formed without a holder"
        assert w.generation >= last_generation
        last_generation = w.generation
        assert len(set(w.members)) == len(w.members) and w.members == sorted(w.members)
        assert not any(procs[p]["slot"] in w.members and p in dead and procs[p]["gen"] == w.generation
                       and w.dead.get(procs[p]["slot"], 0) == 0 for p in procs)
        if not holders_left():  # the master would restart every worker now
            closed = w.can_go_on()
            assert closed, "the live world would go on with no live process holding the state"
            break

    if closed:
        assert "holds the training state" in closed or "survived" in closed, closed
        return
    # liveness: every live process asks until placed (members at a step boundary see the
    # grow flag and ask too); the clock moves past the straggler timeout
    def awake(v: dict) -> bool:
        return v["alive"] and not v.get("frozen")

    for pid, v in procs.items():  # the agents' hang watchers kill the frozen ones
        if v["alive"] and v.get("frozen"):
            kill({pid})
            w.worker_died(v["slot"], pid)
    if not any(awake(v) and v["holds"] for v in procs.values()):
        assert w.can_go_on(), "every holder is gone, yet the live world would go on"
        return
    for _ in range(4):
        for pid, v in procs.items():
            if not awake(v):
                continue
            if v["gen"] < 0:
                reason = "join"
            elif v["gen"] < w.generation or v["slot"] not in w.members or v.get("waiting"):
                reason = "error"
            elif f"live/grow/{v['gen']}" in w.keys:
                reason = "grow"
            else:
                continue
            check(send(pid, reason), pid)
        clock.t += 6.0
        w.tick()
    # someone holds the state: every awake process ends up in the newest generation
    stuck = {p: v for p, v in procs.items() if awake(v) and (v["gen"] != w.generation or v.get("waiting"))}
    assert not stuck, f"not placed in generation {w.generation}: {stuck}"
    assert {v["slot"] for v in procs.values() if awake(v)} <= set(w.members)


def test_a_worker_that_cannot_be_re_formed_closes_the_world_and_the_failure_says_why():
    """A worker whose loop starts says why it cannot be re-formed (a state sharded behind the
    spec's back, a backend without live sharding): the round's live world closes and the
    reason reaches the master's decision about the next failure (``JobView.live_why``)."""
    from dlrover_core.master.live import LiveRecovery

    class Store:
        def set(self, key, value):
            pass

    livework = LiveRecovery(why_not="", store_host="h", clock=Clock(), event=lambda kind, **data: None,
                            straggler_timeout_s=30.0)
    livework.open(0, [(0, 0), (0, 1)], 1, Store())
    assert livework.open_round == 0 and livework.why_not_now == ""
    answer = livework.world.reform(LiveReform(node_id=0, local_rank=1, pid=11, round=0, generation=0, reason="ready",
                                              error="a sharded DTensor"))
    assert answer.state == "restart" and answer.reason == "a sharded DTensor"
    assert livework.open_round is None and livework.why_not_now == "a sharded DTensor"
    assert LiveRecovery(why_not="failure.live_recovery=False", store_host="h", clock=Clock(),
                        event=lambda kind, **data: None, straggler_timeout_s=30.0).why_not_now == (
        "failure.live_recovery=False")


def test_a_dead_member_aborts_its_generation_so_a_survivor_waiting_in_gloo_wakes():
    """A survivor sending the state to a replacement that dies waits in gloo for ever (no
    reset reaches a sender waiting for its receiver to be ready): the generation's abort key
    is set at the member's death, once; a joiner's death changes no running generation."""
    w = world([(0, 0), (1, 0)])
    ask(w, (0, 0), 10, 0, reason="ready")
    ask(w, (1, 0), 11, 0, reason="ready")
    w.worker_died((1, 0), 11)
    assert w.keys == ["live/abort/0"]
    w.worker_died((1, 0), 11)  # told twice: set once
    assert w.keys == ["live/abort/0"]
    ask(w, (0, 0), 10, 0)  # the survivor re-forms alone (generation 1)
    assert ask(w, (1, 0), 12, -1, reason="join").state == "waiting"
    keys = list(w.keys)
    w.worker_died((1, 0), 12)  # the replacement died before it was a member
    assert w.keys == keys and "live/abort/1" not in keys
