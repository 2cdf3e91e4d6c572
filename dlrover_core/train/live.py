"""Recovery without stopping, on the worker's side: ``train.steps()`` (docs/design.md §5a).

::

    for step in train.steps(args.steps, state, start=start):   # step is an int
        with step:                                                 # the step's guard
            ...forward, backward, optimizer.step(), report, save...

When a peer dies, the collective the worker is in raises ("Connection closed by peer").
The guard catches it: the worker aborts its process group (so that peers blocked on it fail
too, instead of waiting for the collective timeout), asks the master for its place in the
next *generation* of the live world (:class:`~dlrover_core.protocol.messages.LiveReform`),
joins the new, smaller process group on the round's store under the generation's prefix,
rebuilds the DDP wrappers ``train.prepare()`` made (:class:`~dlrover_core.parallel.ddp.ReplicatedModule`),
and goes on. Nothing is reloaded: model, optimizer, LR schedule, RNG and data position stay
in memory.

Consistency (the step in flight): an optimizer update is *applied* when
``optimizer.step()`` returned (a post hook records the step). A step whose body failed
before that is discarded — its data position is rolled back to the step's start — and a
step some survivors applied (their all-reduce completed before the peer died) is rolled
forward on the others: after every re-form, the members all-gather their last applied
step and the lowest rank holding the newest broadcasts its whole state (model, optimizer,
schedulers, samplers: every ``state`` entry with ``state_dict()``) to the ranks behind.
The same broadcast gives a replacement (a worker started with ``DLROVER_LIVE_JOIN=1``) the
live state: it asks to join at start, the master marks the running generation's
``grow_key`` in the store, rank 0 sees it at the next step boundary (one small all-reduce
per step carries the decision to every rank) and the world grows back at that boundary.
Samplers with ``set_world(rank, world_size)`` (:class:`~dlrover_core.train.ElasticSampler`)
follow the world: the global batch stays the same, so each rank's share grows when the
world shrinks.

Outside a live-capable dlrover job (``python train.py``, ``Failure(live_recovery=False)``)
the guard lets every error through and the loop is a plain ``range``.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import attrs

from dlrover_core import env
from dlrover_core.checkpoint.layout import encode
from dlrover_core.checkpoint.memory import release_prefaulted
from dlrover_core.checkpoint.rng import get_rng_state
from dlrover_core.errors import DLRoverError
from dlrover_core.logging import get_logger
from dlrover_core.parallel.ddp import replicated_modules
from dlrover_core.protocol.client import MasterClient
from dlrover_core.protocol.messages import LiveAssignment, LiveReform
from dlrover_core.protocol.progress import DoneRecord, LiveReadyRecord, LiveRecord
from dlrover_core.train import peer, process_group, reconfigurable
from dlrover_core.train.checkpointer import active_checkpointer
from dlrover_core.train.context import current_job, is_joiner, is_live, worker_info
from dlrover_core.train.progress import get_writer
from dlrover_core.train.reform import LiveRecoveryError, ask, joined

__all__ = ["LiveRecoveryError", "Step", "is_live", "steps"]

log = get_logger()

#: How long forming a generation's process group may wait for its members (seconds): they
#: all asked a moment ago, so one that does not come died meanwhile. (Gloo waits 5 times this
#: for a member that died halfway through connecting; below about 2 s it aborts the process.)
_JOIN_TIMEOUT_S = 5.0
#: Re-forms in a row a worker tries when peers keep dying while the generation forms.
_MAX_REFORM_TRIES = 10
#: How often rank 0's watcher asks the store whether a replacement waits to join (seconds).
_WATCH_S = 0.05
#: A training thread still in the same step or boundary this long after its group was
#: severed is stuck (seconds; or 3 typical step times when longer): see
#: ``_GrowWatch._check_stuck``. A false "stuck" costs far more than a late one: a survivor
#: that exits leaves no one to hand the state over (every worker restarts), a late one only
#: delays one rejoining worker; 2 s made a loaded 2-core machine's survivor exit once. The
#: step time is the median of the latest ones, not the last: a host frozen between a step's
#: end and its report made that report's time as long as the freeze, and the thawed worker
#: waited three freezes before it left its stuck collective (the survivor had finished).
_STUCK_MIN_S = 5.0
#: The exit code of a worker that left a stuck collective this way (EX_TEMPFAIL, sysexits.h).
EXIT_STUCK = 75


def _stuck_after_s() -> float:
    return max(_STUCK_MIN_S, 3 * get_writer().typical_dt_s)


#: The abort flag is checked every this many watch ticks by a node's first worker (rank 0:
#: every tick): one store request per node per 0.2 s.
_ABORT_EVERY = 4

#: Substrings of the errors gloo and NCCL raise when a peer died or the group was aborted.
_COLLECTIVE_ERRORS = ("gloo", "nccl", "connection", "closed by peer", "reset by peer", "broken pipe",
                      "timed out", "aborted", "process group", "processgroup", "socket")


def is_collective_error(exc: BaseException) -> bool:
    """Whether ``exc`` is what a collective raises when a peer died or the group was aborted."""
    try:
        import torch.distributed as dist  # heavy: torch
    except ImportError:  # pragma: no cover - torch is a dependency
        return False
    if isinstance(exc, getattr(dist, "DistError", ())):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc).lower()
    return any(marker in text for marker in _COLLECTIVE_ERRORS)


class Step(int):
    """A step number (an ``int``: ``report(step)``, ``ckpt.save(step, ...)``, ``step % 25``)
    that is also the guard of the step's body (``with step:``).

    Attributes:
        rank, world_size: this worker's place in the current generation (they change when
            the world shrinks or grows; read them here, not from ``train.init()``'s answer).
        generation: the live world's generation (0: the round's own process group).
    """

    _loop: _Loop

    def __new__(cls, value: int, loop: _Loop) -> Step:
        obj = super().__new__(cls, value)
        obj._loop = loop
        return obj

    @property
    def rank(self) -> int:
        return self._loop.rank

    @property
    def world_size(self) -> int:
        return self._loop.world_size

    @property
    def generation(self) -> int:
        return self._loop.generation

    def __reduce__(self) -> tuple[type, tuple[int]]:
        """Pickles (and copies) as the plain ``int``: a script that keeps the step in its
        state (``self.step = step``) must not carry the loop, and with it the model and the
        process group, into a state it sends or saves."""
        return (int, (int(self),))

    def __enter__(self) -> Step:
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        return self._loop.step_exit(self, exc)


@attrs.frozen
class _Refused:
    """Sent instead of a state skeleton that cannot be pickled: every member raises ``why``
    (none is left waiting for tensors that never come)."""

    why: str


@attrs.frozen
class _TensorRef:
    """A tensor's place in a state skeleton broadcast to the ranks behind."""

    index: int
    shape: tuple[int, ...]
    dtype: Any
    device_type: str


