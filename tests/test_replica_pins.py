"""Replica pins (issue 28): every node keeps the steps a lost node's replicas are of.

A seeded model of a job's nodes under random schedules: the real rules decide (the ranks
agree to save a step only when every rank's newest snapshot is confirmed and a slot is
unpinned, else every rank skips it and the training goes on; :func:`pins_to_release`
releases; the master's :func:`resume_step` chooses the step), the schedule is random: which rank saves, which
buddy asks or finishes a transfer (a transfer whose source slot was re-published meanwhile
is torn and dropped, as ``send_frame``'s seqlock does), when an agent looks at its pins.
At random moments a node is taken as lost; the invariant: its ranks' replicas on its
buddy and every other rank's snapshots (or applied step) always share a step, and the
training never deadlocks.
"""

from __future__ import annotations

import contextlib
import random
from types import SimpleNamespace

import pytest

from dlrover_core.agent.replicas import pins_to_release
from dlrover_core.master.live import resume_step

SLOTS, REPLICA_SLOTS = 3, 2


class Rank:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.slots: list[dict | None] = [None] * SLOTS  # {step, id, pinned}
        self.next_id = 0
        self.saved = -1  # the last step it saved (and applied)

    def live(self) -> list[dict]:
        return [s for s in self.slots if s is not None]

    def ready(self) -> bool:
        """``MemorySnapshots.ready_to_save``: a free slot, and the newest snapshot confirmed."""
        free = [i for i, s in enumerate(self.slots) if s is None or not s["pinned"]]
        return bool(free) and not any(s["pinned"] and not s["confirmed"] for s in self.live())

    def save(self, step: int) -> None:
        assert self.ready(), "a save the ranks agreed on found no slot"  # (the agent only frees more)
        free = [i for i, s in enumerate(self.slots) if s is None or not s["pinned"]]
        i = min(free, key=lambda i: -1 if self.slots[i] is None else self.slots[i]["id"])
        self.next_id += 1
        self.slots[i] = {"step": step, "id": self.next_id, "pinned": True, "confirmed": False}
        self.saved = step


class Holder:
    """A buddy node's puller and replica slots for one source node."""

    def __init__(self, source_ranks: list[int]) -> None:
        self.replicas = {r: [None] * REPLICA_SLOTS for r in source_ranks}  # {step, id}
        self.turn = 0
        self.target = -1  # the step this pass replicates of every rank
        self.transfer: tuple[int, int, dict] | None = None  # (rank, source slot index, snapshot)

    def newest(self, rank: int) -> dict | None:
        held = [s for s in self.replicas[rank] if s is not None]
        return max(held, key=lambda s: s["id"], default=None)


def _check_lost(node: int, nodes: dict[int, list[Rank]], holder_of: dict[int, Holder], step: int) -> int | None:
    """The step a live world re-formed after ``node`` is lost resumes at (None: none).
    Every survivor applied ``step`` (the step every rank computes before saving it)."""
    asked = {}
    for n, ranks in nodes.items():
        for r in ranks:
            if n == node:
                held = [s["step"] for s in holder_of[node].replicas[r.rank] if s is not None]
                asked[(n, r.rank)] = SimpleNamespace(replica=False, step=-1, memory_steps=held)
            else:
                asked[(n, r.rank)] = SimpleNamespace(replica=True, step=step,
                                                     memory_steps=[s["step"] for s in r.live()])
    return resume_step(asked)[0]


