"""The live world of a round: its generations of worker process groups (docs/design.md §5a).

A rendezvous round starts generation 0: its workers, ranked as the round ranks them. When
a worker dies, the survivors' collectives fail and each asks for its place in the next
generation (:class:`~dlrover_core.protocol.messages.LiveReform`, reason ``error``); the
generation forms as soon as every member not known dead has asked (the agents report
worker exits), or after ``straggler_timeout_s`` without those that did not ask (they come
back later as joiners: they still hold their state). A replacement asks with ``join``: the
master sets the running generation's ``grow_key`` in the round's store, the members end the
generation at their next step boundary (reason ``grow``) and the next one includes it.

Members that finished the last step say ``done``; a replacement still waiting then is told
``finished`` (nothing is left to train: it exits 0).

Only a worker that holds the training state can give it to the others: the round's own
workers, and a replacement once it received the state (it says ``caught_up``; asking with
``replica=True`` says the same). A generation never forms without one, and when every
holder is gone — died while sending the state to a replacement, say — :meth:`LiveWorld.can_go_on`
says so, and the master restarts every worker from the newest checkpoint instead.

Ranks follow worker slots ``(node_id, local_rank)`` in order, so a world that grows back to
its full size has the ranks it started with. Not thread-safe: the master holds its lock.

:class:`LiveRecovery` is the master's side of it: the running round's world, opened with the
round and closed when every worker restarts, and what the master asks it (replace failed
workers, place a worker asking for its generation), with the events that say what happened.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs

from dlrover_core.logging import get_logger
from dlrover_core.master.decisions import LiveAnswer
from dlrover_core.protocol.events import EventKind
from dlrover_core.protocol.messages import LiveAssignment, LiveReform, WorkerFailure

__all__ = ["LiveRecovery", "LiveWorld", "Slot", "Transition", "resume_step"]

log = get_logger()

#: A worker slot: ``(node_id, local_rank)``.
Slot = tuple[int, int]


@attrs.frozen(kw_only=True)
class Transition:
    """One generation formed: its number, size, why, and when (master clock seconds)."""

    generation: int
    world_size: int
    reason: str
    time: float
    opened: float


class LiveWorld:
    """The generations of one round.

    Args:
        round_index: the round.
        members: the round's worker slots in rank order (generation 0).
        store_host, store_port: the round's TCPStore.
        set_key: sets a key in the round's store (the grow flag, the abort flag).
        clock: the master's clock (seconds).
        straggler_timeout_s: how long a forming generation waits for a member that neither
            asked nor is known dead.
        sharded: the training state is sharded (``JobSpec.live_sharded``): the world keeps
            its size and forms again only whole, at a common resume step
            (:meth:`_try_form_whole`).
        replica_groups: a sharded world's groups of ranks that hold the same shard
            (``JobSpec.replica_groups``: HSDP's replicate dimension); a replacement may
            resume after any step a live member of its group can give it.
    """

    def __init__(
        self,
        *,
        round_index: int,
        members: list[Slot],
        store_host: str,
        store_port: int,
        set_key: Callable[[str], None],
        clock: Callable[[], float],
        straggler_timeout_s: float,
        sharded: bool = False,
        replica_groups: Sequence[Sequence[int]] = (),
    ) -> None:
        self.round = round_index
        self.sharded = sharded
        self.replica_groups = [list(g) for g in replica_groups]
        self.generation = 0
        self.members: list[Slot] = list(members)
        self.store_host, self.store_port = store_host, store_port
        self._set_key = set_key
        self._clock = clock
        self.straggler_timeout_s = straggler_timeout_s
        self.ready: set[Slot] = set()
        self.done: set[Slot] = set()  # members that finished the last step
        self.holders: set[Slot] = set(members)  # members known to hold the training state
        self.dead: dict[Slot, int | None] = {}  # member slot -> pid that died (None: unknown)
        self.arrived: dict[Slot, LiveReform] = {}
        self.forming_since: float | None = None
        self._grow_flagged = -1  # the generation whose grow key is set
        self._aborted = -1  # the generation whose abort key is set
        self.closed = ""  # why the live world ended (the round restarts every worker)
        self.transitions: list[Transition] = []
        self._placed: dict[Slot, tuple[int, LiveAssignment]] = {}  # slot -> (pid, its newest assignment)
        self.resume_step: int | None = None  # a sharded world: the step its last generation resumed after

    # ----- what the master asks ------------------------------------------------------------

    def survivors(self) -> list[Slot]:
        """Members of the running generation not known dead."""
        return [m for m in self.members if m not in self.dead]

    def can_go_on(self) -> str:
        """``""`` when the survivors can be re-formed without stopping, else why not."""
        if self.closed:
            return self.closed
        if self.done:  # a replacement would wait for peers that have left train.steps()
            return (f"worker(s) {', '.join(f'node {n} local rank {lr}' for n, lr in sorted(self.done)[:4])} finished "
                    "the last step: a replacement has no running world to join")
        alive = self.survivors()
        if not alive:
            return "no worker of the round survived"
        if not any(m in self.holders for m in alive) and not any(a.replica for a in self.arrived.values()):
            return (f"no surviving worker holds the training state: {_slots(alive)} "
                    f"{'is a replacement' if len(alive) == 1 else 'are replacements'} that had not received it "
                    "when the last worker holding it died")
        missing = [m for m in alive if m not in self.ready]
        if missing:
            return (f"worker(s) {', '.join(f'node {n} local rank {lr}' for n, lr in missing[:4])} do not loop with "
                    "train.steps() (or have not reached it yet)")
        return ""

    def lost_shards(self, node_id: int, has_replica: Callable[[int, int], bool]) -> str:
        """``""``, or why a sharded world cannot go on live without node ``node_id``'s memory:
        a rank that ran there whose shard no other node holds — neither a replica of its
        snapshots in another node's memory (``has_replica(node_id, rank)``: the master's
        replica index) nor a live member of its replica group holding the training state.
        Known at the loss, not when the relaunched node asks to join (seconds later, and a
        second restart counted for one failure)."""
        if not self.sharded:
            return ""
        group_of = {r: group for group in self.replica_groups for r in group}
        bare = []
        for rank, (node, _) in enumerate(self.members):
            if node != node_id:
                continue
            peers = [self.members[p] for p in group_of.get(rank, ()) if p != rank and p < len(self.members)]
            if any(m[0] != node_id and m not in self.dead and m in self.holders for m in peers):
                continue
            if not has_replica(node_id, rank):
                bare.append(rank)
        if not bare:
            return ""
        ranks = ", ".join(map(str, bare[:8])) + (" ..." if len(bare) > 8 else "")
        return (f"rank(s) {ranks} of a sharded world died with node {node_id} and no other node holds "
                f"{'its' if len(bare) == 1 else 'their'} shard in memory (no replica of its snapshots: "
                "checkpoint.replicas=0, or none pulled yet; no replica-group peer); every worker restarts from a "
                "checkpoint")

    def worker_died(self, slot: Slot, pid: int | None = None) -> None:
        """A member (or a joiner) died: a forming generation does not wait for it.

        A member's death is normally seen by its peers' collectives (the connection resets),
        but not always: a survivor sending the state to a replacement that dies waits in
        gloo for the replacement to be ready for the next tensor, for ever. So the running
        generation's abort key is set, as for a lost node (:meth:`node_died`)."""
        if slot in self.members:
            member = slot in self.survivors()
            self.dead[slot] = pid
            self.holders.discard(slot)
            if member and self.survivors() and self._aborted < self.generation:
                self._aborted = self.generation
                self._set_key(self.abort_key(self.generation))
                log.info("live_abort_requested", round=self.round, generation=self.generation, slot=slot)
        waiting = self.arrived.get(slot)
        if waiting is not None and (pid is None or waiting.pid == pid):
            del self.arrived[slot]
        self.ready.discard(slot)
        self._try_form()

    def node_died(self, node_id: int) -> None:
        """Every worker of ``node_id`` died with it (the node was lost or its agent exited).

        Its workers may be alive but cut off (a network partition): the survivors' collectives
        would then wait for them until the collective timeout, as no connection reset comes.
        So the running generation's abort key is set: each node's first worker watches it
        and shuts down its group's connections (``process_group.sever_group``), and the
        survivors re-form at once."""
        if any(m[0] == node_id for m in self.survivors()) and self._aborted < self.generation:
            self._aborted = self.generation
            self._set_key(self.abort_key(self.generation))
            log.info("live_abort_requested", round=self.round, generation=self.generation, node_id=node_id)
        for slot in [m for m in self.members if m[0] == node_id] + [a for a in self.arrived if a[0] == node_id]:
            if slot in self.members:
                self.dead[slot] = None
                self.holders.discard(slot)
            self.arrived.pop(slot, None)
            self.ready.discard(slot)
        self._try_form()

    def has_node(self, node_id: int) -> bool:
        """Whether a live member of the running generation runs on ``node_id``."""
        return any(m[0] == node_id for m in self.survivors())

    def nodes(self) -> set[int]:
        """The nodes of the running generation's live members."""
        return {m[0] for m in self.survivors()}

    def close(self, why: str) -> None:
        """The round restarts every worker: every later question is answered ``restart``."""
        self.closed = why

    def tick(self) -> None:
        self._try_form()

    # ----- what workers ask -------------------------------------------------------------

    def reform(self, message: LiveReform) -> LiveAssignment:
        slot = (message.node_id, message.local_rank)
        if self.closed:
            return LiveAssignment(state="restart", reason=self.closed)
        placed = self._placed.get(slot)
        if placed is not None and placed[0] == message.pid and placed[1].generation > message.generation:
            return placed[1]  # asked again after it was placed (or an answer was lost)
        if message.reason == "caught_up":  # a replacement received the state: it can give it on
            if slot in self.members and slot not in self.dead and message.generation == self.generation:
                self.holders.add(slot)
            return self._assignment(slot) if slot in self.members else LiveAssignment(state="waiting")
        if message.replica and slot in self.members and slot not in self.dead:
            self.holders.add(slot)
        if message.reason == "done":  # it finished the last step
            if slot in self.members:
                self.done.add(slot)
            return LiveAssignment(state="finished", reason="training finished")
        if self.done and slot not in self.members:
            return LiveAssignment(state="finished", reason="training finished before this worker could join")
        if message.reason == "ready" and message.error:  # this worker cannot be re-formed: why
            self.close(message.error)
            return LiveAssignment(state="restart", reason=message.error)
        if message.reason == "ready":
            if message.generation == self.generation and slot in self.members and slot not in self.dead:
                self.ready.add(slot)
                return self._assignment(slot)
            return LiveAssignment(state="restart", reason=f"worker {slot} is not in generation {self.generation}")
        if self._stale(slot, message):
            return LiveAssignment(state="restart", reason=f"worker {slot} was declared dead")
        self.arrived[slot] = message
        now = self._clock()
        if message.reason == "join" or slot not in self.members:  # a replacement, or a straggler left out
            if self._grow_flagged < self.generation:
                self._grow_flagged = self.generation
                self._set_key(self.grow_key(self.generation))
                log.info("live_grow_requested", round=self.round, generation=self.generation, node_id=slot[0],
                         local_rank=slot[1])
        elif self.forming_since is None:
            self.forming_since = now
        self._try_form()
        if self.closed:  # (a sharded world that cannot form again)
            return LiveAssignment(state="restart", reason=self.closed)
        placed = self._placed.get(slot)
        if placed is not None and placed[0] == message.pid and placed[1].generation > message.generation:
            return placed[1]
        return LiveAssignment(state="waiting")

    def _stale(self, slot: Slot, message: LiveReform) -> bool:
        """Whether ``message`` comes from an incarnation of ``slot`` that was replaced or
        declared dead (a replacement asks "join"): its exit was seen (its pid); a newer
        process holds the slot in a formed generation; or, in a sharded world, its node was
        lost (pid unknown) and this is the lost incarnation, still running a moment (a
        machine's processes do not all die at once) or cut off. Placed, the generation would
        die with it, and a world that forms only whole would wait for a slot its relaunched
        node is not asked to fill. (A replicated world may take a lost node's worker back: a
        thawed host's worker rejoins in place, and one that dies leaves the world smaller.)"""
        if message.reason == "join":
            return slot in self.dead and self.dead[slot] == message.pid
        if slot in self.dead:
            return self.dead[slot] == message.pid or (self.sharded and self.dead[slot] is None)
        placed = self._placed.get(slot)
        return placed is not None and slot in self.members and placed[0] != message.pid

    # ----- forming ------------------------------------------------------------------------

    @staticmethod
    def grow_key(generation: int) -> str:
        return f"live/grow/{generation}"

    @staticmethod
    def abort_key(generation: int) -> str:
        """Set when generation ``generation`` must end at once (a member node was lost)."""
        return f"live/abort/{generation}"

    def _assignment(self, slot: Slot) -> LiveAssignment:
        return LiveAssignment(
            state="ready", generation=self.generation, rank=self.members.index(slot), world_size=len(self.members),
            store_host=self.store_host, store_port=self.store_port, prefix=f"live/{self.generation}/",
            grow_key=self.grow_key(self.generation), resume_step=self.resume_step)

    def _try_form_whole(self) -> None:
        """A sharded world forms again only whole: every slot of the running generation,
        each survivor and a replacement in each dead one (same rank, same shard), at the
        newest step every one of them can resume from (:func:`resume_step`). A survivor
        that does not ask within ``straggler_timeout_s`` cannot be left out (nobody else
        holds its shard), nor can a step be found that every rank holds: the world closes
        and every worker restarts."""
        now = self._clock()
        if self.forming_since is None:
            self.forming_since = now
        opened = self.forming_since
        missing = [m for m in self.members if m not in self.arrived]
        late = [m for m in self.survivors() if m not in self.arrived]
        if late and now - opened >= self.straggler_timeout_s and any(m in self.arrived for m in self.survivors()):
            self.close(f"{_slots(late)} of a sharded world did not ask to re-form within {self.straggler_timeout_s:g} s; "
                       "nobody else holds their shards")
            return
        if missing or not any(m.replica for m in self.arrived.values()):
            return
        peers = {self.members[r]: [self.members[p] for p in group if p != r]
                 for group in self.replica_groups for r in group if r < len(self.members)}
        step, why = resume_step(self.arrived, peers)
        if step is None:
            self.close(why)
            log.warning("live_resume_impossible", round=self.round, generation=self.generation, reason=why)
            return
        pids = {s: self.arrived[s].pid for s in self.members}
        reasons = {m.reason for m in self.arrived.values()}
        self.generation += 1
        self.resume_step = step
        self.ready = set(self.members)
        self.holders = {s for s in self.members if self.arrived[s].replica}
        self.dead, self.arrived, self.forming_since = {}, {}, None
        for s in self.members:
            self._placed[s] = (pids[s], self._assignment(s))
        reason = "error" if "error" in reasons else "grow"
        self.transitions.append(Transition(generation=self.generation, world_size=len(self.members), reason=reason,
                                           time=now, opened=opened))
        log.info("live_generation_formed", round=self.round, generation=self.generation,
                 world_size=len(self.members), reason=reason, wait_s=round(now - opened, 4), resume_step=step)

    def _try_form(self) -> None:
        if self.closed or not self.arrived:
            return
        if self.sharded:
            self._try_form_whole()
            return
        survivors = self.survivors()
        came = [m for m in survivors if m in self.arrived]
        if not any(m.replica for m in self.arrived.values()):
            return  # only replacements wait: the members end the generation at a step boundary
        if not came and survivors:
            return  # a straggler left out earlier waits like a replacement, for the members
        now = self._clock()
        opened = self.forming_since if self.forming_since is not None else now
        if len(came) < len(survivors) and now - opened < self.straggler_timeout_s:
            return
        if len(came) < len(survivors):
            late = [m for m in survivors if m not in self.arrived]
            log.warning("live_stragglers_left_out", round=self.round, generation=self.generation + 1, slots=late,
                        waited_s=round(now - opened, 2))
        reasons = {m.reason for m in self.arrived.values()}
        reason = "error" if "error" in reasons else ("grow" if "grow" in reasons or "join" in reasons else "error")
        new = sorted(self.arrived)
        self.generation += 1
        self.members = new
        self.ready = set(new)  # every one of them asked from inside train.steps()
        self.holders = {s for s in new if self.arrived[s].replica}
        pids = {s: self.arrived[s].pid for s in new}
        self.dead = {}
        self.arrived = {}
        self.forming_since = None
        for s in new:
            self._placed[s] = (pids[s], self._assignment(s))
        self.transitions.append(Transition(generation=self.generation, world_size=len(new), reason=reason, time=now,
                                           opened=opened))
        log.info("live_generation_formed", round=self.round, generation=self.generation, world_size=len(new),
                 reason=reason, wait_s=round(now - opened, 4))


