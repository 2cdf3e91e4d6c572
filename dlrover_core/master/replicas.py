"""Where every rank's snapshot replicas are (issue 28): the buddy placement of a round and
the index of the replicas the agents report holding. Pure: no lock, clock or I/O.

* **Placement.** In a round, each node keeps replicas of one *source* node
  (:func:`replica_source`): every node's ranks are replicated on exactly one other node,
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

from collections.abc import Iterable, Mapping, Sequence

__all__ = ["ReplicaIndex", "replica_source"]


def replica_source(node_id: int, members: Sequence[int], hosts: Mapping[int, str]) -> int | None:
    """The node whose ranks ``node_id`` keeps replicas of, in a round of ``members`` (node
    ids) on ``hosts``; ``None`` when it is alone (or not a member).

    The members in (host, node id) order, each keeps the replicas of the member ``k`` places
    before it (wrapping), ``k`` the size of the largest host's group (1 on a single host):
    every member's ranks are kept by exactly one other member, and on another host whenever
    no host runs more than half of the members (where one does, some of its nodes keep each
    other's: no placement could do better).

    >>> replica_source(0, [0, 1, 2, 3], {0: "a", 1: "a", 2: "b", 3: "b"})
    2
    >>> replica_source(2, [0, 1, 2, 3], {0: "a", 1: "a", 2: "b", 3: "b"})
    0
    >>> replica_source(1, [0, 1], {0: "a", 1: "a"})
    0
    """
    if node_id not in members or len(members) < 2:
        return None
    order = sorted(members, key=lambda n: (hosts.get(n, ""), n))
    groups: dict[str, int] = {}
    for n in order:
        groups[hosts.get(n, "")] = groups.get(hosts.get(n, ""), 0) + 1
    k = max(groups.values())
    if k >= len(order):
        k = 1
    return order[(order.index(node_id) - k) % len(order)]


class ReplicaIndex:
    """The replicas each holder node reported: ``(holder, node, rank) -> (step, round)``."""

    def __init__(self) -> None:
        self._held: dict[tuple[int, int, int], tuple[int, int]] = {}

    def update(self, holder: int, held: Iterable[tuple[int, int, int, int]]) -> None:
        """``holder`` holds exactly ``held`` (``(node, rank, step, round)`` each) now."""
        for key in [k for k in self._held if k[0] == holder]:
            del self._held[key]
        for node_id, rank, step, round_index in held:
            self._held[(holder, node_id, rank)] = (step, round_index)

    def drop_holder(self, holder: int) -> None:
        """``holder`` is gone, and its memory with it."""
        self.update(holder, ())

    def holders_for(self, node_id: int, ranks: Iterable[int], *, usable: Mapping[int, bool] | None = None,
                    ) -> list[tuple[int, int, int]]:
        """For each of ``ranks`` (the ranks ``node_id`` runs), where its newest replica is:
        ``(rank, the node whose rank it was, holder)``; ranks without one are left out.
        ``usable``: holder -> whether it can be asked (not gone); missing: yes."""
        out = []
        for rank in ranks:
            best = None
            for (holder, src, r), (step, _) in self._held.items():
                if r != rank or holder == node_id or (usable is not None and not usable.get(holder, True)):
                    continue
                if best is None or step > best[0]:
                    best = (step, src, holder)
            if best is not None:
                out.append((rank, best[1], best[2]))
        return out

    def held(self) -> dict[tuple[int, int, int], tuple[int, int]]:
        """A copy of the index (status, tests)."""
        return dict(self._held)