@pytest.mark.parametrize("seed", range(40))
def test_a_lost_nodes_replicas_always_share_a_step_with_every_other_rank_seeded(seed):
    rng = random.Random(seed)
    n_nodes, per_node = rng.choice([2, 3, 4]), rng.choice([1, 2])
    nodes = {n: [Rank(n * per_node + i) for i in range(per_node)] for n in range(n_nodes)}
    # ring placement: node n's ranks are kept by node n+1
    holder_of = {n: Holder([r.rank for r in nodes[n]]) for n in nodes}
    buddy_says: dict[int, dict[int, int]] = {n: {} for n in nodes}  # what each node's server heard
    # speeds: each node's buddy is fast or slow, each agent looks at its pins often or rarely
    weights = {("pull", n): rng.choice([1, 3, 10]) for n in nodes} | {("keep", n): rng.choice([1, 5]) for n in nodes}
    step, target, events, checked, gone_back, saved_steps = 0, 120, 0, 0, 0, 0
    agreed: bool | None = None  # whether every rank saves the step every rank applied last
    everyone = [r for ranks in nodes.values() for r in ranks]
    while step < target:
        events += 1
        assert events < 200_000, f"deadlock at step {step}"
        pending = [r for r in everyone if r.saved < step] if agreed else []
        if agreed is not None and not pending:  # saved by every rank, or skipped by every rank
            step, agreed = step + 1, None
            continue
        choices = [("save", None)] * 5 + [k for k, w in weights.items() for _ in range(w)] + [("back", None)]
        kind, n = rng.choice(choices)
        if kind == "back":  # a worker failed: every rank goes back to a step all hold (a few times)
            if step < 2 or gone_back >= 3:
                continue
            gone_back += 1
            back = resume_step({(m, r.rank): SimpleNamespace(replica=True, step=step,
                                                             memory_steps=[s["step"] for s in r.live()])
                                for m in nodes for r in nodes[m]})[0]
            assert back is not None, f"seed {seed}: no step every rank holds at step {step}"
            for r in everyone:
                r.slots = [s if s is not None and s["step"] <= back else None for s in r.slots]  # abandoned
                r.saved = min(r.saved, back)
            step, agreed = back + 1, None
        elif kind == "save" and agreed is None:  # the ranks' all-reduce before the save
            agreed = all(r.ready() for r in everyone)
            saved_steps += agreed
        elif kind == "save":
            rng.choice(pending).save(step)
        elif kind == "pull":
            h, source = holder_of[n], nodes[n]
            if h.transfer is None:  # ask for the next rank: say what is held, get the pass's step
                if h.turn % len(source) == 0:  # a pass begins: the newest step every rank of the source has
                    h.target = min(max((s["step"] for s in r.live()), default=-1) for r in source)
                r = source[h.turn % len(source)]
                h.turn += 1
                held = h.newest(r.rank)
                live_ids = [s["id"] for s in r.live()]
                if held and live_ids and held["id"] not in live_ids and held["id"] > max(live_ids):
                    # of an abandoned lineage: the source answers 409 and the buddy drops it
                    h.replicas[r.rank] = [s if s is not held else None for s in h.replicas[r.rank]]
                    held = h.newest(r.rank)
                buddy_says[n][r.rank] = held["id"] if held else -1
                newer = [(i, s) for i, s in enumerate(r.slots) if s is not None and s["step"] == h.target
                         and s["id"] > (held["id"] if held else -1)]
                if newer:
                    i, snap = max(newer, key=lambda x: x[1]["id"])
                    h.transfer = (r.rank, i, dict(snap))
            else:  # the transfer ends: whole only if the source slot still holds it
                rank, i, snap = h.transfer
                h.transfer = None
                src = next(r for r in source if r.rank == rank)
                if src.slots[i] is not None and src.slots[i]["id"] == snap["id"]:
                    slots = h.replicas[rank]
                    newest = h.newest(rank)
                    stale = [j for j, s in enumerate(slots) if s is not None and s["step"] >= snap["step"]]
                    j = stale[0] if stale else next(j for j, s in enumerate(slots) if s is None or s is not newest)
                    slots[j] = {"step": snap["step"], "id": snap["id"]}
        else:  # the agent of node n looks at its pins
            own = {r.rank: [(s["step"], s["id"]) for s in r.live()] for r in nodes[n] if r.rank in buddy_says[n]}
            released, confirmed = pins_to_release(own, buddy_says[n])
            for r in nodes[n]:
                for s in r.live():
                    if s["id"] in released.get(r.rank, ()):
                        s["pinned"] = False
                    elif s["id"] in confirmed.get(r.rank, ()):
                        s["confirmed"] = True
        # as if a node died now
        for lost in nodes:  # (once every rank saved a snapshot: before, a lost node restarts the job)
            if step >= 1 and all(holder_of[lost].newest(r.rank) is not None for r in nodes[lost]):
                checked += 1
                assert _check_lost(lost, nodes, holder_of, step) is not None, (
                    f"seed {seed}: node {lost} lost at step {step}: "
                    f"replicas {[[s and s['step'] for s in holder_of[lost].replicas[r.rank]] for r in nodes[lost]]}, "
                    f"others {[[s and (s['step'], s['pinned']) for s in r.slots] for m in nodes if m != lost for r in nodes[m]]}")
    assert checked > 0 and saved_steps > 0


