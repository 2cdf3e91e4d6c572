"""Node-check grouping and verdicts (DLRover's two-round pairing)."""

from __future__ import annotations

from dlrover_core.master.node_check import NodeCheckRun, pair_fastest_with_slowest, pair_neighbours
from dlrover_core.protocol import NodeCheckResult, decode


def test_neighbours_and_odd_node_out():
    assert pair_neighbours([3, 0, 2, 1]) == [[0, 1], [2, 3]]
    assert pair_neighbours([0, 1, 2]) == [[0, 1, 2]]
    assert pair_neighbours([5]) == [[5]]


def test_fastest_with_slowest():
    assert pair_fastest_with_slowest({0: 1.0, 1: 9.0, 2: 2.0, 3: float("inf")}) == [[0, 3], [2, 1]]
    assert pair_fastest_with_slowest({0: 1.0, 1: 2.0, 2: 3.0}) == [[0, 2, 1]]


def test_a_node_failing_both_rounds_is_faulty_and_slow_ones_straggle():
    """Node 1 breaks its neighbour's round-0 check too; round 1 pairs 0 with a good node,
    so only node 1 fails twice, with different partners. Node 3 is more than twice the
    median: a straggler."""
    run = NodeCheckRun(nodes=[0, 1, 2, 3, 4, 5])
    assert run.groups == [[0, 1], [2, 3], [4, 5]]
    for n, r in {0: (False, 0), 1: (False, 0), 2: (True, 1.0), 3: (True, 5.0), 4: (True, 1.1), 5: (True, 0.9)}.items():
        run.report(n, NodeCheckResult(ok=r[0], elapsed_s=r[1] if r[0] else float("inf")))
    assert run.round_done and run.next_round()
    assert run.groups == [[5, 1], [2, 0], [4, 3]]
    for n, r in {0: (True, 1.0), 1: (False, 0), 2: (True, 1.0), 3: (True, 4.0), 4: (True, 1.0), 5: (True, 1.0)}.items():
        run.report(n, NodeCheckResult(ok=r[0], elapsed_s=r[1] if r[0] else float("inf")))
    assert not run.next_round()
    faulty, stragglers, best = run.verdict()
    assert faulty == [1] and stragglers == [3] and best[3] == 4.0


def test_with_two_nodes_only_a_local_failure_blames_a_node():
    run = NodeCheckRun(nodes=[0, 1])
    for _ in range(2):
        run.report(0, NodeCheckResult(ok=False, local_ok=True, elapsed_s=float("inf")))
        run.report(1, NodeCheckResult(ok=False, local_ok=False, elapsed_s=float("inf")))
        run.next_round()
    faulty, stragglers, _ = run.verdict()
    assert faulty == [1] and stragglers == []


def test_a_result_off_the_wire_blames_its_node():
    """The agents' results arrive as JSON: a failed local part is seen however it decodes."""
    run = NodeCheckRun(nodes=[0, 1])
    for _ in range(2):
        run.report(0, decode(NodeCheckResult, {"ok": False, "local_ok": True}))
        run.report(1, decode(NodeCheckResult, {"ok": False, "local_ok": False}))
        run.next_round()
    assert run.verdict()[0] == [1]
