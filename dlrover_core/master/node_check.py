"""Node checks: find a faulty node and stragglers before training and after failures.

DLRover's network check, re-derived: nodes run their accelerator's check (a matmul and an
all-reduce) in small groups, twice.

* Round 0 pairs neighbours in node-id order ({0,1}, {2,3}, ...); an odd node out joins the
  last pair.
* Round 1 sorts the nodes by their round-0 time and pairs the fastest with the slowest, so a
  node that failed next to a bad neighbour gets a good one.
* A node whose local part of the check (the matmul) failed is faulty; so is a node whose
  group check failed in both rounds with different partners (DLRover's rule; with two
  nodes the partner cannot change, so only a local failure singles one out). A node whose
  best time exceeds twice the median of the best times is a straggler.

:class:`NodeCheckRun` is one check of a set of nodes; :class:`NodeChecks` is the master's
coordination of them: which nodes passed for which round, the check under way, the store of
its current round, and each node's order (its group) in the answer to a poll.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import attrs

from dlrover_core.logging import get_logger
from dlrover_core.protocol.messages import NodeCheckReport, NodeCheckResult, PollState, RoundAssignment

__all__ = ["NodeCheckRun", "NodeChecks", "Verdict", "pair_fastest_with_slowest", "pair_neighbours"]

log = get_logger()

ROUNDS = 2
STRAGGLER_FACTOR = 2.0


def pair_neighbours(node_ids: list[int]) -> list[list[int]]:
    """Groups of two in node-id order; an odd node out joins the last group."""
    ids = sorted(node_ids)
    if len(ids) < 2:
        return [ids] if ids else []
    groups = [ids[i : i + 2] for i in range(0, len(ids) - 1, 2)]
    if len(ids) % 2:
        groups[-1].append(ids[-1])
    return groups


def pair_fastest_with_slowest(elapsed: dict[int, float]) -> list[list[int]]:
    """Groups of two pairing the fastest with the slowest (a failed node counts as slowest)."""
    ids = sorted(elapsed, key=lambda n: (elapsed[n], n))
    if len(ids) < 2:
        return [ids] if ids else []
    groups = []
    lo, hi = 0, len(ids) - 1
    while lo < hi:
        groups.append([ids[lo], ids[hi]])
        lo, hi = lo + 1, hi - 1
    if lo == hi:
        groups[-1].append(ids[lo])
    return groups


@attrs.define
class NodeCheckRun:
    """One node check of a set of nodes: two rounds of groups, then a verdict."""

    nodes: list[int]
    round: int = 0
    groups: list[list[int]] = attrs.field(factory=list)
    results: list[dict[int, NodeCheckResult]] = attrs.field(factory=list)  # per round: node -> its result
    history: list[list[list[int]]] = attrs.field(factory=list)  # the groups of every round
    store_port: int = 0
    started: float = 0.0

    def __attrs_post_init__(self) -> None:
        if not self.groups:
            self.groups = pair_neighbours(self.nodes)
            self.results = [{}]
            self.history = [self.groups]

    def group_of(self, node_id: int) -> tuple[int, list[int]] | None:
        for index, group in enumerate(self.groups):
            if node_id in group:
                return index, group
        return None

    def report(self, node_id: int, result: NodeCheckResult) -> None:
        self.results[self.round][node_id] = result

    @property
    def round_done(self) -> bool:
        return set(self.results[self.round]) >= set(self.nodes)

    def next_round(self) -> bool:
        """Move to round 1 after round 0; False when both rounds are done."""
        if self.round + 1 >= ROUNDS or len(self.nodes) < 2:
            return False
        elapsed = {n: _elapsed(r) for n, r in self.results[0].items()}
        self.round += 1
        self.groups = pair_fastest_with_slowest(elapsed)
        self.history.append(self.groups)
        self.results.append({})
        return True

    def fail_missing(self) -> None:
        """Nodes that did not report in time failed this round."""
        for n in self.nodes:
            self.results[self.round].setdefault(n, NodeCheckResult(ok=False, elapsed_s=float("inf"), error="timed out"))

    def _partners(self, round_index: int, node: int) -> set[int]:
        return next((set(g) - {node} for g in self.history[round_index] if node in g), set())

    def verdict(self) -> tuple[list[int], list[int], dict[int, float]]:
        """``(faulty, stragglers, best elapsed seconds per node)``."""
        best: dict[int, float] = {}
        faulty = []
        for n in self.nodes:
            mine = [(i, r[n]) for i, r in enumerate(self.results) if n in r]
            if any(res.local_ok is not None and not res.local_ok for _, res in mine):  # its own part failed
                faulty.append(n)
                continue
            failed = [i for i, res in mine if not res.ok]
            partners_changed = len({frozenset(self._partners(i, n)) for i in failed}) > 1
            if mine and len(failed) == len(mine) and len(mine) == ROUNDS and partners_changed:
                faulty.append(n)
                continue
            oks = [_elapsed(res) for _, res in mine if res.ok]
            if oks:
                best[n] = min(oks)
        median = statistics.median(best.values()) if best else 0.0
        stragglers = [n for n, t in best.items() if len(best) > 1 and t > STRAGGLER_FACTOR * median]
        return sorted(faulty), sorted(stragglers), best


def _elapsed(result: NodeCheckResult) -> float:
    """Seconds a check took; a failed one (or one that did not say) counts as the slowest."""
    return result.elapsed_s if result.ok and result.elapsed_s is not None else float("inf")


@attrs.frozen(kw_only=True)
class Verdict:
    """How a node check ended.

    Attributes:
        nodes: the nodes checked.
        faulty: nodes whose device failed (exclude them).
        stragglers: nodes over twice the median of the best times.
        best_s: each healthy node's best time (seconds).
    """

    nodes: tuple[int, ...]
    faulty: list[int]
    stragglers: list[int]
    best_s: dict[int, float]


class NodeChecks:
    """The master's node checks (not thread-safe: the master holds its lock).

    Args:
        store_factory: makes a fresh TCPStore server (``(port, store)``) for each check round.
        store_host: address nodes use to reach the check stores.
        clock: monotonic seconds.
    """

    #: seconds a node-check round may take (a cold process start included)
    TIMEOUT_S = 120.0

    def __init__(self, *, store_factory: Callable[[], tuple[int, Any]], store_host: str,
                 clock: Callable[[], float]) -> None:
        self._store_factory = store_factory
        self._store_host = store_host
        self._clock = clock
        #: the check under way (``None``: none)
        self.run: NodeCheckRun | None = None
        self._store: tuple[int, Any] | None = None  # the current check round's store (kept alive)
        self._passed: dict[int, int] = {}  # node id -> the required round it was checked for

    def needed(self, nodes: list[int], required_round: int) -> bool:
        """Whether some of ``nodes`` was not checked for ``required_round`` yet."""
        return any(self._passed.get(n) != required_round for n in nodes)

    def start(self, nodes: list[int]) -> NodeCheckRun:
        """Start checking ``nodes`` (their first round's store is made now)."""
        port, store = self._store_factory()
        self._store = (port, store)
        self.run = NodeCheckRun(nodes=sorted(nodes), store_port=port, started=self._clock())
        return self.run

    def order(self, node_id: int) -> RoundAssignment | None:
        """The poll answer sending ``node_id`` to its check group (``None``: nothing to
        check for it now)."""
        run = self.run
        if run is None or node_id in run.results[run.round]:
            return None
        found = run.group_of(node_id)
        if found is None:
            return None
        index, group = found
        return RoundAssignment(state=PollState.CHECK, check_round=run.round, group=tuple(group),
                               group_rank=group.index(node_id), group_size=len(group), store_host=self._store_host,
                               store_port=run.store_port, prefix=f"check{run.round}/group{index}",
                               timeout_s=self.TIMEOUT_S)

    def report(self, message: NodeCheckReport) -> bool:
        """Record a node's result of the current round; whether it was one (a late or
        unknown report is ignored)."""
        run = self.run
        if run is None or message.check_round != run.round or message.node_id not in run.nodes:
            return False
        result = message.result
        run.report(message.node_id, result if result.ok else attrs.evolve(result, elapsed_s=float("inf")))
        return True

    def timed_out(self) -> bool:
        """Whether the current check round has run past :attr:`TIMEOUT_S`."""
        return self.run is not None and self._clock() - self.run.started > self.TIMEOUT_S

    def advance(self, required_round: int, *, timed_out: bool = False) -> Verdict | None:
        """Move on when the current round is complete (with ``timed_out``: nodes that did
        not report failed it): start the next round, or end the check for
        ``required_round`` and return its verdict."""
        run = self.run
        if run is None:
            return None
        if timed_out:
            run.fail_missing()
        if not run.round_done:
            return None
        if run.next_round():
            port, store = self._store_factory()
            self._store = (port, store)
            run.store_port, run.started = port, self._clock()
            log.info("node_check_round", round=run.round, groups=run.groups)
            return None
        faulty, stragglers, best = run.verdict()
        self.run, self._store = None, None
        for n in run.nodes:
            self._passed[n] = required_round
        return Verdict(nodes=tuple(run.nodes), faulty=faulty, stragglers=stragglers, best_s=best)