class _Loop:
    """The state machine behind :func:`steps` (one per call)."""

    def __init__(self, total: int, state: dict[str, Any], start: int) -> None:
        info = process_group._info or worker_info()
        self.total, self.state = int(total), state
        self.next_step = int(start)
        self.applied = int(start) - 1
        self.rank, self.world_size = info.rank, info.world_size
        self.generation = 0
        self.live = is_live()
        job = current_job()
        self.sharded = self.live and job is not None and job.live_sharded  # the world keeps its size
        self._off = process_group.sharded_off() if self.sharded else ""  # told to the master: restart-all
        self.replica = not is_joiner()  # holds the training state (a replacement: once caught up)
        self.grow_key = "live/grow/0"
        self._positions: dict[str, Any] = {}
        self._in_flight: int | None = None
        #: where the training thread is ("boundary", "step", "between", "recover"), and how
        #: many times it moved: the watch tells a thread stuck in a severed collective by it
        self.phase, self.phase_seq = "start", 0
        self._failed = False  # the step in flight failed (the exception itself is not kept: its frames hold the old DDP)
        self._failed_why = ""
        self._client: Any = None
        self._hooks: list[Any] = []
        self._watch = _GrowWatch(self)
        self._node_id = int(os.environ.get(env.NODE_ID, "0"))
        # its place on its node, also under --virtual-local-rank (which makes LOCAL_RANK 0)
        self._local_rank = int(os.environ.get(env.LOCAL_RANK, os.environ.get("LOCAL_RANK", "0")))
        self._round = int(os.environ.get(env.ROUND, "0"))
        self._voted = False  # every rank agreed to apply the step in flight's update
        for optimizer in _optimizers(state):
            self._hooks.append(optimizer.register_step_post_hook(self._on_optimizer_step))
            if self.sharded:
                self._hooks.append(optimizer.register_step_pre_hook(self._before_optimizer_step))

    # ----- the loop --------------------------------------------------------------------

    def __iter__(self) -> Iterator[Step]:
        release_prefaulted()  # a script that restores builds its Checkpointer before the loop
        try:
            if self.live:
                self._start()
            while self.next_step < self.total:
                if self.live and self.world_size > 0:
                    self._enter("boundary")
                    try:
                        grow = self._boundary()
                    except Exception as exc:
                        if not is_collective_error(exc):
                            raise
                        why = str(exc)
                    else:
                        why = ""
                    if why:
                        self._recover("error", why)
                        continue
                    if grow:
                        self._recover("grow", "")
                        continue
                step = Step(self.next_step, self)
                self._positions = _positions(self.state)
                self._in_flight, self._failed, self._voted = int(step), False, False
                self._enter("step")
                yield step
                self._enter("between")
                if self._failed:  # the guard caught a peer's death: re-form now that the step's frames are gone
                    self._recover("error", self._failed_why)
                    continue  # next_step was set by the sync
                self._in_flight = None
                self.next_step = int(step) + 1
            if self.live:
                self._tell_done()
        finally:
            self._watch.stop()
            for hook in self._hooks:
                hook.remove()
            if self._client is not None:
                self._client.close()

    def _enter(self, phase: str) -> None:
        self.phase, self.phase_seq = phase, self.phase_seq + 1

    def _before_optimizer_step(self, *_: Any) -> None:
        """A sharded world applies a step's update on every rank or on none: one small
        all-reduce before the first optimizer step of each step (TorchFT's ``should_commit``
        vote, torchft/manager.py). A rank whose backward failed (a peer died) never gets
        here, so the others' all-reduce fails too and nobody applies the step. Without it,
        a rank that died between two of its collectives could let the ranks that no longer
        needed it apply the step while its replica peers did not: no common step to resume
        at but an older snapshot, and every survivor would go back to it."""
        import torch  # heavy: torch
        import torch.distributed as dist  # heavy: torch

        if self._in_flight is None or self._voted or not self.live or self.world_size <= 1:
            return
        if not dist.is_initialized():
            return
        dist.all_reduce(torch.zeros(1, dtype=torch.int32))
        self._voted = True

    def _on_optimizer_step(self, *_: Any) -> None:
        if self._in_flight is not None:
            self.applied = self._in_flight

    def step_exit(self, step: Step, exc: BaseException | None) -> bool:
        if exc is None or not self.live or not isinstance(exc, Exception) or not is_collective_error(exc):
            return False
        self._failed, self._failed_why = True, str(exc)
        _abort_group(self.sharded)  # now: peers blocked on this worker fail at once
        if self.applied < int(step):  # the update was not applied here: take this step's data back
            _restore_positions(self.state, self._positions)
        return True

    # ----- the live world ---------------------------------------------------------------

    def _master(self) -> Any:
        if self._client is None:
            self._client = MasterClient(os.environ[env.MASTER_ADDR])
        return self._client

    def _ask(self, reason: str, error: str = "") -> LiveAssignment:
        memory_steps = tuple(self._memory_steps()) if self.sharded and reason in ("error", "grow") else ()
        message = LiveReform(node_id=self._node_id, local_rank=self._local_rank, pid=os.getpid(), round=self._round,
                             generation=self.generation if reason != "join" else -1, step=self.applied,
                             reason=reason, error=error[:500], replica=self.replica, memory_steps=memory_steps)
        answer = ask(self._master(), message)
        if answer.state == "finished":  # a replacement: the others finished the last step
            log.info("live_join_not_needed", node_id=self._node_id, local_rank=self._local_rank,
                     reason=answer.reason)
            raise SystemExit(0)
        if answer.state in ("restart", "stop") and reason != "ready":
            # every worker restarts (or the job ended): the agent stops this process anyway;
            # exit quietly, no exception record (it is not this script's error)
            log.warning("live_recovery_ended", state=answer.state, reason=answer.reason, rank=self.rank)
            raise SystemExit(1)
        return answer  # ready; or, asked with "ready", restart: this job's failures restart every worker

    def _memory_steps(self) -> list[int]:
        """Steps of this rank's complete snapshots in memory (what it can go back to)."""
        ckpt = active_checkpointer()
        return ckpt.memory_steps() if ckpt is not None else []

    def _tell_done(self) -> None:
        """The last step is done: the agent's hang watcher leaves this worker be while it
        exits, and a replacement still waiting to join need not."""
        get_writer().write(DoneRecord(rank=self.rank, step=self.next_step - 1))
        message = LiveReform(node_id=self._node_id, local_rank=self._local_rank, pid=os.getpid(), round=self._round,
                             generation=self.generation, step=self.applied, reason="done")
        with contextlib.suppress(DLRoverError):  # (whatever the answer: this worker is done)
            self._master().live_reform(message)

    def _tell_caught_up(self) -> None:
        """This replacement received the live state: until the master knows, it counts the
        worker as one that cannot give the state to anybody (if every holder dies first,
        every worker restarts instead)."""
        message = LiveReform(node_id=self._node_id, local_rank=self._local_rank, pid=os.getpid(), round=self._round,
                             generation=self.generation, step=self.applied, reason="caught_up")
        with contextlib.suppress(DLRoverError):  # (the next re-form tells it again: replica=True)
            self._master().live_reform(message)

    def _start(self) -> None:
        if is_joiner() and self.sharded:
            self._start_joined()
        elif is_joiner():
            log.info("live_join_waiting", node_id=self._node_id, local_rank=self._local_rank)
            get_writer().write(LiveReadyRecord(rank=self.rank))  # the agent may replace it alone
            self.applied = -1
            self._recover("join", "")
        else:
            problem = _unsendable(_skeleton(self.state, []))
            if problem is not None:  # found now, not when a replacement waits for the state
                raise LiveRecoveryError(problem)
            off = self._off or ("" if self.sharded else _undeclared_shard(self.state))
            answer = self._ask("ready", off)
            if answer.state != "ready":
                log.info("live_recovery_off", reason=answer.reason)
                self.live = False
                return
            self.grow_key = answer.grow_key or self.grow_key
            get_writer().write(LiveReadyRecord(rank=self.rank))  # the agent may replace it alone

    def _start_joined(self) -> None:
        """A sharded job's replacement joined its generation at ``train.init()`` and loaded
        its shard of the step the members resume after: it starts right after that step."""
        answer = joined()
        if answer is None:
            raise LiveRecoveryError("a replacement of a sharded job joins its world in train.init(): call it "
                                    "before train.steps()")
        resume = answer.resume_step if answer.resume_step is not None else -1
        if self.next_step != resume + 1:
            raise LiveRecoveryError(
                f"this replacement starts at step {self.next_step}, but its peers resume after step {resume}: "
                "restore with restored = Checkpointer().load(state) and loop with "
                "train.steps(total, state, start=restored.step + 1 if restored else 0)")
        self.rank, self.world_size, self.generation = answer.rank, answer.world_size, answer.generation
        self.grow_key = answer.grow_key
        self.applied, self.replica = resume, True
        if peer.agreed() != answer.generation:  # (its load took the state from a replica peer: agreed there)
            self._agree()
        writer = get_writer()
        writer.rank, writer.generation = self.rank, self.generation
        writer.write(LiveRecord(rank=self.rank, reason="join", generation=self.generation, world_size=self.world_size,
                                step=self.next_step, reform_s=0.0, unix_time_s=time.time()))
        writer.mark()
        self._tell_caught_up()
        log.info("live_joined", rank=self.rank, generation=self.generation, world_size=self.world_size,
                 step=self.next_step)

    def _boundary(self) -> bool:
        """Whether the generation ends at this step boundary (a replacement waits to join):
        rank 0's watcher thread has seen the grow flag in the store; one small all-reduce
        tells everyone (the only per-step cost of the live world). The same all-reduce
        agrees whether every rank snapshots this step (where snapshots are replicated, none
        does while a buddy lacks a rank's newest one: :meth:`Checkpointer.agree`)."""
        import torch  # heavy: torch
        import torch.distributed as dist  # heavy: torch

        if not dist.is_initialized():
            return False
        flag = 0
        if self.rank == 0 or self._local_rank == 0:
            self._watch.start()
        if self.rank == 0:
            flag = int(self._watch.seen == self.grow_key)
        ckpt = active_checkpointer()
        behind = int(ckpt is not None and not ckpt.replicas_ready())  # (a snapshot its buddy lacks)
        if self.world_size > 1:
            t = torch.tensor([flag, behind], dtype=torch.int32)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            flag, behind = t.tolist()
        if ckpt is not None:  # every rank snapshots this step, or none does
            ckpt.agree(self.next_step, ready=not behind)
        return bool(flag)

    def _recover(self, reason: str, error: str) -> None:
        """Leave the current process group, join the next generation, catch up. ``error``:
        the collective's error (``""``: a planned re-form). A peer that dies while the new
        generation forms its group or catches up makes this worker ask again."""
        import torch.distributed as dist  # heavy: torch

        t0 = time.monotonic()
        tries = 0
        was_replica = self.replica
        self._enter("recover")
        while True:
            _abort_group(self.sharded)
            if error:
                log.warning("live_collective_failed", rank=self.rank, generation=self.generation,
                            step=self._in_flight, error=(error.splitlines() or [""])[0][:200])
            answer = self._ask(reason, error)
            t1 = time.monotonic()
            try:
                if self.sharded:
                    behind = self._reconnect(answer)
                else:
                    self._join(answer)
                    behind = self._sync()
                    for module in replicated_modules():
                        module.rebuild()
            except Exception as exc:
                if not (is_collective_error(exc) or isinstance(exc, dist.DistStoreError)):
                    raise
                tries += 1
                reason, error = "error", str(exc)
                if tries > _MAX_REFORM_TRIES:
                    raise
                continue
            break
        for obj in self.state.values():
            if hasattr(obj, "set_world"):
                obj.set_world(self.rank, self.world_size)
        writer = get_writer()
        writer.rank, writer.generation = self.rank, self.generation
        writer.write(LiveRecord(rank=self.rank, reason=reason, generation=self.generation, world_size=self.world_size,
                                step=self.next_step, reform_s=round(time.monotonic() - t0, 6), unix_time_s=time.time()))
        writer.mark()  # the next step's time leaves the re-form out
        self._in_flight = None
        if not was_replica:  # a replacement holds the state now: the master may count on it
            self._tell_caught_up()
        log.info("live_reformed", reason=reason, generation=self.generation, rank=self.rank,
                 world_size=self.world_size, step=self.next_step, caught_up=behind, tries=tries + 1,
                 wait_s=round(t1 - t0, 4), total_s=round(time.monotonic() - t0, 4))

    def _join(self, answer: LiveAssignment) -> None:
        """Form the generation's process group: its rendezvous waits at most
        ``_JOIN_TIMEOUT_S`` (a peer that died meanwhile never comes), its collectives then
        ``Failure.collective_timeout_s``."""
        import torch.distributed as dist  # heavy: torch

        store = process_group.round_store(answer.store_host, answer.store_port)
        # this generation from here on, even if forming its group fails: the next question
        # is about the one after it (a member that died meanwhile is left out)
        self.generation = answer.generation
        # torch names a default group by a per-process counter (its keys live under the name):
        # a failed init counted one, and a replacement's first group is "0", so the members
        # would wait for each other under different names; no group exists here, start at 0
        dist.distributed_c10d._world.group_count = 0
        before = process_group.socket_inodes()
        dist.init_process_group(backend=process_group.backend(), store=dist.PrefixStore(answer.prefix, store),
                                rank=answer.rank, world_size=answer.world_size,
                                timeout=datetime.timedelta(seconds=_JOIN_TIMEOUT_S))
        process_group.note_group_sockets(before)
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=process_group.collective_timeout_s()))
        self.rank, self.world_size, self.generation = answer.rank, answer.world_size, answer.generation
        self.grow_key = answer.grow_key
        process_group.set_place(rank=answer.rank, world_size=answer.world_size)

    def _reconnect(self, answer: LiveAssignment) -> bool:
        """A sharded world's next generation: the same ranks, each group reconnected in
        place (:mod:`~dlrover_core.train.reconfigurable`), every member at the step the
        master chose (``answer.resume_step``); returns whether this member went back to it
        from its memory snapshot (its applied step was newer)."""

        self.generation = answer.generation
        before = process_group.socket_inodes()
        reconfigurable.reconfigure(answer.generation)
        process_group.note_group_sockets(before)
        for module in replicated_modules():  # fresh reducers, as the replacement's (see parallel.ddp)
            module.rebuild()
        self.rank, self.world_size, self.grow_key = answer.rank, answer.world_size, answer.grow_key
        _reset_fsdp(self.state)  # the failed step's prefetched all-gathers and reductions are gone
        resume = answer.resume_step if answer.resume_step is not None else -1
        back = self.applied != resume
        ckpt = active_checkpointer()
        if back or (ckpt is not None and resume in ckpt.memory_steps()):
            if ckpt is None:
                raise LiveRecoveryError(f"rank {self.rank} applied step {self.applied} but its world resumes after "
                                        f"step {resume}, and it has no train.Checkpointer to go back with")
            # (at the step already: only the RNG, which a step interrupted after it may have drawn from)
            ckpt.go_back(resume, rng_only=not back)
        self.applied, self.replica, self.next_step = resume, True, resume + 1
        _zero_grads(self.state)
        self._agree()
        return back

    def _agree(self) -> None:
        """Every member of a sharded generation (the replacement too) checks that all
        resume after the same step, the new groups' first collective; a member of a
        replacement's replica group sends it the state where its node's memory lacked it
        (:func:`~dlrover_core.train.peer.agree`)."""
        job = current_job()
        ckpt = active_checkpointer()
        applied = self.applied

        def encode_state() -> bytes:
            if ckpt is not None:
                return ckpt.encode_state(applied)
            return encode({"state": self.state, "rng": get_rng_state()}, step=applied, rank=self.rank,
                          world_size=self.world_size)

        peer.agree(applied, rank=self.rank, world_size=self.world_size, generation=self.generation, needs_state=False,
                   groups=job.replica_groups(self.world_size) if job is not None else [], encode_state=encode_state)

    def _sync(self) -> bool:
        """Bring every member to the newest step a replica (a worker holding the training
        state: not a replacement that has not caught up yet) applied; returns whether this
        rank was behind."""
        import torch.distributed as dist  # heavy: torch

        places: list[Any] = [None] * self.world_size
        dist.all_gather_object(places, (self.replica, self.applied))
        replicas = [(applied, r) for r, (replica, applied) in enumerate(places) if replica]
        if not replicas:
            raise LiveRecoveryError("no member of the new generation holds the training state")
        newest = max(applied for applied, _ in replicas)
        source = min(r for applied, r in replicas if applied == newest)
        behind = [r for r, (replica, applied) in enumerate(places) if not replica or applied < newest]
        me_behind = self.rank in behind
        if behind:
            _broadcast_state(self.state, source=source, rank=self.rank, receive=me_behind)
        self.applied = newest
        self.replica = True
        self.next_step = newest + 1
        _zero_grads(self.state)
        return me_behind