def resume_step(asked: dict[Slot, LiveReform],
                peers: dict[Slot, list[Slot]] | None = None) -> tuple[int | None, str]:
    """The newest step every member of a sharded world can resume after, and ``""``; or
    ``None`` and why there is none.

    A member holding the training state can resume after the step it applied (its state is
    there) or after any step of its memory snapshots (it goes back in place: its two slots
    hold its last two snapshots); a replacement after a step of its node's snapshots of its
    rank, or, where ``peers`` names the members that hold its shard too (HSDP's replicate
    group), after any step such a member holding the training state can resume after: that
    member hands it the state (``train.peer``). Resuming at the newest such step recomputes
    the fewest steps (none when every rank's snapshot is as new as the survivors' state, or
    every replacement has a live replica peer)."""
    own: dict[Slot, set[int]] = {}
    for slot, m in asked.items():
        steps = set(m.memory_steps)
        if m.replica and m.step >= 0:
            steps.add(m.step)
        if m.replica and m.step < 0 and not steps:
            steps.add(-1)  # nothing trained yet: a fresh start is a state too
        own[slot] = steps
    options = {slot: set(steps) for slot, steps in own.items()}
    for slot, m in asked.items():
        if not m.replica:
            for peer in (peers or {}).get(slot, ()):
                if peer in asked and asked[peer].replica:
                    options[slot] |= own[peer]
    common = set.intersection(*options.values()) if options else set()
    if common:
        return max(common), ""
    bare = sorted(s for s, steps in options.items() if not steps)
    if bare:
        return None, (f"{_slots(bare)} of a sharded world {'has' if len(bare) == 1 else 'have'} no snapshot in memory "
                      "to resume from; every worker restarts from a checkpoint")
    held = "; ".join(f"node {n} local rank {lr}: {sorted(v)[-3:]}" for (n, lr), v in sorted(options.items())[:4])
    return None, (f"no step that every rank of a sharded world can resume after ({held}); "
                  "every worker restarts from a checkpoint")


