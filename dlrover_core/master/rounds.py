"""Rendezvous rounds as the job master runs them: :class:`Rounds`.

A round forms only when one is required — the first, or after a restart or membership
change raised ``required_round`` — out of the nodes waiting in the rendezvous
(:mod:`~dlrover_core.master.rendezvous` decides who), after a node check when the job asks
for one (:mod:`~dlrover_core.master.node_check`). Each round gets a fresh TCPStore (its
workers never meet a dead incarnation's keys) and opens its live world
(:mod:`~dlrover_core.master.live`). A node polling for its place is told it once the round
formed; a node relaunched while the live world runs without it joins that world instead.
With ``Nodes(min < max)``, nodes that wait while a smaller round runs make every node restart
into a bigger one. It acts through the master's
:class:`~dlrover_core.master.context.MasterContext`, under the master's lock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from dlrover_core.logging import get_logger
from dlrover_core.master.context import MasterContext
from dlrover_core.master.fleet import Fleet
from dlrover_core.master.nodes import NodeRecord
from dlrover_core.master.rendezvous import Round
from dlrover_core.master.replicas import replica_sources
from dlrover_core.protocol.events import EventKind
from dlrover_core.protocol.messages import PollState, RoundAssignment
from dlrover_core.protocol.state import JobState

__all__ = ["Rounds", "StoreFactory", "StoreReopener"]

log = get_logger()

#: Returns ``(port, store)`` of a fresh TCPStore server for a new round.
StoreFactory = Callable[[], tuple[int, Any]]
#: Opens a TCPStore server again on a given port: a restarted master reopens the running
#: round's store where its workers look for it. Raises when the port is taken.
StoreReopener = Callable[[int], Any]


class Rounds:
    """The rounds of one job.

    Args:
        ctx: the master.
        fleet: excludes the nodes a node check finds faulty.
        store_factory: makes a fresh TCPStore server per round.
        reopen_store: reopens a round's store on its port after a master restart (``None``:
            a node that needs the running round's store makes every node restart instead).
    """

    def __init__(self, ctx: MasterContext, *, fleet: Fleet, store_factory: StoreFactory,
                 reopen_store: StoreReopener | None) -> None:
        self._ctx = ctx
        self._fleet = fleet
        self._store_factory = store_factory
        self._reopen_store = reopen_store
        self.stores: dict[int, tuple[int, Any]] = {}  # round -> (port, store server)
        self._sources: tuple[int, dict[int, int]] | None = None  # (round, node -> its replica source)

    # ----- joining and polling ------------------------------------------------------------

    def join(self, node: NodeRecord, nproc: int) -> int:
        """``node`` joins the next round (a join retried after it formed this round keeps
        it); returns the round's number."""
        ctx = self._ctx
        rnd = ctx.rdzv.latest
        if (rnd is not None and rnd.index >= ctx.required_round and node.node_id in rnd and node.state == "waiting"
                and node.round < rnd.index and not ctx.rdzv.is_waiting(node.node_id)):
            return rnd.index
        node.state = "waiting"
        index = ctx.rdzv.join(node.node_id, nproc)
        ctx.goodput.joined(ctx.clock())
        log.info("rendezvous_joined", node_id=node.node_id, round=index, waiting=ctx.rdzv.waiting_count)
        self.try_complete()
        return index

    def poll(self, node: NodeRecord) -> RoundAssignment:
        """Whether the round ``node`` waits for is complete; if so, its place in it (or a
        node check to run, or the live world to join)."""
        ctx = self._ctx
        self.try_complete()
        answer = ctx.node_checks.order(node.node_id) or self.live_join(node)
        if answer is not None:
            return answer
        rnd = ctx.rdzv.latest
        if rnd is None or not self._placed(node, rnd):
            # not in a round yet, or the master restarted meanwhile and forgot it waits
            return RoundAssignment(state=PollState.WAITING if ctx.rdzv.is_waiting(node.node_id) else PollState.REJOIN)
        store = self.stores.get(rnd.index)
        if store is None:  # the round's store died with the master before this one
            self.new_round(f"the store of round {rnd.index} died with the previous job master")
            return RoundAssignment(state=PollState.REJOIN)
        if node.state != "running":
            node.state, node.round = "running", rnd.index
            ctx.note_node(node, point="node_placed")
        node_rank = rnd.node_rank(node.node_id)
        return RoundAssignment(
            state=PollState.READY, round=rnd.index, node_rank=node_rank, num_nodes=len(rnd.node_ids),
            rank_offset=rnd.rank_offset(node.node_id), nproc=rnd.nproc[node_rank], world_size=rnd.world_size,
            store_host=ctx.store_host, store_port=store[0], restart_count=ctx.book.restarts,
            max_restarts=ctx.job.failure.max_restarts, **self._replica_fields(node, rnd))

    def _ranks(self, rnd: Round, node_id: int) -> range:
        offset = rnd.rank_offset(node_id)
        return range(offset, offset + rnd.nproc[rnd.node_rank(node_id)])

    def replica_source(self, node: NodeRecord, round_index: int) -> dict[str, Any]:
        """Whose snapshots ``node`` keeps replicas of in round ``round_index``, at the
        source's address now (``replica_source*`` fields; none when replicas are off or the
        round is not the running one)."""
        ctx = self._ctx
        rnd = ctx.rdzv.latest
        if (rnd is None or rnd.index != round_index or node.node_id not in rnd
                or not ctx.job.checkpoint.replicas_for(ctx.job.nodes.max) or not node.replica_addr):
            return {}
        if self._sources is None or self._sources[0] != rnd.index:  # once per round, not per poll
            hosts = {n: ctx.node(n).host for n in rnd.node_ids}
            self._sources = (rnd.index, replica_sources(list(rnd.node_ids), hosts))
        source = self._sources[1].get(node.node_id)
        if source is None or not ctx.node(source).replica_addr:
            return {}
        return {"replica_source": source, "replica_source_addr": ctx.node(source).replica_addr,
                "replica_source_ranks": tuple(self._ranks(rnd, source))}

    def replica_holders(self, node_id: int, ranks: Iterable[int]) -> list[tuple[int, int, int]]:
        """Where the newest replica of each of ``ranks`` (run by ``node_id``) is, among the
        holders that can still be asked (not gone, serving): ``(rank, source node, holder)``
        (:meth:`ReplicaIndex.holders_for`); ranks without one are left out."""
        ctx = self._ctx

        def usable(holder: int) -> bool:
            rec = ctx.nodes.get(holder)
            return rec is not None and not rec.gone and bool(rec.replica_addr)

        return ctx.replicas.holders_for(node_id, ranks, usable=usable)

    def _replica_fields(self, node: NodeRecord, rnd: Round) -> dict[str, Any]:
        """Whose snapshots ``node`` keeps replicas of in ``rnd``, and where its own ranks'
        replicas are (:mod:`~dlrover_core.master.replicas`); none when replicas are off."""
        ctx = self._ctx
        if not ctx.job.checkpoint.replicas_for(ctx.job.nodes.max) or not node.replica_addr:
            return {}
        fields: dict[str, Any] = dict(self.replica_source(node, rnd.index))
        holders = self.replica_holders(node.node_id, self._ranks(rnd, node.node_id))
        if holders:
            fields["replica_holders"] = tuple((rank, src, ctx.node(holder).replica_addr) for rank, src, holder in holders)
        return fields

    def _placed(self, node: NodeRecord, rnd: Round) -> bool:
        """A member of the running round, not told yet (waiting), or told already (running)
        but asking again: its answer was lost, e.g. with a master that died."""
        ctx = self._ctx
        return (rnd.index >= ctx.required_round and node.node_id in rnd and not ctx.rdzv.is_waiting(node.node_id)
                and ((node.state == "waiting" and node.round < rnd.index)
                     or (node.state == "running" and node.round == rnd.index)))

    def live_join(self, node: NodeRecord) -> RoundAssignment | None:
        """A node waiting to join while the live world runs without it (relaunched after it
        was lost, or a replacement of an excluded one) joins that world: its workers start as
        replacements. ``None``: the rendezvous decides as usual."""
        ctx = self._ctx
        live, rnd = ctx.livework.world, ctx.rdzv.latest
        if (live is None or live.closed or rnd is None or rnd.index != live.round or rnd.index < ctx.required_round
                or not ctx.rdzv.is_waiting(node.node_id) or live.has_node(node.node_id) or live.can_go_on()
                or len(live.nodes()) >= ctx.job.nodes.max or rnd.index not in self.stores):
            return None  # (can_go_on: every member loops with train.steps(), or the rendezvous decides)
        nproc = ctx.job.nodes.nproc_per_node if isinstance(ctx.job.nodes.nproc_per_node, int) else rnd.nproc[0]
        ctx.rdzv.leave(node.node_id)
        node.state, node.round = "running", rnd.index
        ctx.note_node(node, point="node_placed")
        ctx.event(EventKind.LIVE_NODE_JOINING, node_id=node.node_id, round=rnd.index, nproc=nproc)
        # the workers' RANK/WORLD_SIZE until train.steps() gives them their place: their
        # slots' at the round's start (a node new to the round: after every other)
        if node.node_id in rnd:
            node_rank, offset, world_size = rnd.node_rank(node.node_id), rnd.rank_offset(node.node_id), rnd.world_size
        else:
            node_rank, offset, world_size = len(rnd.node_ids), rnd.world_size, rnd.world_size + nproc
        return RoundAssignment(
            state=PollState.READY, round=rnd.index, node_rank=node_rank, num_nodes=len(rnd.node_ids),
            rank_offset=offset, nproc=nproc, world_size=world_size, store_host=ctx.store_host,
            store_port=self.stores[rnd.index][0], restart_count=ctx.book.restarts,
            max_restarts=ctx.job.failure.max_restarts, live_join=True,
            # a sharded world's replacements load their shards from memory: fetched first from
            # the buddy that kept replicas of this node's ranks
            **(self._replica_fields(node, rnd) if node.node_id in rnd else {}))

    # ----- forming -------------------------------------------------------------------------

    def try_complete(self) -> Round | None:
        """Form the required round if its nodes are there (after a node check when asked)."""
        ctx = self._ctx
        if ctx.state.is_terminal or ctx.rdzv.next_index > ctx.required_round or ctx.node_checks.run is not None:
            return None
        # the first round does not know who else will come: no early completion by "all
        # live nodes joined", only at max nodes or after the last call
        live = len(ctx.nodes.live()) if ctx.rdzv.latest is not None and self._need_live_count() else None
        if ctx.job.failure.node_check:
            chosen = ctx.rdzv.choose(live_nodes=live)
            if chosen is not None and ctx.node_checks.needed(chosen, ctx.required_round):
                self._start_check(chosen)
                return None
        rnd = ctx.rdzv.try_complete(live_nodes=live)
        if rnd is not None:
            self._formed(rnd)
        return rnd

    def _formed(self, rnd: Round) -> None:
        """A round formed: its store, its live world, the job running."""
        ctx = self._ctx
        port, store = self._store_factory()
        self.stores[rnd.index] = (port, store)
        for old in [i for i in self.stores if i < rnd.index - 1]:
            del self.stores[old]  # drop the server of rounds long gone
        ctx.book.succeeded = set()
        ctx.book.required_round = rnd.index
        members = [(nid, lr) for nid, n in zip(rnd.node_ids, rnd.nproc, strict=True) for lr in range(n)]
        ctx.livework.open(rnd.index, members, port, store)
        if ctx.state == JobState.PENDING:
            ctx.book.state = JobState.RUNNING
        ctx.goodput.round_completed(ctx.clock(), ctx.started)
        ctx.rate.round_started()
        ctx.event(EventKind.RENDEZVOUS_COMPLETED, round=rnd.index, node_ids=list(rnd.node_ids),
                  world_size=rnd.world_size, store_port=port)
        ctx.wal.decided("round_formed")

    def _need_live_count(self) -> bool:
        """Whether the round being formed could complete early because every live node
        waits: only then does it need the count of live nodes, a scan of the node table that
        every poll of a 10,000-node rendezvous would otherwise pay."""
        rdzv = self._ctx.rdzv
        waiting = rdzv.waiting_count
        return rdzv.min_nodes <= waiting < rdzv.max_nodes and self._ctx.clock() - rdzv.last_join < rdzv.last_call_s

    # ----- restarts and membership changes -------------------------------------------------

    def restart(self, round_index: int) -> None:
        """Every worker restarts into the round after ``round_index`` (a failure's restart,
        counted by the caller)."""
        ctx = self._ctx
        ctx.book.required_round = round_index + 1
        ctx.rdzv.open_round()
        ctx.livework.close("every worker restarts")
        ctx.wal.decided("restart_decided")

    def new_round(self, why: str) -> None:
        """The running round cannot go on (a member left, its store is gone): every node
        restarts into a new round. A membership change, not counted as a failure."""
        ctx = self._ctx
        rnd = ctx.rdzv.latest
        if ctx.state.is_terminal or rnd is None or rnd.index < ctx.required_round:
            return
        self._change_membership(rnd, why, to_nodes=len(ctx.nodes.live()))

    def scale_up(self, now: float) -> None:
        """Nodes wait while a smaller-than-max round runs: restart into a bigger round."""
        ctx = self._ctx
        rnd, nodes = ctx.rdzv.latest, ctx.job.nodes
        if (ctx.state != JobState.RUNNING or rnd is None or rnd.index < ctx.required_round
                or not ctx.rdzv.waiting_count or len(rnd.node_ids) >= nodes.max
                or now - ctx.rdzv.last_join < nodes.last_call_s):
            return
        waiting = ctx.rdzv.waiting
        bigger = min(nodes.max, len(rnd.node_ids) + len(waiting)) // nodes.node_unit * nodes.node_unit
        if bigger > len(rnd.node_ids):
            self._change_membership(rnd, f"the job grows to {bigger} nodes", to_nodes=bigger, waiting=waiting)

    def _change_membership(self, rnd: Round, why: str, *, to_nodes: int, **data: Any) -> None:
        """Every node restarts into the round after ``rnd`` (not counted as a failure)."""
        ctx = self._ctx
        ctx.book.required_round = rnd.index + 1
        ctx.rdzv.open_round()
        ctx.livework.close(why)
        ctx.event(EventKind.MEMBERSHIP_CHANGED, round=ctx.required_round, from_nodes=len(rnd.node_ids),
                  to_nodes=to_nodes, reason=why, **data)
        ctx.wal.decided("membership_changed")

    def unknown(self, node_id: int, round_index: int) -> None:
        """An agent runs a round this master never formed (its predecessor died before the
        round reached the journal: a failed write). Its members cannot be told apart from
        the others, so every node restarts into a round numbered past it (not counted)."""
        ctx = self._ctx
        log.warning("round_unknown", node_id=node_id, round=round_index,
                    known=ctx.rdzv.latest.index if ctx.rdzv.latest is not None else None)
        ctx.rdzv.restore(Round(index=round_index, node_ids=(), nproc=()))
        ctx.book.required_round = round_index + 1
        ctx.rdzv.open_round()
        ctx.event(EventKind.MEMBERSHIP_CHANGED, round=ctx.required_round,
                  reason=f"round {round_index} is unknown to the master")
        ctx.wal.decided("membership_changed")

    # ----- node checks ---------------------------------------------------------------------

    def _start_check(self, nodes: list[int]) -> None:
        run = self._ctx.node_checks.start(nodes)
        self._ctx.event(EventKind.NODE_CHECK_STARTED, nodes=run.nodes, groups=run.groups)

    def advance_check(self, *, timed_out: bool = False) -> None:
        """Go on with the node check; when it is over, exclude the faulty nodes (and the
        stragglers, if asked)."""
        ctx = self._ctx
        verdict = ctx.node_checks.advance(ctx.required_round, timed_out=timed_out)
        if verdict is None:
            return
        best = {str(k): round(v, 3) for k, v in verdict.best_s.items()}
        ctx.event(EventKind.NODE_CHECK_FINISHED, faulty=verdict.faulty, stragglers=verdict.stragglers, best_s=best)
        for n in verdict.faulty:
            self._fleet.exclude(ctx.node(n), "it failed the node check twice")
        if ctx.job.failure.exclude_stragglers:
            for n in verdict.stragglers:
                self._fleet.exclude(ctx.node(n), f"it is a straggler (node check {verdict.best_s[n]:.2f} s, over "
                                                 "twice the median)")

    # ----- a restarted master --------------------------------------------------------------

    def reopen(self, round_index: int, port: int) -> None:
        """Open the running round's store again on its port (taken meanwhile: a node that
        needs it makes every node restart)."""
        if self._reopen_store is None:
            return
        try:
            self.stores[round_index] = (port, self._reopen_store(port))
            log.info("round_store_reopened", round=round_index, port=port)
        except Exception as exc:
            log.warning("round_store_lost", round=round_index, port=port, error=f"{type(exc).__name__}: {exc}")