class _GrowWatch:
    """A watch on the round's store, on a thread and a store connection of its own, so the
    training thread pays nothing per step but the boundary all-reduce: rank 0 looks for the
    grow flag (a replacement waits to join), and each node's first worker for the abort flag
    of its generation (a member node was lost, maybe cut off: :func:`process_group.sever_group`
    makes the collectives waiting on it fail now instead of at the collective timeout)."""

    def __init__(self, loop: _Loop) -> None:
        self._loop = loop
        self.seen = ""  # the newest grow key found set
        self._severed = -1  # the generation whose connections were shut down
        self._still = (0, 0.0)  # (the training thread's phase_seq, since when) after the sever
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None and process_group._store_addr is not None:
            self._thread = threading.Thread(target=self._run, name="dlrover-grow-watch", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        import torch.distributed as dist  # heavy: torch

        assert process_group._store_addr is not None
        host, port = process_group._store_addr
        try:
            store = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=30), use_libuv=True)
        except Exception as exc:  # the round's store is gone: the next collective fails anyway
            log.debug("live_grow_watch_failed", error=str(exc))
            return
        ticks = 0
        while not self._stop.wait(_WATCH_S):
            ticks += 1
            loop = self._loop
            try:
                if loop.rank == 0 and loop.grow_key != self.seen and store.check([loop.grow_key]):
                    self.seen = loop.grow_key
                generation = loop.generation
                if (self._severed < generation and (loop.rank == 0 or ticks % _ABORT_EVERY == 0)
                        and store.check([f"live/abort/{generation}"])):
                    self._severed = generation
                    severed = process_group.sever_group()
                    log.warning("live_group_severed", rank=loop.rank, generation=generation, connections=severed,
                                reason="a member of this generation died or its node was lost")
                    self._still = (loop.phase_seq, time.monotonic())
                if self._severed == generation:
                    self._check_stuck(loop)
            except Exception:  # the store went away (the round ended)
                return

    def _check_stuck(self, loop: _Loop) -> None:
        """After the group was severed, a collective fails at once, so a training thread that
        stays in one step or boundary past :func:`_stuck_after_s` is blocked where gloo does
        not wake it (its peer's connection had already closed when it began waiting: a host
        that thawed after it was left out). It cannot rejoin from there: the process exits,
        and its agent replaces it with a worker that joins live."""
        if loop.phase_seq != self._still[0] or loop.phase not in ("step", "boundary"):
            self._still = (loop.phase_seq, time.monotonic())
            return
        waited = time.monotonic() - self._still[1]
        if waited < _stuck_after_s():
            return
        log.error("live_worker_stuck", rank=loop.rank, generation=loop.generation, phase=loop.phase,
                  step=loop._in_flight, waited_s=round(waited, 2),
                  action=f"exiting with code {EXIT_STUCK}: the agent replaces this worker, which rejoins live")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_STUCK)