class LiveRecovery:
    """The live world of the running round, as the job master uses it.

    Args:
        why_not: why this job's failures are never recovered live (``""``: they may be;
            from the spec: ``failure.live_recovery=False``, a sharded strategy).
        store_host: where workers reach the rounds' stores.
        clock: the master's clock (seconds).
        event: the master's event sink (``kind, **data``: logged and kept in events.jsonl).
        straggler_timeout_s, sharded: see :class:`LiveWorld`.
        replica_groups: a world size's groups of ranks holding the same shard
            (``JobSpec.replica_groups``; see :class:`LiveWorld`).
        has_replica: ``(node_id, rank) -> bool``: whether another node, not lost, holds a
            replica of the snapshots of ``rank`` that ran on ``node_id`` (a sharded world
            goes on live after a node's loss only where each of its ranks has one, or a
            replica-group peer: :meth:`LiveWorld.lost_shards`).
    """

    def __init__(self, *, why_not: str, store_host: str, clock: Callable[[], float],
                 event: Callable[..., None], straggler_timeout_s: float, sharded: bool = False,
                 replica_groups: Callable[[int], list[list[int]]] = lambda _world_size: [],
                 has_replica: Callable[[int, int], bool] = lambda _node_id, _rank: True) -> None:
        self.why_not = why_not
        self.has_replica = has_replica
        self.sharded = sharded
        self._replica_groups = replica_groups
        self.world: LiveWorld | None = None
        self._store_host = store_host
        self._clock = clock
        self._event = event
        self._straggler_timeout_s = straggler_timeout_s
        self._told = 0  # transitions of the world already turned into events
        # (round, node_id, local_rank) of the workers told to end ("restart", "stop"): each
        # exits at once (``dlrover_core.train.live``), on this master's order, not failing
        self._sent_away: set[tuple[int, int, int]] = set()

    @property
    def why_not_now(self) -> str:
        """Why a failure of the running round is not recovered live (``""``: it may be): the
        job's reason (:attr:`why_not`), else why the round's live world closed (a worker
        said it cannot be re-formed, a sharded world found no step to resume...)."""
        return self.why_not or (self.world.closed if self.world is not None else "")

    @property
    def open_round(self) -> int | None:
        """The round whose live world is open (``None``: none, or it closed)."""
        return self.world.round if self.world is not None and not self.world.closed else None

    def open(self, round_index: int, members: Sequence[Slot], port: int, store: Any) -> None:
        """A round formed: its generation 0 (none when the job is never live, or the store
        cannot hold the flags)."""
        self.close(f"round {round_index} started")
        self.world, self._told = None, 0
        if self.why_not or store is None or not hasattr(store, "set"):
            return
        self.world = LiveWorld(round_index=round_index, members=list(members), store_host=self._store_host,
                               store_port=port, set_key=lambda key: store.set(key, "1"), clock=self._clock,
                               straggler_timeout_s=self._straggler_timeout_s, sharded=self.sharded,
                               replica_groups=self._replica_groups(len(members)) if self.sharded else ())

    def close(self, why: str) -> None:
        """Every worker restarts: the live world answers ``restart`` from now on."""
        if self.world is not None and not self.world.closed:
            self.world.close(why)

    def unavailable(self, round_index: int, why: str) -> None:
        """The round's failure cannot be recovered live: close, and say why."""
        self.close(why)
        self._event(EventKind.LIVE_RECOVERY_UNAVAILABLE, round=round_index, reason=why)

    def replace(self, node_id: int, failures: Sequence[WorkerFailure]) -> LiveAnswer:
        """Mark the failed workers (a node's, when a failure names no local rank) dead; the
        survivors go on if the world can (else it closes, saying why)."""
        world = self.world
        assert world is not None
        lost = any(f.local_rank is None for f in failures)
        if lost:
            world.node_died(node_id)
        else:
            for f in failures:
                world.worker_died((node_id, int(f.local_rank)))  # type: ignore[arg-type]
        why = world.can_go_on() or (world.lost_shards(node_id, self.has_replica) if lost else "")
        if why:
            self.unavailable(world.round, why)
            return LiveAnswer(replaced=False, why=why)
        self.progress()
        return LiveAnswer(replaced=True, survivors=len(world.survivors()))

    def node_left(self, round_index: int, node_id: int) -> str | None:
        """A node of ``round_index`` left (its agent exited): ``None`` without a live world
        for the round, else why the others cannot go on live without it (``""``: they can)."""
        world = self.world
        if world is None or world.closed or world.round != round_index:
            return None
        world.node_died(node_id)
        why = world.can_go_on() or world.lost_shards(node_id, self.has_replica)
        if not why:
            self.progress()
        return why

    def reform(self, message: LiveReform, *, ended: str, required_round: int) -> LiveAssignment:
        """A worker asks for its place in the next generation. ``ended``: the job's end
        state (``""``: running)."""
        if ended:
            answer = LiveAssignment(state="stop", reason=f"the job ended {ended}")
        elif (world := self.world) is None or world.round != message.round or message.round < required_round:
            answer = LiveAssignment(state="restart", reason=self.why_not or "every worker restarts into a new round")
        else:
            answer = world.reform(message)
            self.progress()
        if answer.state in ("restart", "stop") and message.reason != "ready":  # (it exits: train/live.py)
            self._sent_away.add((message.round, message.node_id, message.local_rank))
        return answer

    def sent_away_to_journal(self) -> list[list[int]]:
        """The workers told to end, ``[round, node_id, local_rank]`` each, for the master's
        snapshot (soft state: written with the next snapshot, not before the answer; one
        lost in a crash only lists that worker's exit as a consequence)."""
        return [list(key) for key in sorted(self._sent_away)]

    def load_sent_away(self, entries: Iterable[Sequence[int]]) -> None:
        """:meth:`sent_away_to_journal`'s list, after a master restart."""
        self._sent_away |= {(int(r), int(n), int(lr)) for r, n, lr in entries}

    def sent_away(self, round_index: int, node_id: int, local_rank: int | None) -> bool:
        """Whether the worker at ``local_rank`` of ``node_id`` in ``round_index`` was told
        to end (:meth:`reform` answered "restart" or "stop"): its exit is this master's
        order carried out, not a failure."""
        return local_rank is not None and (round_index, node_id, local_rank) in self._sent_away

    def tick(self) -> None:
        if self.world is not None:
            self.world.tick()
            self.progress()

    def progress(self) -> None:
        """Turn newly formed generations into events."""
        world = self.world
        if world is None:
            return
        for t in world.transitions[self._told:]:
            self._event(EventKind.LIVE_REFORMED, level="debug", round=world.round, generation=t.generation, world_size=t.world_size,
                        reason=t.reason, wait_s=round(t.time - t.opened, 4))
        self._told = len(world.transitions)


def _slots(slots: list[Slot]) -> str:
    """``worker(s) node 1 local rank 0, ...`` (the first four)."""
    return "worker(s) " + ", ".join(f"node {n} local rank {lr}" for n, lr in slots[:4]) + (
        f" and {len(slots) - 4} more" if len(slots) > 4 else "")
