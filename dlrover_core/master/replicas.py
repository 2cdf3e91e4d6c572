"""Where every rank's snapshot replicas are (issue 28): the buddy placement of a round and
the index of the replicas the agents report holding. Pure: no lock, clock or I/O.

* **Placement.** In a round, each node keeps replicas of one *source* node
  (:func:`replica_sources`): every node's ranks are replicated on exactly one other node,
  across hosts wherever no host runs more than half of the nodes (a host that dies then
  takes no rank's only copy with it).
* **Index.** Each heartbeat says which replicas its node holds, ``(node, rank, step,
  round)``; the index keeps, per rank, the newest one of every holder. A holder that is lost
  takes its replicas with it (:meth:`ReplicaIndex.drop_holder`).
* **Fetch.** A node starting a round asks where its ranks' replicas are
  (:meth:`ReplicaIndex.holders_for`): the newest replica of each of its ranks, on a holder
  that is not the node itself.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence

__all__ = ["ReplicaIndex", "replica_sources"]


def replica_sources(members: Sequence[int], hosts: Mapping[int, str]) -> dict[int, int]:
    """Whose ranks each member keeps replicas of, in a round of ``members`` (node ids) on
    ``hosts``: member -> its source (empty for a round of one). Computed once per round.

    The members in (host, node id) order, each keeps the replicas of the member ``k`` places
    before it (wrapping), ``k`` the size of the largest host's group (1 on a single host):
    every member's ranks are kept by exactly one other member, and on another host whenever
    no host runs more than half of the members (where one does, some of its nodes keep each
    other's: no placement could do better).

    >>> replica_sources([0, 1, 2, 3], {0: "a", 1: "a", 2: "b", 3: "b"})
    {0: 2, 1: 3, 2: 0, 3: 1}
    >>> replica_sources([0, 1], {0: "a", 1: "a"})
    {0: 1, 1: 0}
    """
    if len(members) < 2:
        return {}
    order = sorted(members, key=lambda n: (hosts.get(n, ""), n))
    k = max(Counter(hosts.get(n, "") for n in order).values())
    if k >= len(order):
        k = 1
    return {n: order[(i - k) % len(order)] for i, n in enumerate(order)}


class ReplicaIndex:
    """The replicas each holder node reported, kept by rank (a lookup touches one rank's
    holders, not the whole job's)."""

    def __init__(self) -> None:
        self._by_holder: dict[int, list[tuple[int, int, int, int]]] = {}
        self._by_rank: dict[int, dict[int, tuple[int, int, int]]] = {}  # rank -> holder -> (step, round, node)

    def update(self, holder: int, held: Iterable[tuple[int, int, int, int]]) -> None:
        """``holder`` holds exactly ``held`` (``(node, rank, step, round)`` each) now."""
        for _, rank, _, _ in self._by_holder.pop(holder, ()):
            holders = self._by_rank.get(rank, {})
            holders.pop(holder, None)
            if not holders:
                self._by_rank.pop(rank, None)
        held = list(held)
        if held:
            self._by_holder[holder] = held
        for node_id, rank, step, round_index in held:
            self._by_rank.setdefault(rank, {})[holder] = (step, round_index, node_id)

    def drop_holder(self, holder: int) -> None:
        """``holder`` is gone, and its memory with it."""
        self.update(holder, ())

    def holders_for(self, node_id: int, ranks: Iterable[int], *, usable: Callable[[int], bool] = lambda h: True,
                    ) -> list[tuple[int, int, int]]:
        """For each of ``ranks`` (the ranks ``node_id`` runs), where its newest replica is:
        ``(rank, the node whose rank it was, holder)``; ranks without one are left out.
        Newest as the agents rank their slots: a later round's first (after a restore to an
        older step, the replica of the abandoned lineage may still carry a higher step), then
        the step. ``usable(holder)``: whether that holder can be asked (not gone)."""
        out = []
        for rank in ranks:
            best = max(((round_index, step, src, holder)
                        for holder, (step, round_index, src) in self._by_rank.get(rank, {}).items()
                        if holder != node_id and usable(holder)), default=None)
            if best is not None:
                out.append((rank, best[2], best[3]))
        return out

    def held(self) -> dict[tuple[int, int, int], tuple[int, int]]:
        """``(holder, node, rank) -> (step, round)`` (status, tests)."""
        return {(holder, node_id, rank): (step, round_index)
                for holder, held in self._by_holder.items() for node_id, rank, step, round_index in held}