def steps(total: int, state: dict[str, Any], *, start: int = 0) -> Iterator[Step]:
    """The training loop's steps ``start .. total - 1``, each a :class:`Step` to guard the body with.

    Args:
        total: steps in the whole run.
        state: what the loop trains (the dict given to ``Checkpointer.save``): modules,
            optimizers, LR schedulers, samplers. Optimizers get a post hook (which step's
            update was applied); everything with ``state_dict`` is sent to a replacement.
        start: the first step (``restored.step + 1`` after ``Checkpointer.load``); a
            replacement ignores it and goes on from its peers' step.

    Yields:
        :class:`Step`: an ``int`` to use as the step, and a context manager: ``with step:``
        around the body discards a step a peer's death interrupted and re-forms the world.

    Raises:
        LiveRecoveryError: the job master is unreachable while the world re-forms; or a
            ``state`` entry's ``state_dict()`` holds a value that cannot be sent to a
            replacement (checked when the loop starts, and again at each send; the message
            names the entry and the value).
        SystemExit: (code 1) the world cannot go on live after a peer's death: every
            worker restarts from a checkpoint (or the job ended); the agent stops this
            process anyway. A replacement exits 0 when the others finished the last step
            before it could join.
    """
    return iter(_Loop(total, state, start))


# ----- state helpers ------------------------------------------------------------------------