def test_the_rule_keeps_the_buddys_newest_and_the_step_before():
    own = {0: [(7, "a"), (8, "b"), (9, "c")], 1: [(7, "d"), (8, "e"), (9, "f")]}
    # the buddy holds step 9 of rank 0 but only 8 of rank 1: keep 7 and 8 (and 9) on both;
    # 7 and 8 are confirmed (9 is not: the next save waits for it)
    assert pins_to_release(own, {0: "c", 1: "e"}) == ({}, {0: {"a", "b"}, 1: {"d", "e"}})
    assert pins_to_release(own, {0: "c", 1: "f"}) == ({0: {"a"}, 1: {"d"}}, {0: {"b", "c"}, 1: {"e", "f"}})
    # a rank its buddy holds nothing current of (an abandoned lineage, or none yet): keep all
    assert pins_to_release(own, {0: "c", 1: "zz"}) == ({}, {})
    assert pins_to_release(own, {0: "c"}) == ({}, {})
    # a rank with no snapshot (not started yet) does not hold the others back
    assert pins_to_release({0: [(7, "a"), (8, "b"), (9, "c")], 1: []}, {0: "c"}) == ({0: {"a"}}, {0: {"b", "c"}})


# ----- the real slots, agents and puller ------------------------------------------------------


@pytest.fixture
def job_id():
    import uuid

    from dlrover_core.checkpoint.shm import remove_segments

    job = f"pins-{uuid.uuid4().hex[:8]}"
    yield job
    remove_segments(f"dlrover-{job}-")


def _save(mem, step: int, persist: bool = False) -> bool:
    import torch

    from dlrover_core.checkpoint.layout import build_layout

    state = {"w": torch.full((1000,), float(step)), "step": step}
    return mem.save(build_layout(state, step=step, rank=mem.rank, world_size=2), step=step, world_size=2,
                    persist=persist)


def _pins(mem) -> dict[int, int]:
    return {h.step: h.pin for slot in mem.slots if (h := slot.header()) is not None and h.live}


def test_a_replicated_save_waits_for_its_buddy_and_skips_when_the_buddy_is_silent(job_id):
    """Node 0's rank 0 saves with pins; node 1 follows node 0. Every save finds the buddy
    holding the rank's previous snapshot (never two ahead); the agent releases what the
    buddy no longer needs. With the buddy gone, the pins are held: a save is skipped at
    once instead of waiting (a released slot is still used), and a save due for persistence
    takes a held slot."""
    import time

    from dlrover_core.agent.replicas import NodeReplicas
    from dlrover_core.checkpoint.memory import MemorySnapshots
    from dlrover_core.checkpoint.shm import PIN_HELD

    source = NodeReplicas(job_id=job_id, node_id=0, master_addr="127.0.0.1:1")
    buddy = NodeReplicas(job_id=job_id, node_id=1, master_addr="127.0.0.1:1", interval_s=0.02)
    mem = MemorySnapshots(job_id=job_id, node_id=0, rank=0, wait_timeout_s=20.0, replicated=True)
    assert len(mem.slots) == 3
    try:
        source.set_ranks([0])
        buddy.follow(0, source.address, (0,))
        for step in range(8):
            assert _save(mem, step)
            held = buddy.store.newest(0, 0)
            if step > 0:
                assert held is not None and held.step >= step - 1, (step, held)  # never two ahead of its replicas
        time.sleep(0.5)
        steps = sorted(_pins(mem))
        assert steps == [5, 6, 7], steps  # the window: the buddy's newest and the two before
        assert buddy.store.newest(0, 0).step == 7
        buddy.close()
        assert _save(mem, 8)  # into the slot of 5, released: the buddy held 7
        t0 = time.monotonic()
        while not all(pin == PIN_HELD for pin in _pins(mem).values()):
            assert time.monotonic() - t0 < 10, _pins(mem)
            time.sleep(0.1)
        t0 = time.monotonic()
        assert not _save(mem, 9)  # skipped, not waited for
        assert time.monotonic() - t0 < 1.0 and mem.waited_for == "replicas"
        assert sorted(_pins(mem)) == [6, 7, 8]  # nothing a recovery may need was overwritten
        assert _save(mem, 10, persist=True)  # storage first: a held slot is taken
        assert 10 in _pins(mem)
    finally:
        mem.close()
        source.close()
        with contextlib.suppress(Exception):
            buddy.close()


