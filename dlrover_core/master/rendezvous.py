"""Rendezvous rounds: which nodes train together, decided by the master.

Rules (DLRover's ``ElasticTrainingRendezvousManager`` and torch elastic's dynamic
rendezvous, re-derived):

* Nodes join the round being formed; each round is numbered, starting at 0.
* The round completes at once when ``max_nodes`` wait, or when every live node waits and
  that is at least ``min_nodes``.
* Otherwise, once at least ``min_nodes`` wait and no node joined for ``last_call_s``, it
  completes with the waiting nodes rounded down to a multiple of ``node_unit``.
* Nodes taken are the earliest joiners; the rest keep waiting for the next
  round. Node ranks follow node ids, so a node keeps its rank across restarts when the
  membership is unchanged.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable

import attrs

__all__ = ["RendezvousManager", "Round"]


@attrs.frozen(kw_only=True)
class Round:
    """A completed round: ``node_ids[i]`` has node rank ``i``; ``nproc[i]`` its workers.

    Rank look-ups take constant time (every agent of a 10,000-node round asks for its own):
    the node ranks and the rank offsets are computed once, when the round is made.
    """

    index: int
    node_ids: tuple[int, ...]
    nproc: tuple[int, ...]
    _ranks: dict[int, int] = attrs.field(init=False, eq=False, repr=False)
    _offsets: tuple[int, ...] = attrs.field(init=False, eq=False, repr=False)  # first global rank per node, then the world size

    def __attrs_post_init__(self) -> None:
        object.__setattr__(self, "_ranks", {node_id: i for i, node_id in enumerate(self.node_ids)})
        object.__setattr__(self, "_offsets", (0, *itertools.accumulate(self.nproc)))

    def __contains__(self, node_id: object) -> bool:
        """Whether ``node_id`` is a member of this round."""
        return node_id in self._ranks

    @property
    def world_size(self) -> int:
        return self._offsets[-1]

    def node_rank(self, node_id: int) -> int:
        """The node rank of ``node_id``; ``ValueError`` when it is not in the round."""
        try:
            return self._ranks[node_id]
        except KeyError:
            raise ValueError(f"node {node_id} is not in round {self.index}") from None

    def rank_offset(self, node_id: int) -> int:
        """The global rank of ``node_id``'s first worker."""
        return self._offsets[self.node_rank(node_id)]


class RendezvousManager:
    """Forms rounds from joining nodes. Not thread-safe: the master holds its lock."""

    def __init__(
        self,
        *,
        min_nodes: int,
        max_nodes: int,
        node_unit: int = 1,
        last_call_s: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 1 <= min_nodes <= max_nodes:
            raise ValueError(f"need 1 <= min_nodes <= max_nodes, got {min_nodes}, {max_nodes}")
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.node_unit = node_unit
        self.last_call_s = last_call_s
        self._clock = clock
        self._waiting: dict[int, tuple[int, int]] = {}  # node_id -> (join order, nproc)
        self._joins = 0
        self._last_join = 0.0
        self._forming_since: float | None = None
        self.latest: Round | None = None

    @property
    def next_index(self) -> int:
        """Index of the round being formed."""
        return 0 if self.latest is None else self.latest.index + 1

    @property
    def waiting(self) -> list[int]:
        return sorted(self._waiting)

    @property
    def waiting_count(self) -> int:
        """How many nodes wait, without sorting them (``len(waiting)``, in constant time)."""
        return len(self._waiting)

    def is_waiting(self, node_id: int) -> bool:
        """Whether ``node_id`` waits for the round being formed (``in waiting``, in constant time)."""
        return node_id in self._waiting

    @property
    def last_join(self) -> float:
        """When a node last joined (clock seconds)."""
        return self._last_join

    @property
    def forming_since(self) -> float | None:
        """When the first node of the round being formed joined (``None``: nobody waits)."""
        return self._forming_since

    def join(self, node_id: int, nproc: int) -> int:
        """``node_id`` waits for the next round with ``nproc`` workers; returns its index."""
        now = self._clock()
        if node_id not in self._waiting:
            self._joins += 1
            self._waiting[node_id] = (self._joins, nproc)
            self._last_join = now
            if self._forming_since is None:
                self._forming_since = now
        return self.next_index

    def restore(self, latest: Round | None) -> None:
        """Resume after a master restart: rounds continue from ``latest``; nobody waits."""
        self.latest = latest
        self._waiting.clear()
        self._forming_since = None
        self._last_join = self._clock()

    def open_round(self) -> None:
        """A new round is required now: its last-call window starts now, not at joins that
        happened while the previous round was still running."""
        now = self._clock()
        self._last_join = now
        if self._waiting:
            self._forming_since = now

    def leave(self, node_id: int) -> None:
        """Drop a waiting node (it died or was excluded)."""
        self._waiting.pop(node_id, None)
        if not self._waiting:
            self._forming_since = None

    def choose(self, live_nodes: int | None = None) -> list[int] | None:
        """The node ids the round would take now (earliest joiners), or ``None`` if it
        cannot complete yet. Changes nothing."""
        n = len(self._waiting)
        if n < self.min_nodes:
            return None
        if n >= self.max_nodes:
            take = self.max_nodes
        else:
            everyone = live_nodes is not None and n >= live_nodes
            if not everyone and self._clock() - self._last_join < self.last_call_s:
                return None
            take = n
        take = take // self.node_unit * self.node_unit
        if take < self.min_nodes:
            return None
        return sorted(self._waiting, key=lambda nid: self._waiting[nid][0])[:take]

    def try_complete(self, live_nodes: int | None = None) -> Round | None:
        """Complete the round being formed if the rules allow; return it or ``None``.

        Args:
            live_nodes: how many nodes are alive; when all of them wait the round need not
                wait for the last call.
        """
        chosen = self.choose(live_nodes)
        if chosen is None:
            return None
        node_ids = tuple(sorted(chosen))
        rnd = Round(index=self.next_index, node_ids=node_ids, nproc=tuple(self._waiting[n][1] for n in node_ids))
        for nid in node_ids:
            del self._waiting[nid]
        self._forming_since = self._clock() if self._waiting else None
        self.latest = rnd
        return rnd