def _positions(state: dict[str, Any]) -> dict[str, Any]:
    """Data positions at a step's start (samplers: entries with ``set_world``), to roll a
    discarded step back."""
    return {k: v.state_dict() for k, v in state.items() if hasattr(v, "set_world") and hasattr(v, "state_dict")}


def _restore_positions(state: dict[str, Any], positions: dict[str, Any]) -> None:
    for k, pos in positions.items():
        state[k].load_state_dict(pos)


def _reset_fsdp(state: dict[str, Any]) -> None:
    """Reset the per-iteration state of every root FSDP2 module in ``state``
    (``FSDPModule.reset_iter_state``, torch's recovery after a forward or backward aborted
    mid-flight: torch.distributed.fsdp.fully_shard's documentation). Without it a module
    whose step failed with an all-gather prefetched or a reduction in flight runs another
    sequence of collectives than a replacement's fresh module, and the group mismatches."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    module_type = getattr(fsdp, "FSDPModule", None)
    if module_type is None:
        return
    seen: set[int] = set()
    for value in state.values():
        for candidate in (value, getattr(value, "model", None), getattr(value, "module", None)):
            if candidate is None or not hasattr(candidate, "modules") or id(candidate) in seen:
                continue
            seen.add(id(candidate))
            for module in candidate.modules():
                if isinstance(module, module_type) and getattr(module._get_fsdp_state(), "_is_root", None):
                    try:
                        module.reset_iter_state()
                    except Exception as exc:  # its aborted group's works fail: nothing left to wait for
                        log.debug("fsdp_reset_work_failed", error=f"{type(exc).__name__}: {exc}")


def _optimizers(state: dict[str, Any]) -> list[Any]:
    """The optimizers in ``state``: its entries that are one, and the ``optimizer`` of a
    :class:`~dlrover_core.train.state.ModelOptimizerState` entry (each once)."""
    out: dict[int, Any] = {}
    for obj in state.values():
        for candidate in (obj, getattr(obj, "optimizer", None)):
            if hasattr(candidate, "register_step_post_hook") and hasattr(candidate, "param_groups"):
                out.setdefault(id(candidate), candidate)
    return list(out.values())


def _zero_grads(state: dict[str, Any]) -> None:
    """Drop gradients a discarded step left behind."""
    for optimizer in _optimizers(state):
        optimizer.zero_grad(set_to_none=True)
    for obj in state.values():
        for candidate in (obj, getattr(obj, "model", None)):
            if isinstance(candidate, type) or not (hasattr(candidate, "parameters") and callable(candidate.parameters)):
                continue
            for p in candidate.parameters():
                p.grad = None


def _abort_group(sharded: bool = False) -> None:
    """Abort and destroy the default process group: its sockets close, so peers blocked on
    this worker fail at once instead of at the collective timeout. A sharded world keeps its
    groups (the mesh and FSDP hold them) and closes only their connections."""
    import torch.distributed as dist  # heavy: torch

    if sharded:
        reconfigurable.abort()
        return

    if not dist.is_initialized():
        return
    with contextlib.suppress(Exception):
        dist.distributed_c10d._get_default_group().abort()
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def _pack(obj: Any, tensors: list[Any]) -> Any:
    import torch  # heavy: torch

    if isinstance(obj, torch.Tensor):
        tensors.append(obj.detach())
        return _TensorRef(len(tensors) - 1, tuple(obj.shape), obj.dtype, obj.device.type)
    if isinstance(obj, dict):
        return {k: _pack(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_pack(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_pack(v, tensors) for v in obj)
    return obj


def _unpack(obj: Any, tensors: list[Any]) -> Any:
    if isinstance(obj, _TensorRef):
        return tensors[obj.index]
    if isinstance(obj, dict):
        return {k: _unpack(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unpack(v, tensors) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_unpack(v, tensors) for v in obj)
    return obj


def _refs(obj: Any) -> Iterator[_TensorRef]:
    if isinstance(obj, _TensorRef):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _refs(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _refs(v)


def _skeleton(state: dict[str, Any], tensors: list[Any]) -> dict[str, Any]:
    """Every ``state`` entry's ``state_dict()`` with its tensors moved to ``tensors``."""
    return {k: _pack(v.state_dict(), tensors) for k, v in state.items() if hasattr(v, "state_dict")}


