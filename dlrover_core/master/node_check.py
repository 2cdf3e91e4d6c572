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
"""

from __future__ import annotations

import statistics

import attrs

__all__ = ["NodeCheckRun", "pair_fastest_with_slowest", "pair_neighbours"]

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
    results: list[dict[int, dict]] = attrs.field(factory=list)  # per round: node -> {ok, local_ok, elapsed_s}
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

    def report(self, node_id: int, result: dict) -> None:
        self.results[self.round][node_id] = result

    @property
    def round_done(self) -> bool:
        return set(self.results[self.round]) >= set(self.nodes)

    def next_round(self) -> bool:
        """Move to round 1 after round 0; False when both rounds are done."""
        if self.round + 1 >= ROUNDS or len(self.nodes) < 2:
            return False
        elapsed = {n: r["elapsed_s"] if r.get("ok") else float("inf") for n, r in self.results[0].items()}
        self.round += 1
        self.groups = pair_fastest_with_slowest(elapsed)
        self.history.append(self.groups)
        self.results.append({})
        return True

    def fail_missing(self) -> None:
        """Nodes that did not report in time failed this round."""
        for n in self.nodes:
            self.results[self.round].setdefault(n, {"ok": False, "elapsed_s": float("inf"), "error": "timed out"})

    def _partners(self, round_index: int, node: int) -> set[int]:
        return next((set(g) - {node} for g in self.history[round_index] if node in g), set())

    def verdict(self) -> tuple[list[int], list[int], dict[int, float]]:
        """``(faulty, stragglers, best elapsed seconds per node)``."""
        best: dict[int, float] = {}
        faulty = []
        for n in self.nodes:
            mine = [(i, r[n]) for i, r in enumerate(self.results) if n in r]
            if any(res.get("local_ok") is False for _, res in mine):
                faulty.append(n)
                continue
            failed = [i for i, res in mine if not res.get("ok")]
            partners_changed = len({frozenset(self._partners(i, n)) for i in failed}) > 1
            if mine and len(failed) == len(mine) and len(mine) == ROUNDS and partners_changed:
                faulty.append(n)
                continue
            oks = [res["elapsed_s"] for _, res in mine if res.get("ok")]
            if oks:
                best[n] = min(oks)
        median = statistics.median(best.values()) if best else 0.0
        stragglers = [n for n, t in best.items() if len(best) > 1 and t > STRAGGLER_FACTOR * median]
        return sorted(faulty), sorted(stragglers), best
