"""The master's replica placement and index (dlrover_core/master/replicas.py): pure rules."""

from __future__ import annotations

import doctest
import random

import pytest

from dlrover_core.master import replicas
from dlrover_core.master.replicas import ReplicaIndex, replica_sources


def test_the_examples_hold():
    assert doctest.testmod(replicas).failed == 0


@pytest.mark.parametrize(("members", "hosts", "sources"), [
    ([0, 1], {0: "a", 1: "b"}, {0: 1, 1: 0}),
    ([0, 1], {0: "a", 1: "a"}, {0: 1, 1: 0}),  # one host: still another node's memory
    ([0, 1, 2, 3], {0: "a", 1: "a", 2: "b", 3: "b"}, {0: 2, 1: 3, 2: 0, 3: 1}),
    ([0, 2, 5], {0: "a", 2: "b", 5: "c"}, {0: 5, 2: 0, 5: 2}),
    ([0, 1, 2], {0: "a", 1: "a", 2: "b"}, {0: 1, 1: 2, 2: 0}),  # host a runs 2 of 3: one pair shares it
    ([4], {4: "a"}, {4: None}),
])
def test_each_node_keeps_replicas_of_another_node_across_hosts(members, hosts, sources):
    assert {n: replica_sources(members, hosts).get(n) for n in members} == sources


@pytest.mark.parametrize("seed", range(50))
def test_placement_covers_every_node_once_across_hosts_seeded(seed):
    """Random rounds: every node's ranks are kept by exactly one other member; by one on
    another host whenever no host runs more than half of the members."""
    rng = random.Random(seed)
    members = sorted(rng.sample(range(40), rng.randint(2, 12)))
    hosts = {n: f"h{rng.randrange(rng.randint(1, 4))}" for n in members}
    source = {n: replica_sources(members, hosts).get(n) for n in members}
    assert all(s is not None and s != n and s in members for n, s in source.items())
    kept_by: dict[int, list[int]] = {}
    for holder, src in source.items():
        kept_by.setdefault(src, []).append(holder)
    assert sorted(kept_by) == members and all(len(h) == 1 for h in kept_by.values()), (source, hosts)
    largest = max(sum(1 for m in members if hosts[m] == hosts[n]) for n in members)
    if 2 * largest <= len(members):
        assert all(hosts[holder] != hosts[src] for holder, src in source.items()), (source, hosts)


def test_the_index_points_a_node_at_the_newest_replica_of_each_rank_and_forgets_lost_holders():
    index = ReplicaIndex()
    index.update(1, [(0, 0, 7, 2), (0, 1, 6, 2)])
    index.update(2, [(0, 0, 5, 2)])
    assert index.holders_for(0, [0, 1, 2]) == [(0, 0, 1), (1, 0, 1)]  # rank 2: none
    assert index.holders_for(1, [0]) == [(0, 0, 2)]  # never itself
    assert index.holders_for(0, [0], usable=lambda holder: holder != 1) == [(0, 0, 2)]
    index.update(1, [(0, 1, 8, 2)])  # holder 1 reports anew: rank 0 no longer held there
    assert index.holders_for(0, [0, 1]) == [(0, 0, 2), (1, 0, 1)]
    index.drop_holder(2)
    assert index.holders_for(0, [0]) == []
    assert index.held() == {(1, 0, 1): (8, 2)}


def test_the_index_prefers_the_current_lineage_to_a_higher_step_of_an_abandoned_one():
    """Round 2 went back to step 5: holder 1 still has rank 0's step 9 of round 1 (the
    abandoned lineage), holder 2 the current lineage's step 7. The replica to fetch is 7."""
    index = ReplicaIndex()
    index.update(1, [(0, 0, 9, 1)])
    index.update(2, [(0, 0, 7, 2)])
    assert index.holders_for(0, [0]) == [(0, 0, 2)]
