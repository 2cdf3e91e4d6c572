"""Who sends a sharded world's replacement its state (``train.peer.sources``): for each rank
that needs it, the lowest other member of its replica group that holds it; a group with no
holder left is an error every member raises alike. Pure: no process group."""

from __future__ import annotations

import pytest

from dlrover_core.train.peer import sources
from dlrover_core.train.reform import LiveRecoveryError

GROUPS = [[0, 2], [1, 3]]  # HSDP: data=2 x replicate=2


@pytest.mark.parametrize(("needs", "groups", "want"), [
    ((), GROUPS, {}),  # nobody needs anything: no transfer
    ((3,), GROUPS, {3: 1}),  # rank 3's shard is rank 1's
    ((2, 3), GROUPS, {2: 0, 3: 1}),  # a lost node: each shard's other replica sends
    ((0,), [[0, 2, 4], [1, 3, 5]], {0: 2}),  # the lowest holder, never the needing rank itself
    ((0, 2), [[0, 2, 4], [1, 3, 5]], {0: 4, 2: 4}),  # one holder sends to two
])
def test_each_needing_rank_gets_the_state_from_the_lowest_holder_of_its_group(needs, groups, want):
    world_size = sum(len(g) for g in groups)
    places = [(7, rank in needs) for rank in range(world_size)]
    assert sources(places, groups) == want


@pytest.mark.parametrize(("needs", "groups"), [
    ((1, 3), GROUPS),  # both replicas of one shard need it
    ((1,), []),  # no replicate dimension: nobody else holds rank 1's shard
])
def test_a_shard_no_live_member_holds_is_an_error_that_names_the_rank(needs, groups):
    places = [(7, rank in needs) for rank in range(4)]
    with pytest.raises(LiveRecoveryError, match=f"rank {needs[0]} needs its shard"):
        sources(places, groups)
