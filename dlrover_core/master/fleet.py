"""The job's nodes as members of the job: admitted, fenced, lost, excluded, relaunched, or
too few to go on.

:class:`Fleet` is the job master's room for a node's fate (the node table keeps the records,
:mod:`~dlrover_core.master.nodes`): an agent that registers gets a new fencing token, and
every call of the node's earlier agents is answered ``stop`` from then on; a node silent past ``Failure.heartbeat_timeout_s``, or
whose agent its scheduler saw exit, is *lost* — its workers' failure is reported, and the
scheduler backend relaunches it; a node that failed ``Failure.max_node_failures`` times
within ``Failure.node_failure_window_s`` (or its node check) is *excluded* for good and a new
node replaces it; a relaunch is issued only after its decision is journaled, on a thread of
its own, and issued again when its node never registers; when fewer live nodes than
``nodes.min`` are left and none can come back, the job fails at once, naming them
(:func:`~dlrover_core.master.decisions.below_min_reason`). It acts through the master's
:class:`~dlrover_core.master.context.MasterContext`, under the master's lock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from dlrover_core.logging import get_logger
from dlrover_core.master.context import MasterContext
from dlrover_core.master.decisions import below_min_reason, waiting_message
from dlrover_core.master.nodes import NodeRecord
from dlrover_core.master.rendezvous import Round
from dlrover_core.protocol.events import EventKind
from dlrover_core.protocol.messages import FailureReport, NodeRelaunch, WorkerFailure
from dlrover_core.protocol.state import JobState

__all__ = ["Fleet"]

log = get_logger()


class Fleet:
    """A node's fate.

    Args:
        ctx: the master.
        relaunch: starts a (replacement) agent for a node id through the scheduler backend
            (``None``: the backend cannot; a lost node is then awaited, or the job fails
            below ``nodes.min``).
        report_failure: the master's failure call, for a lost member of the running round.
    """

    def __init__(self, ctx: MasterContext, *, relaunch: Callable[[NodeRelaunch], None] | None,
                 report_failure: Callable[[FailureReport], object]) -> None:
        self._ctx = ctx
        self._relaunch = relaunch
        self._relauncher = ThreadPoolExecutor(1, thread_name_prefix="dlrover-relaunch") if relaunch else None
        self._report_failure = report_failure
        self.last_token = 0  # the newest fencing token given to an agent
        self._assigned: dict[str, int] = {}  # launcher key -> node id handed out (AssignNode)
        # node ids awaited that no launcher will answer: lost in silence (their host died with
        # its launcher) or an excluded node's replacement; a new host's launcher takes one
        self._orphans: set[int] = set()
        self._unregistered: dict[int, float] = {}  # id handed out, no agent registered yet -> when (clock)

    # ----- joining the job -----------------------------------------------------------------

    def assign(self, key: str) -> int | None:
        """A host's launcher's node id (``dlrover run`` on each host: the master's relaunch of
        a node is a launcher starting its agent again). The same ``key`` gets the same id. A
        new key takes the lowest awaited id no launcher will answer (a node lost in silence,
        as a dead host is, or an excluded node's replacement), so ``dlrover run`` started on a
        new host stands in for the lost node as a scheduler's relaunch does: same node id,
        same ranks (a sharded job's shards), its replicas fetched from the buddy. The lost
        host's launcher, should it come back, then gets a new id; so does an id handed out whose
        agent never registered within the heartbeat timeout. Else one past every id known,
        or ``None`` while the job already has ``nodes.max`` nodes, live or awaited: the host
        waits (it asks again) until one is lost (it stands in for it) or leaves — a host started
        to replace a dead one usually comes before the master has declared that one lost.
        """
        node_id = self._assigned.get(key)
        if node_id is not None:
            return node_id
        ctx = self._ctx
        self._orphans &= set(ctx.book.relaunching)  # (one that came back is no orphan)
        # an id handed out whose agent never registered within the heartbeat timeout: its
        # launcher died before it started (else the job would look full for ever)
        now = ctx.clock()
        never = {n for n, at in self._unregistered.items() if now - at > ctx.job.heartbeat_timeout_s}
        if self._orphans or never:
            node_id = min(self._orphans | never)
            self._orphans.discard(node_id)
            self._assigned = {k: v for k, v in self._assigned.items() if v != node_id}
            self._assigned[key] = node_id
            self._unregistered[node_id] = now
            log.info("node_assigned", node_id=node_id, key=key, stands_in_for=node_id,
                     reason=ctx.book.gone_why.get(node_id, "awaited" if node_id in ctx.nodes else "never registered"))
            self._note_assigned(key, node_id)
            return node_id
        if len(ctx.nodes) + len(self._unregistered) >= ctx.job.nodes.max:  # (else it cannot be full: no scan)
            placed = ({n for n, rec in ctx.nodes.items() if not rec.gone} | set(ctx.book.relaunching)
                      | set(self._unregistered))
            if len(placed) >= ctx.job.nodes.max:
                return None
        known = max(max(ctx.nodes, default=-1), max(self._assigned.values(), default=-1))
        node_id = self._assigned[key] = known + 1
        self._unregistered[node_id] = now
        log.info("node_assigned", node_id=node_id, key=key)
        self._note_assigned(key, node_id)
        return node_id

    def _note_assigned(self, key: str, node_id: int) -> None:
        """Log the id handed out before the answer (a line, not a snapshot: every host asks
        once when the job starts): a restarted master gives the host the same id."""
        self._ctx.wal.note({"assigned": [key, node_id]}, node_id=node_id, point="node_assigned")

    def assigned_to_journal(self) -> dict[str, int]:
        """The launchers' keys and the node ids handed out to them (:meth:`assign`), for the
        master's snapshot: a host's launcher asks again after a master restart (to report
        its agent's exit, or to start it again) and must get the same id."""
        return dict(self._assigned)

    def register(self, node_id: int, *, host: str, pid: int, replica_addr: str = "") -> NodeRecord:
        """An agent starts for ``node_id``: it gets a new fencing token (from now on the
        node's earlier agents are fenced), and its relaunch, if one was on, is answered."""
        ctx = self._ctx
        node = ctx.node(node_id)
        if node.state != "excluded":
            node.state = "registered"
        node.host, node.pid, node.last_heartbeat = host, pid, ctx.clock()
        node.replica_addr = replica_addr
        ctx.replicas.drop_holder(node_id)  # a new agent holds none of its predecessor's replicas
        self._orphans.discard(node_id)  # its own launcher (or scheduler) answered
        self._unregistered.pop(node_id, None)
        self.last_token += 1  # (a counter: a scan of the node table per register is 10,000² at scale)
        node.token = self.last_token
        ctx.book.relaunching.pop(node_id, None)
        ctx.book.gone_why.pop(node_id, None)
        ctx.note_node(node)
        log.info("node_registered", node_id=node_id, host=host, pid=pid, token=node.token)
        return node

    def fenced(self, node_id: int, token: int | None) -> bool:
        """Whether a call for ``node_id`` carrying ``token`` comes from an agent that was
        replaced (a newer agent of that node registered). Calls without a token are not fenced."""
        node = self._ctx.nodes.get(node_id) if token is not None else None
        stale = node is not None and node.token > token  # type: ignore[operator]
        if stale:
            log.warning("agent_fenced", node_id=node_id, token=token, current=node.token)  # type: ignore[union-attr]
        return stale

    def restored(self, now: float, grace_s: float, current: Round | None,
                 assigned: Mapping[str, int] | None = None, assigned_after: Sequence[Sequence[Any]] = ()) -> None:
        """After a master restart: every node gets a heartbeat timeout plus ``grace_s`` to
        find the new master; a node that waited for a round the master does not remember
        rejoins; a node being relaunched is expected. ``assigned``: the snapshot's
        :meth:`assigned_to_journal` table, then the ``[key, node id]`` lines logged after it,
        in order (an id handed to a new key leaves the old one); an id handed out whose agent
        had not registered gets the same grace before another host may take it."""
        ctx = self._ctx
        self._assigned = {str(k): int(v) for k, v in (assigned or {}).items()}
        for key, node_id in assigned_after:
            self._assigned = {k: v for k, v in self._assigned.items() if v != int(node_id)}
            self._assigned[str(key)] = int(node_id)
        self._unregistered = {n: now + grace_s for n in self._assigned.values() if n not in ctx.nodes}
        self.last_token = max((n.token for n in ctx.nodes.values()), default=0)
        for node in ctx.nodes.values():
            node.last_heartbeat = now + grace_s
            untold = current is not None and node.node_id in current and node.round < current.index
            if node.state == "waiting" and not untold:  # it will poll again and find no round: make it rejoin
                node.state = "registered"
        for node_id in ctx.book.relaunching:
            node = ctx.node(node_id)
            if node.state in ("dead", "exited"):
                node.state = "registered"  # expected: silent until it starts (or relaunched again)
            node.last_heartbeat = now + grace_s

    # ----- failures counted against a node -------------------------------------------------

    def too_many_failures(self, node: NodeRecord) -> bool:
        f = self._ctx.job.failure
        return node.recent_failures(self._ctx.now_s(), f.node_failure_window_s) >= f.max_node_failures

    def failures_why(self, node: NodeRecord, *, lost: bool = False) -> str:
        f = self._ctx.job.failure
        recent = node.recent_failures(self._ctx.now_s(), f.node_failure_window_s)
        return (f"{'lost' if lost else 'it failed'} {recent} times in {f.node_failure_window_s:g} s "
                f"(failure.max_node_failures={f.max_node_failures}, failure.node_failure_window_s="
                f"{f.node_failure_window_s:g})")

    def exclude_if_failing(self, node: NodeRecord) -> None:
        """Exclude ``node`` if it failed too often lately."""
        if not node.gone and self.too_many_failures(node):
            self.exclude(node, self.failures_why(node))

    # ----- leaving the job ---------------------------------------------------------------

    def exclude(self, node: NodeRecord, why: str) -> None:
        """Take a node out of the job for good and ask for a replacement."""
        ctx = self._ctx
        node.state = "excluded"
        if ctx.livework.world is not None:
            ctx.livework.world.node_died(node.node_id)
        ctx.book.gone_why[node.node_id] = f"excluded: {why}"
        ctx.rdzv.leave(node.node_id)
        ctx.event(EventKind.NODE_EXCLUDED, level="warning", node_id=node.node_id, reason=why)
        replacement = max(ctx.nodes) + 1
        ctx.node(replacement).state = "registered"  # expected; silent until it starts
        self._orphans.add(replacement)  # (no launcher has it yet: a new host's may take it)
        ctx.note_node(node, point="node_excluded")
        self.relaunch(replacement, replaces=node.node_id, reason=f"node {node.node_id} excluded: {why}")

    def lose(self, node: NodeRecord, silent_s: float, *, why: str = "") -> None:
        """``node`` is gone: silent for ``silent_s`` (or ``why``: its scheduler saw its agent
        exit). A member of the running round: its workers' failure is reported; then the
        node is excluded (too many failures), relaunched, or the job checks it has enough."""
        ctx = self._ctx
        silent = not why
        why = why or f"no heartbeat for {silent_s:.0f} s"
        node.state = "dead"
        ctx.replicas.drop_holder(node.node_id)  # its memory is gone with it
        ctx.book.gone_why[node.node_id] = f"lost ({why})"
        ctx.rdzv.leave(node.node_id)
        ctx.event(EventKind.NODE_LOST, level="warning", node_id=node.node_id, silent_s=round(silent_s, 1), reason=why)
        rnd, world = ctx.rdzv.latest, ctx.livework.world
        member = rnd is not None and (node.node_id in rnd or (world is not None and world.has_node(node.node_id)))
        if member and rnd.index >= ctx.required_round:  # type: ignore[union-attr]
            self._report_failure(FailureReport(node_id=node.node_id, round=rnd.index, failures=(  # type: ignore[union-attr]
                WorkerFailure(kind="node_lost", detail=why),)))
        else:
            node.failed(ctx.now_s())
        ctx.note_node(node, point="node_lost")
        if ctx.state.is_terminal or node.state == "excluded":
            return
        if self.too_many_failures(node):
            self.exclude(node, self.failures_why(node, lost=True))
        elif self._relaunch is not None:
            if silent:  # its host fell silent, launcher and all (only dlrover run's hosts ask for ids)
                self._orphans.add(node.node_id)
            self.relaunch(node.node_id, replaces=node.node_id, reason=f"node {node.node_id} was lost")
        else:
            self.check_below_min()

    def find_silent(self, now: float) -> None:
        """Nodes silent past the heartbeat timeout are lost (a relaunch never answered is
        issued again)."""
        ctx = self._ctx
        timeout = ctx.job.heartbeat_timeout_s
        for node in list(ctx.nodes.values()):
            silent = now - node.last_heartbeat
            if (node.state == "dead" and silent > timeout and node.node_id in ctx.book.relaunching
                    and node.node_id not in self._orphans):  # (also after a master restart: no keys known)
                if self._assigned:  # (dlrover run's hosts: they ask for ids)
                    log.warning("node_relaunch_unanswered", node_id=node.node_id, silent_s=round(silent, 1),
                                then="a new host's dlrover run may stand in for it")
                self._orphans.add(node.node_id)  # its host's launcher did not start it again
            if node.gone or silent <= timeout:
                continue
            if node.node_id in ctx.book.relaunching:  # ordered, never registered: maybe never issued
                log.warning("node_relaunch_unanswered", node_id=node.node_id, silent_s=round(silent, 1))
                self._orphans.add(node.node_id)  # (an excluded node's replacement no host took yet)
                self.relaunch(node.node_id, replaces=node.node_id,
                              reason=f"the relaunch of node {node.node_id} was not answered")
            else:
                self.lose(node, silent)

    # ----- relaunches --------------------------------------------------------------------

    def relaunch(self, node_id: int, *, replaces: int | None = None, reason: str = "") -> None:
        """Order a (replacement) agent for ``node_id``, issued once the decision is journaled;
        past ``failure.max_restarts + nodes.max`` relaunches the job fails instead."""
        ctx = self._ctx
        if self._relauncher is None or self._relaunch is None:
            return
        cap = ctx.job.failure.max_restarts + ctx.job.nodes.max
        if ctx.nodes.relaunches() >= cap:
            ctx.finish(JobState.FAILED, f"gave up relaunching nodes after {cap} relaunches "
                                        "(failure.max_restarts + nodes.max)")
            return
        node = ctx.node(node_id)
        node.relaunches += 1
        node.last_heartbeat = ctx.clock()  # give the new agent a full timeout to start
        ctx.book.relaunching[node_id] = ctx.clock()
        ctx.event(EventKind.NODE_RELAUNCHED, node_id=node_id, replaces=replaces)
        ctx.note_node(node, point="relaunch_issued")
        request = NodeRelaunch(node_id=node_id, replaces=replaces, reason=reason, attempt=node.relaunches - 1)
        relauncher = self._relauncher
        ctx.wal.after(lambda: relauncher.submit(self._relaunch_now, request))

    def _relaunch_now(self, request: NodeRelaunch) -> None:
        """The relaunch, on the relauncher's thread; a backend's refusal leaves the node missing."""
        ctx = self._ctx
        try:
            self._relaunch(request)  # type: ignore[misc]
        except Exception as exc:
            node_id = request.node_id
            with ctx.wal.batch():
                ctx.event(EventKind.NODE_RELAUNCH_FAILED, level="error", node_id=node_id,
                          error=f"{type(exc).__name__}: {exc}")
                ctx.book.relaunching.pop(node_id, None)
                ctx.book.gone_why.setdefault(node_id, f"its relaunch failed ({type(exc).__name__}: {exc})")
                ctx.note_node(ctx.node(node_id))
                self.check_below_min()

    def coming(self) -> list[int]:
        """Gone nodes whose relaunch was ordered: they may come back."""
        ctx = self._ctx
        return sorted(n for n in ctx.book.relaunching if n in ctx.nodes and ctx.nodes[n].state in ("dead", "exited"))

    # ----- enough nodes? -------------------------------------------------------------------

    def check_below_min(self) -> None:
        """Fail the job at once when fewer than ``nodes.min`` nodes are live and no relaunch
        ordered can make up for it (before the first round, nodes may still be starting)."""
        ctx = self._ctx
        rnd = ctx.rdzv.latest
        if ctx.state.is_terminal or rnd is None:
            return
        book, nodes = ctx.book, ctx.nodes
        # members of the running round that finished need not come back for it to succeed
        done = sum(1 for n in book.succeeded if nodes.is_gone(n)) if rnd.index >= ctx.required_round else 0
        lost = any(nodes[n].state == "dead" for n in book.gone_why if n in nodes)
        reason = below_min_reason(
            live=[n.node_id for n in nodes.live()], coming=len(self.coming()), done=done, min_nodes=ctx.job.nodes.min,
            gone_why={n: why for n, why in book.gone_why.items() if nodes.is_gone(n)},
            lost_without_relaunch=lost and self._relaunch is None)
        if reason is not None:
            ctx.finish(JobState.FAILED, reason)

    def waiting_message(self) -> str:
        """While a round must form with fewer live nodes than ``nodes.min``: what it waits for."""
        ctx = self._ctx
        rnd = ctx.rdzv.latest
        if ctx.state.is_terminal or (rnd is not None and rnd.index >= ctx.required_round):
            return ""
        return waiting_message(live=[n.node_id for n in ctx.nodes.live()], coming=self.coming(),
                               min_nodes=ctx.job.nodes.min)