def test_a_replica_of_an_abandoned_lineage_is_dropped_and_the_current_one_pulled(job_id):
    """The buddy holds step 3, which the source then abandons (the job went back to 2): the
    source answers the buddy's next request with 409, the buddy drops its replica of 3 and
    pulls 2 again, and the source's next save (which waits for 2 to be confirmed) goes on."""
    import time

    from dlrover_core.agent.replicas import NodeReplicas
    from dlrover_core.checkpoint.memory import MemorySnapshots

    source = NodeReplicas(job_id=job_id, node_id=0, master_addr="127.0.0.1:1")
    buddy = NodeReplicas(job_id=job_id, node_id=1, master_addr="127.0.0.1:1", interval_s=0.02)
    mem = MemorySnapshots(job_id=job_id, node_id=0, rank=0, wait_timeout_s=20.0, replicated=True)
    try:
        source.set_ranks([0])
        buddy.follow(0, source.address, (0,))
        for step in range(4):
            assert _save(mem, step)
        t0 = time.monotonic()
        while (held := buddy.store.newest(0, 0)) is None or held.step != 3:
            assert time.monotonic() - t0 < 10
            time.sleep(0.05)
        mem.forget_after(2)  # went back to step 2: 3 is of an abandoned lineage
        t0 = time.monotonic()
        assert _save(mem, 3)  # the new lineage's step 3: waits until the buddy holds 2 again
        assert time.monotonic() - t0 < 10
        t0 = time.monotonic()
        while (held := buddy.store.newest(0, 0)) is None or held.seq != max(
                h.seq for s in mem.slots if (h := s.header()) is not None and h.live):
            assert time.monotonic() - t0 < 10, held
            time.sleep(0.05)
        assert held.step == 3  # the new lineage's 3, not the abandoned one
    finally:
        mem.close()
        buddy.close()
        source.close()


def test_the_buddys_long_poll_returns_when_a_new_step_is_saved(job_id):
    """``/v1/steps?after=<held>&wait_s=<t>`` answers at once when a rank's newest step is not
    the one held, waits while it is, and answers within a few ms of the next save."""
    import json
    import threading
    import time
    import urllib.request

    from dlrover_core.agent.replicas import ReplicaServer, ReplicaStore
    from dlrover_core.checkpoint.memory import MemorySnapshots

    mem = MemorySnapshots(job_id=job_id, node_id=0, rank=0)
    store = ReplicaStore(job_id=job_id, node_id=0, agent=0)
    server = ReplicaServer(job_id=job_id, node_id=0, agent=0, store=store)

    def steps(after: int, wait_s: float) -> tuple[dict, float]:
        t0 = time.monotonic()
        with urllib.request.urlopen(f"http://{server.address}/v1/steps?ranks=0&after={after}&wait_s={wait_s}") as r:
            return json.loads(r.read()), time.monotonic() - t0

    try:
        assert _save(mem, 1)
        assert steps(-1, 5.0)[0] == {"0": [1]}  # newer than held: at once (each rank's steps)
        answer, took_s = steps(1, 0.3)
        assert answer == {"0": [1]} and took_s >= 0.3  # nothing newer: the whole wait
        saver = threading.Timer(0.3, lambda: _save(mem, 2))
        saver.start()
        answer, took_s = steps(1, 5.0)
        saver.join()
        assert answer == {"0": [1, 2]} and took_s < 2.0  # the save ended the wait
    finally:
        server.close()
        store.close()
        mem.close()


