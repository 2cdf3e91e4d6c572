"""Rendezvous rules: min, max, node_unit, last call."""

from __future__ import annotations

import pytest

from dlrover_core.master.rendezvous import RendezvousManager


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def manager(**kw):
    clock = Clock()
    defaults = {"min_nodes": 2, "max_nodes": 4, "node_unit": 1, "last_call_s": 5.0}
    return RendezvousManager(**{**defaults, **kw}, clock=clock), clock


def test_round_waits_below_min():
    """Fewer than min nodes never form a round, however long they wait."""
    m, clock = manager()
    m.join(0, 1)
    clock.t += 1000
    assert m.try_complete() is None


def test_round_completes_at_max_at_once():
    """max nodes complete the round immediately; extra nodes wait for the next round."""
    m, _ = manager(max_nodes=2)
    for n in (3, 1, 2):
        m.join(n, 1)
    rnd = m.try_complete()
    assert rnd is not None and rnd.index == 0
    assert rnd.node_ids == (1, 3)  # earliest joiners, ranked by node id
    assert m.waiting == [2]


def test_min_nodes_wait_for_last_call():
    """With min <= n < max the round completes only after last_call_s without a join."""
    m, clock = manager()
    m.join(0, 1)
    m.join(1, 1)
    assert m.try_complete() is None
    clock.t += 4.9
    m.join(2, 1)  # a late joiner restarts the window
    clock.t += 4.9
    assert m.try_complete() is None
    clock.t += 0.2
    rnd = m.try_complete()
    assert rnd is not None and rnd.node_ids == (0, 1, 2)


def test_all_live_nodes_joined_skips_last_call():
    """When every live node waits (and that is >= min), nobody waits for the last call."""
    m, _ = manager()
    m.join(0, 1)
    m.join(1, 1)
    assert m.try_complete(live_nodes=3) is None
    rnd = m.try_complete(live_nodes=2)
    assert rnd is not None and rnd.node_ids == (0, 1)


def test_node_unit_rounds_down():
    """The round takes a multiple of node_unit; the rest wait."""
    m, clock = manager(min_nodes=2, max_nodes=8, node_unit=2)
    for n in range(5):
        m.join(n, 1)
    clock.t += 10
    rnd = m.try_complete()
    assert rnd is not None and len(rnd.node_ids) == 4
    assert m.waiting == [4]


def test_node_unit_below_min_waits():
    m, clock = manager(min_nodes=2, max_nodes=8, node_unit=4)
    for n in range(3):
        m.join(n, 1)
    clock.t += 10
    assert m.try_complete() is None


def test_rounds_are_numbered_and_ranks_follow_node_ids():
    """Rounds count up; world size and rank offsets come from each node's nproc."""
    m, _ = manager(min_nodes=2, max_nodes=2)
    m.join(7, 2)
    m.join(3, 1)
    r0 = m.try_complete()
    assert r0.index == 0 and r0.node_ids == (3, 7) and r0.world_size == 3
    assert r0.rank_offset(3) == 0 and r0.rank_offset(7) == 1 and r0.node_rank(7) == 1
    m.join(3, 1)
    m.join(7, 2)
    assert m.next_index == 1
    assert m.try_complete().index == 1


def test_leave_removes_waiting_node():
    m, clock = manager()
    m.join(0, 1)
    m.join(1, 1)
    m.leave(1)
    clock.t += 10
    assert m.try_complete() is None


def test_invalid_bounds():
    with pytest.raises(ValueError):
        RendezvousManager(min_nodes=3, max_nodes=2)
