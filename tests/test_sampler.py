"""ElasticSampler: exactly once per epoch across world-size changes; accumulation steps."""

from __future__ import annotations

import pytest

from dlrover_core.train import ElasticSampler, accumulation_steps


def run_steps(state, world_size, steps, n=103, batch=4):
    samplers = [ElasticSampler(n, batch, seed=7, rank=r, world_size=world_size) for r in range(world_size)]
    if state is not None:
        for s in samplers:
            s.load_state_dict(state)
    seen = []
    for _ in range(steps):
        batches = [s.next_batch() for s in samplers]
        if batches[0] is None:
            break
        seen += [i for b in batches for i in b]
    return seen, samplers[0].state_dict()


def test_world_size_changes_keep_every_sample_exactly_once():
    """2 ranks, then 1 after a scale-down, then 3 after a scale-up: one epoch is the dataset."""
    a, state = run_steps(None, 2, steps=5)
    b, state = run_steps(state, 1, steps=7)
    c, state = run_steps(state, 3, steps=100)
    assert sorted(a + b + c) == list(range(103))
    assert state["consumed"] == 103


def test_epochs_reshuffle_and_drop_last():
    s = ElasticSampler(10, 3, seed=1, rank=0, world_size=1)
    first = [i for b in s for i in b]
    second = [i for b in s for i in b]
    assert sorted(first) == sorted(second) == list(range(10)) and first != second
    d = ElasticSampler(10, 3, seed=1, rank=0, world_size=1, drop_last=True)
    assert sum(len(b) for b in d) == 9


def test_mismatched_state_is_refused():
    s = ElasticSampler(10, 2, rank=0, world_size=1)
    with pytest.raises(ValueError, match="dataset_size=11"):
        s.load_state_dict({**s.state_dict(), "dataset_size": 11})
    with pytest.raises(ValueError, match="rank 2"):
        ElasticSampler(10, 2, rank=2, world_size=2)


def test_accumulation_steps_keep_the_global_batch():
    assert accumulation_steps(64, 4, world_size=2) == 8
    assert accumulation_steps(64, 4, world_size=4) == 4
    with pytest.raises(ValueError, match="multiple"):
        accumulation_steps(64, 4, world_size=3)