def test_a_replicated_rank_is_ready_to_save_once_its_newest_snapshot_is_confirmed(job_id):
    """What the ranks agree on before a memory-only save: not ready while the buddy has not
    confirmed the newest snapshot, or while every slot is pinned; ready again when the agent
    confirms it. A job without replicas is ready whenever a slot is free."""
    from dlrover_core.checkpoint.memory import MemorySnapshots
    from dlrover_core.checkpoint.shm import PIN_CONFIRMED, PIN_RELEASED

    mem = MemorySnapshots(job_id=job_id, node_id=0, rank=0, wait_timeout_s=5.0, replicated=True)
    plain = MemorySnapshots(job_id=job_id, node_id=1, rank=0, wait_timeout_s=5.0)
    try:
        assert mem.ready_to_save() and plain.ready_to_save()
        assert _save(mem, 0) and _save(plain, 0) and _save(plain, 1)
        assert not mem.ready_to_save()  # the buddy does not hold step 0 yet
        assert plain.ready_to_save()  # (no pins: the older slot is taken)

        def set_pins(pin: int) -> None:
            for slot in mem.slots:
                h = slot.header()
                if h is not None and h.live:
                    with slot.shared():
                        slot.set_pin(pin)

        set_pins(PIN_CONFIRMED)
        assert mem.ready_to_save()
        assert _save(mem, 1)
        set_pins(PIN_CONFIRMED)
        assert _save(mem, 2)
        set_pins(PIN_CONFIRMED)  # three confirmed, still pinned: no slot to take
        assert not mem.ready_to_save()
        set_pins(PIN_RELEASED)
        assert mem.ready_to_save()
    finally:
        mem.close()
        plain.close()


def test_a_kept_peer_state_takes_a_free_slot_now_without_a_pin_and_never_holds_the_replicas_back(job_id):
    """A sharded world's replacement keeps the state its replica peer sent it as an
    *unpinned* snapshot: taken at once into a free slot even while the rank's newest
    snapshot waits for the buddy (no wait, no gate), published without a pin (the buddy may
    never replicate that step, when the node's other ranks lack it), so what the scheduled
    saves wait for is unchanged; it never takes a pinned slot, and with none free it is
    skipped at once, not waited for."""
    import time

    import torch

    from dlrover_core.checkpoint.layout import build_layout
    from dlrover_core.checkpoint.memory import MemorySnapshots
    from dlrover_core.checkpoint.shm import PIN_KEPT

    def keep(step: int) -> bool:
        layout = build_layout({"w": torch.full((1000,), float(step)), "step": step}, step=step, rank=0, world_size=2)
        return mem.save(layout, step=step, world_size=2, persist=False, unpinned=True)

    mem = MemorySnapshots(job_id=job_id, node_id=0, rank=0, wait_timeout_s=30.0, replicated=True)
    try:
        assert _save(mem, 0)  # pinned, not yet confirmed: the next scheduled save would wait
        assert not mem.ready_to_save()
        t0 = time.monotonic()
        assert keep(12) and keep(13)
        assert time.monotonic() - t0 < 5.0, "an unpinned snapshot waited for the replicas"
        assert _pins(mem) == {0: PIN_KEPT, 12: 0, 13: 0}
        assert not mem.ready_to_save(), "the kept state changed what the scheduled saves wait for"
        assert keep(14) and _pins(mem) == {0: PIN_KEPT, 13: 0, 14: 0}  # the oldest unpinned one goes
        for slot in mem.slots:  # every slot pinned: nothing to take
            with slot.shared():
                slot.set_pin(PIN_KEPT)
        t0 = time.monotonic()
        assert not keep(15) and time.monotonic() - t0 < 5.0
        assert mem.held_steps(2) == [0, 13, 14]
    finally:
        mem.close()