def _undeclared_shard(state: dict[str, Any]) -> str:
    """Why a job whose spec calls its state replicated cannot recover live (``""``: it can):
    a ``state_dict()`` holds a sharded ``DTensor`` (a ``Shard`` placement), e.g. a script
    that applied ``fully_shard`` itself or passed ``parallel=`` to ``train.prepare``. The
    replicated path would shrink the world and hand a replacement another rank's shard, so
    such a worker tells the master and every failure restarts every worker (from memory)."""
    from torch.distributed.tensor import DTensor, Shard  # heavy: torch

    tensors: list[Any] = []
    skeleton = _skeleton(state, tensors)

    def path_of(obj: Any, path: str) -> str | None:
        if isinstance(obj, _TensorRef):
            t = tensors[obj.index]
            return path if isinstance(t, DTensor) and any(isinstance(p, Shard) for p in t.placements) else None
        children = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, (list, tuple)) else ()
        return next((found for key, value in children if (found := path_of(value, f"{path}[{key!r}]"))), None)

    for name, entry in skeleton.items():
        found = path_of(entry, "")
        if found is not None:
            return (f"state[{name!r}].state_dict(){found} is a sharded DTensor, but Job.parallel declares the state "
                    "replicated (shard it through Job(parallel=Parallel(['fsdp'])) and train.prepare(), so that "
                    "the live world keeps its size and a replacement loads its own shard; until then every "
                    "failure restarts every worker)")
    return ""


def _unsendable(skeleton: dict[str, Any]) -> str | None:
    """Why ``skeleton`` cannot be sent to a replacement (``None``: it can): names the first
    value ``pickle`` refuses, by its path in the state (``state['probe']['step']``)."""
    try:
        pickle.dumps(skeleton)
        return None
    except Exception:  # noqa: BLE001 - found below, value by value
        pass

    def first(obj: Any, path: str) -> tuple[str, Any, BaseException] | None:
        children = (obj.items() if isinstance(obj, dict)
                    else enumerate(obj) if isinstance(obj, (list, tuple)) else ())
        for key, value in children:
            found = first(value, f"{path}[{key!r}]")
            if found is not None:
                return found
        try:
            pickle.dumps(obj)
        except Exception as exc:  # noqa: BLE001 - any refusal is reported
            return path, obj, exc
        return None

    for name, entry in skeleton.items():
        found = first(entry, "")
        if found is not None:
            path, value, exc = found
            return (f"state[{name!r}].state_dict(){path} is a {type(value).__module__}.{type(value).__qualname__}, "
                    f"which cannot be sent to a replacement ({type(exc).__name__}: {exc}). Make "
                    f"state[{name!r}].state_dict() return tensors, numbers, strings and lists or dicts of them, "
                    "or turn live recovery off with Failure(live_recovery=False)")
    return None


def _broadcast_state(state: dict[str, Any], *, source: int, rank: int, receive: bool) -> None:
    """``source`` sends every ``state`` entry's ``state_dict()``: its structure (pickled,
    tensors left out) with ``broadcast_object_list``, then each tensor with ``broadcast``;
    ranks with ``receive`` load it, the others (already at the newest step) drop it.

    Raises:
        LiveRecoveryError: on every member, when a ``state_dict()`` holds a value that
            cannot be pickled (the error names it); the source sends the refusal instead
            of the state, so nobody waits for it.
    """
    import torch  # heavy: torch
    import torch.distributed as dist  # heavy: torch

    tensors: list[Any] = []
    skeleton: Any = None
    if rank == source:
        skeleton = _skeleton(state, tensors)
        problem = _unsendable(skeleton)
        if problem is not None:
            skeleton = _Refused(problem)
    box = [skeleton]
    dist.broadcast_object_list(box, src=source)
    skeleton = box[0]
    if isinstance(skeleton, _Refused):
        raise LiveRecoveryError(skeleton.why)
    if rank != source:
        device = None
        for ref in sorted(_refs(skeleton), key=lambda r: r.index):
            if ref.device_type != "cpu" and device is None:
                device = torch.device(ref.device_type, getattr(torch, ref.device_type).current_device())
            tensors.append(torch.empty(ref.shape, dtype=ref.dtype, device=device if ref.device_type != "cpu" else "cpu"))
    for t in tensors:
        if t.numel():
            dist.broadcast(t if t.is_contiguous() else t.contiguous(), src=source)
    if receive:
        for k, sd in skeleton.items():
            state[k].load_state_dict(_unpack(sd, tensors))
