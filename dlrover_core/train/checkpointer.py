"""The worker's :class:`Checkpointer` (Flash Checkpoint): ``save(step, state)``, ``load()``.

It drives the checkpoint engine (:mod:`dlrover_core.checkpoint`: shared-memory snapshots,
the on-disk layout, commits) from the training script.

Under a dlrover agent:

* ``save`` copies the state's tensors into one of the rank's two shared-memory slots (held
  for the agent, so they survive the worker) and returns: the training loop waits only for
  that copy. Steps due for persistence are flagged; the agent persists them in the
  background and the master commits a step when every rank's shard is durable.
* ``load`` asks the master which restore wins: from memory when every rank holds the same
  newest step (after a worker restart on live nodes), else the last committed step from
  storage, else a fresh start. A storage step is checked first on every rank (header and
  CRC32): if one rank's shard is damaged, every rank falls back to the previous intact
  committed step. It logs which, and how long it took.
* Every rank must save the same steps, and a loop must go on from the step ``load``
  restored: a rank that skips a step others save for storage fails the job at once (the
  master sees it), and ``save`` or ``train.report`` of a step already restored raises
  :class:`~dlrover_core.errors.CheckpointError`.

Without memory (``Checkpoint(memory_every_steps=0)``, a /dev/shm too small for the state, or
no agent) ``save`` writes the shard to storage itself (staging name, fsync, rename) and the
step is committed by the master — or, with no master, by rank 0 after a barrier.

Storage layout (one directory per step, one self-contained safetensors file per rank)::

    step_0000000150/rank_00000-round2.safetensors   tensors + the JSON tree of the rest
    step_0000000150/checkpoint.json   {"step", "world_size", "round", "shards": {rank: {file, crc32, bytes, round}}}
    latest                            "150" — written last, atomically: the commit

A shard's name carries the incarnation (rendezvous round) that wrote it, so a late write of
a stale incarnation never replaces a file a commit names; ``checkpoint.json`` names the
files of the commit (format 1 had ``rank_00000.safetensors``, still loaded).

Loading never unpickles anything. DTensor (FSDP2) states are saved as each rank's shard with
its global offsets, and are loaded at another world size through
``torch.distributed.checkpoint`` (DCP resharding).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import time
import warnings
import weakref
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import attrs

from dlrover_core import env
from dlrover_core.checkpoint.commit import retain, tidy, write_commit
from dlrover_core.checkpoint.copy import prestart as prestart_copy_threads
from dlrover_core.checkpoint.layout import (
    DTENSORS_KEY,
    TREE_KEY,
    LayoutPlan,
    build_layout,
    data_crc32,
    encode,
    parse_header,
    tensor_views,
)
from dlrover_core.checkpoint.memory import (
    MemorySnapshots,
    ShmTooSmall,
    prefault_for_restore,
    release_prefaulted,
    slots_exist,
    take_prefaulted,
)
from dlrover_core.checkpoint.rng import get_rng_state, set_rng_state
from dlrover_core.checkpoint.saver import shard_path, step_dir
from dlrover_core.errors import CheckpointError
from dlrover_core.logging import get_logger
from dlrover_core.plugins import get_host
from dlrover_core.protocol.client import MasterClient
from dlrover_core.protocol.messages import (
    RestoreDecision,
    RestorePlanRequest,
    RestoreVerify,
    RestoreVerifyAnswer,
    ShardReport,
)
from dlrover_core.protocol.progress import CheckpointRecord, RestoreRecord
from dlrover_core.spec import Checkpoint
from dlrover_core.storage.base import CheckpointStorage
from dlrover_core.train import peer
from dlrover_core.train.context import current_job, is_joiner, is_live, worker_info
from dlrover_core.train.progress import get_writer
from dlrover_core.train.reform import joined
from dlrover_core.train.restore import reshard, restore_tree, shards_differ, without_rng

__all__ = ["Checkpointer", "Restored"]

log = get_logger()

A = TypeVar("A", RestoreDecision, RestoreVerifyAnswer)


@attrs.frozen(kw_only=True)
class Restored:
    """A loaded checkpoint.

    Attributes:
        step: the step it was saved at; resume training at ``step + 1``.
        state: the saved state; tensors are CPU tensors owned by the caller (or, for targets
            given to ``load``, the targets' own state).
        source: ``"memory"``, ``"storage"``, or ``"peer"`` (a sharded world's replacement
            got its shard from a live member of its replica group: ``train.peer``).
        load_s: seconds the load took.
    """

    step: int
    state: dict[str, Any]
    source: str
    load_s: float


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist  # heavy: torch

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()

    info = worker_info()
    return info.rank, info.world_size


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside the block (then as before).

    A save makes a few thousand short-lived containers (the state's tree, a tensor object
    per leaf). Collections they trigger while alive promote them to the old generations and
    so bring on full collections of the process's whole heap (hundreds of thousands of
    objects once torch is imported: 0.1-0.2 s each), which the save pays for: measured in a
    job at 1M parameters, about 0.8 ms per save on average (gen 2 once per ~300 saves). With
    collection paused they die young, by reference counting, at the end of the save. Only
    collection is deferred (no object is freed later than it would be otherwise but cyclic
    garbage, collected at the next collection, also after a save that waited for a free
    slot); a process that disabled it keeps it so."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _barrier() -> None:
    import torch.distributed as dist  # heavy: torch

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


#: Seconds between two ``snapshot_skipped`` lines (a fast loop skips many).
_SKIPPED_LOG_EVERY_S = 60.0
_skipped_logged = -_SKIPPED_LOG_EVERY_S
_skipped = 0


def _replicas_behind(step: int) -> None:
    """Say (now and then) that snapshots are skipped while a buddy catches up."""
    global _skipped_logged, _skipped
    _skipped += 1
    now = time.monotonic()
    if now - _skipped_logged >= _SKIPPED_LOG_EVERY_S:
        _skipped_logged = now
        log.info("snapshots_skipped", step=step, skipped=_skipped,
                 reason="a buddy node does not hold a rank's newest snapshot yet: the snapshots go at the pace of "
                        "their replication (checkpoint.replica_mb_per_s, replica_cpu_share), the training at its own")


#: Seconds between two ``replica_backpressure`` warnings (a slow buddy slows every persist).
_BACKPRESSURE_LOG_EVERY_S = 10.0
_backpressure_logged = -_BACKPRESSURE_LOG_EVERY_S


def _backpressure(step: int, snapshots: MemorySnapshots, *, saved: bool) -> None:
    """Say that a save waited for a slot (or was skipped), and for what."""
    global _backpressure_logged
    if snapshots.waited_for == "replicas":
        now = time.monotonic()
        if now - _backpressure_logged < _BACKPRESSURE_LOG_EVERY_S:
            return
        _backpressure_logged = now
        log.warning("replica_backpressure", step=step, waited_s=round(snapshots.waited_s, 3), skipped=not saved,
                    reason="a save due for persistence waits until the buddy node holds the rank's newest snapshot: "
                           "the replicas are made slower than the steps (raise checkpoint.replica_mb_per_s / "
                           "replica_cpu_share, or persist less often), or the buddy is silent")
    elif saved:
        log.warning("checkpoint_backpressure", step=step, waited_s=round(snapshots.waited_s, 3),
                    reason="every snapshot slot waited for its persist: the storage writes slower "
                           "than checkpoint.persist_every_steps asks")


def _started_by_agent() -> bool:
    """Whether a dlrover agent started this worker (its master's address and node id are set):
    memory snapshots need one."""
    return bool(os.environ.get(env.MASTER_ADDR)) and os.environ.get(env.NODE_ID) is not None


def _snapshot_place(rank: int) -> dict[str, Any]:
    """What names ``rank``'s snapshot segments: the job, node, agent token and round, from the
    environment the agent gave this worker."""
    return {"job_id": os.environ.get(env.JOB_ID, ""), "node_id": int(os.environ.get(env.NODE_ID) or 0),
            "rank": rank, "agent": int(os.environ.get(env.AGENT_TOKEN, "0") or 0),
            "round_index": int(os.environ.get(env.ROUND, "0")),
            "replicated": os.environ.get(env.REPLICA_PINS) == "1"}


def held_memory_steps(rank: int, world_size: int) -> list[int]:
    """Steps of ``rank``'s complete snapshots in this node's shared memory (what a sharded
    job's replacement can resume from), without creating a segment; empty where memory
    snapshots are off or none was taken."""
    job = current_job()
    if not _started_by_agent() or (job is not None and job.checkpoint.memory_every_steps == 0):
        return []
    place = _snapshot_place(rank)
    if not slots_exist(job_id=place["job_id"], node_id=place["node_id"], rank=rank, agent=place["agent"]):
        return []
    snapshots = MemorySnapshots(**place)
    try:
        return snapshots.held_steps(world_size)
    finally:
        snapshots.close()


def prefault_restore(rank: int) -> None:
    """Called by ``train.init()``: a restarted worker's snapshots in /dev/shm are mapped now and
    their pages faulted in while the script builds its model, off the clock of its first
    :meth:`Checkpointer.load` (:func:`~dlrover_core.checkpoint.memory.prefault_for_restore`).
    Nothing happens where a Checkpointer would keep no memory snapshots."""
    job = current_job()
    if not _started_by_agent() or (job is not None and job.checkpoint.memory_every_steps == 0):
        return
    try:
        prefault_for_restore(**_snapshot_place(rank))
    except Exception as exc:  # an optimisation only: the restore maps them itself
        log.debug("checkpoint_prefault_failed", rank=rank, error=f"{type(exc).__name__}: {exc}")


_active: weakref.ref[Checkpointer] | None = None


def active_checkpointer() -> Checkpointer | None:
    """The Checkpointer this process made last (``None``: none, or it was dropped)."""
    return _active() if _active is not None else None


class Checkpointer:
    """Saves and restores a worker's training state, RNG states included.

    Args:
        dir: storage location; default ``Job.checkpoint.dir``.
        storage: registered storage name; default ``Job.checkpoint.storage`` (``posix``).
        memory_every_steps: snapshot to memory when ``step % N == 0`` (0: never); default from
            the Job (1).
        persist_every_steps: persist when ``step % N == 0`` (0: only forced saves); default
            from the Job (50).
        keep_last: committed steps kept; default from the Job (3).

    ``state`` values may be tensors (DTensors too), numbers, strings, lists, dicts, numpy
    arrays or objects with ``state_dict()`` / ``load_state_dict()`` (models, optimizers,
    LR schedulers, samplers). Every rank must call :meth:`save` for the same steps.
    """

    def __init__(
        self,
        dir: str | None = None,
        *,
        storage: str | None = None,
        memory_every_steps: int | None = None,
        persist_every_steps: int | None = None,
        keep_last: int | None = None,
    ) -> None:
        job = current_job()
        cfg = job.checkpoint if job is not None else Checkpoint()
        overrides = {"dir": dir, "storage": storage, "memory_every_steps": memory_every_steps,
                     "persist_every_steps": persist_every_steps, "keep_last": keep_last}
        self.config = attrs.evolve(cfg, **{k: v for k, v in overrides.items() if v is not None})
        self.storage: CheckpointStorage = get_host().registries.storage.get(self.config.storage)(self.config.dir)
        #: bytes of checkpoint files this process read from storage (each step's
        #: ``checkpoint.json`` and shard, and the files a reshard hands to DCP; not the few
        #: bytes of the ``latest`` marker); ``checkpoint_restored`` logs what a load read
        self.storage_bytes_read = 0
        self._job_id = os.environ.get(env.JOB_ID, "")
        self._node_id = os.environ.get(env.NODE_ID)
        self._round = int(os.environ.get(env.ROUND, "0"))
        self._agent = int(os.environ.get(env.AGENT_TOKEN, "0") or 0)
        self.restored_step: int | None = None  # the step load() restored (a save at or below it is a replay)
        self._client = None
        if _started_by_agent():
            self._client = MasterClient(os.environ[env.MASTER_ADDR])
        self._memory: MemorySnapshots | None = None
        self._agreed: tuple[int, bool] | None = None  # (step, whether every rank snapshots it): train.steps
        self._memory_off_reason: str | None = None
        self._layout_plan: LayoutPlan | None = None  # the last save's layout plan (see build_layout)
        self._saved_state: dict[str, Any] | None = None  # what the last save() saved (go_back's targets)
        global _active
        _active = weakref.ref(self)
        if self.config.memory_every_steps == 0:
            self._memory_off_reason = "checkpoint.memory_every_steps is 0"
            release_prefaulted()
        elif self._client is None:
            self._memory_off_reason = "not started by a dlrover agent"
        else:  # both a save and a restore need these: not on the first restore's clock
            import numpy.random  # noqa: F401  heavy: numpy (the RNG state's numpy part, ~7 ms)

            prestart_copy_threads()

    # ----- memory ------------------------------------------------------------------------

    def _snapshots(self, rank: int) -> MemorySnapshots | None:
        """This process's snapshot slots for ``rank``, the rank it holds now: a snapshot's
        segment name and header say which shard it is. In the live world ranks change hands
        (docs/design.md §5a): the slots of the old rank are let go (their snapshots stay for the
        agent's saver, which learns the new rank from the progress records) and new ones
        are made for the new rank."""
        if self._memory is not None and self._memory.rank != rank:
            log.info("checkpoint_rank_changed", old=self._memory.rank, rank=rank)
            self._memory.close()
            self._memory = None
        if self._memory is None and self._memory_off_reason is None:
            where = _snapshot_place(rank)
            # train.init() mapped them already and faulted their pages in (a restarted worker)
            self._memory = (take_prefaulted(**where, wait_timeout_s=self.config.persist_timeout_s)
                            or MemorySnapshots(**where, wait_timeout_s=self.config.persist_timeout_s))
        return self._memory

    def _disable_memory(self, reason: str) -> None:
        self._memory_off_reason = reason
        log.warning("checkpoint_memory_disabled", reason=reason, fallback="disk-only saves (they stall training)")
        if self._memory is not None:
            self._memory.close()
            self._memory = None

    def replicas_ready(self) -> bool:
        """Whether this rank's next memory-only save finds its newest snapshot confirmed by
        its buddy node and a slot free (:meth:`MemorySnapshots.ready_to_save`); ``True``
        where snapshots are not replicated. ``train.steps`` asks every rank at each step's
        start, in the all-reduce it makes anyway, and tells :meth:`agree`."""
        if os.environ.get(env.REPLICA_PINS) != "1" or self.config.memory_every_steps == 0:
            return True
        snapshots = self._snapshots(_rank_world()[0])
        return snapshots is None or snapshots.ready_to_save()

    def agree(self, step: int, *, ready: bool) -> None:
        """Every rank's :meth:`replicas_ready` at ``step``'s start, agreed: where not every
        rank is ready, the memory-only save of ``step`` is skipped on every rank (the
        snapshots go at the pace of their replication, the steps at their own). Without
        an agreement for a step (a loop other than ``train.steps``) a save waits for the
        replicas instead."""
        self._agreed = (int(step), bool(ready))

    def memory_steps(self) -> list[int]:
        """Steps of this rank's complete snapshots in shared memory (empty without memory)."""
        rank, world_size = _rank_world()
        snapshots = self._snapshots(rank)
        return snapshots.held_steps(world_size) if snapshots is not None else []

    def go_back(self, step: int, *, rng_only: bool = False) -> None:
        """Put the state the last :meth:`save` saved back to this rank's memory snapshot of
        ``step`` (or, before any save, the state :meth:`load` filled), in place, RNG states
        included (``rng_only``: only those: the state is at
        ``step`` already, but a step interrupted after it drew random numbers). A sharded
        job's live world does this on a member whose applied step is newer than the one
        every rank can resume after (:class:`~dlrover_core.protocol.messages.LiveAssignment`).

        Raises:
            CheckpointError: no complete snapshot of ``step`` in this rank's memory, or no
                state saved yet.
        """
        rank, world_size = _rank_world()
        snapshots = self._snapshots(rank)
        if snapshots is None or (self._saved_state is None and not rng_only):
            why = self._memory_off_reason or "this Checkpointer neither saved nor loaded a state"
            raise CheckpointError(f"cannot go back to step {step}: {why}")
        t0 = time.monotonic()
        try:
            with snapshots.read(step, world_size) as (views, metadata):
                tree = json.loads(metadata[TREE_KEY])
                if rng_only:
                    restored = restore_tree(tree, views, None, copy=True)
                else:
                    restored = restore_tree(tree, views, self._saved_state, copy=True)
        except LookupError as exc:
            raise CheckpointError(f"rank {rank} holds no complete snapshot of step {step} in memory") from exc
        if not rng_only:
            snapshots.forget_after(step)
        rng = restored.get("rng")
        if rng is not None:
            set_rng_state(rng)
        self.restored_step = step
        log.info("checkpoint_went_back", rank=rank, step=step, rng_only=rng_only,
                 load_s=round(time.monotonic() - t0, 4))

    def encode_state(self, step: int) -> bytes:
        """The state the last :meth:`save` saved (or :meth:`load` filled), as it is now, with
        this process's RNG states: one dlrover state file (the bytes a memory snapshot of
        ``step`` holds). A sharded world's member sends it to a replacement of its replica
        group (:mod:`~dlrover_core.train.peer`).

        Raises:
            CheckpointError: this Checkpointer neither saved nor loaded a state.
        """
        if self._saved_state is None:
            raise CheckpointError("cannot send the state to a replica peer: this Checkpointer neither saved nor "
                                  "loaded a state")
        rank, world_size = _rank_world()
        return encode({"state": self._saved_state, "rng": get_rng_state()}, step=step, rank=rank,
                      world_size=world_size)

    # ----- save ------------------------------------------------------------------------

    def persist_due(self, step: int) -> bool:
        every = self.config.persist_every_steps
        return every > 0 and step % every == 0

    def save(self, step: int, state: dict[str, Any], *, force: bool = False) -> bool:
        """Checkpoint ``state`` at ``step`` if the schedule says so (or ``force``, which also
        asks for it to be persisted); return whether a checkpoint was taken.

        With memory, blocks only for the copy into shared memory; persistence is
        asynchronous, and every step due for persistence is persisted and committed: when
        both of the rank's slots still wait for their persist (the storage writes slower
        than steps ask for it), a save asking for persistence waits for a free slot
        (backpressure, logged as ``checkpoint_backpressure``) and a memory-only save is
        skipped (returns False). Where snapshots are replicated (``Checkpoint.replicas``), a
        save waits until the buddy node holds the rank's newest snapshot, except in
        ``train.steps``: its ranks agree at each step's start (:meth:`agree`) and skip a
        memory-only save together while a buddy lags, so the snapshots go at the pace of
        their replication and the steps at their own. Without memory, blocks until this
        rank's shard is durable in storage. Every rank must save the same steps.

        Raises:
            CheckpointError: ``state`` holds an unsupported type; storage failed (disk-only);
                no slot was freed within ``Checkpoint.persist_timeout_s``; or ``step`` is at
                or below the step ``load()`` restored (the loop replays trained steps).
        """
        persist = force or self.persist_due(step)
        every = self.config.memory_every_steps
        to_memory = every > 0 and step % every == 0
        if not (persist or to_memory):
            return False
        if self.restored_step is not None and step <= self.restored_step:
            raise CheckpointError(
                f"save(step={step}) after load() restored step {self.restored_step}: steps up to "
                f"{self.restored_step} are already trained; resume the loop at restored.step + 1 "
                f"(for step in range(restored.step + 1, steps)), or these steps are trained twice")
        t0 = time.monotonic()
        rank, world_size = _rank_world()
        self._saved_state = state
        if not persist and self._agreed == (step, False):
            _replicas_behind(step)
            return False  # every rank skips this snapshot: the replicas have not caught up
        with _gc_paused():
            layout = build_layout({"state": state, "rng": get_rng_state()}, step=step, rank=rank,
                                  world_size=world_size, plan=self._layout_plan)
            self._layout_plan = layout.plan  # the next save of the same tensors reuses it
            snapshots = self._snapshots(rank)
            saved = True
            if snapshots is not None:
                try:
                    saved = snapshots.save(layout, step=step, world_size=world_size, persist=persist)
                except ShmTooSmall as exc:
                    self._disable_memory(str(exc))
                    snapshots = None
        where = "memory"
        if snapshots is not None and (snapshots.waited_s > 0.05 or not saved):
            _backpressure(step, snapshots, saved=saved)
        if not saved:
            return False  # a memory-only save while the slots wait for storage or the replicas: skipped
        if snapshots is None:
            if not persist:
                return False
            self._persist_direct(step, rank, world_size, layout)
            where = "storage"
        stall_s = time.monotonic() - t0
        writer = get_writer()
        waited_s = snapshots.waited_s if snapshots is not None else 0.0
        writer.write(CheckpointRecord(step=step, stall_s=round(stall_s, 6), where=where, persist=persist,
                                      size_bytes=layout.data_len, waited_s=round(waited_s, 6)))
        writer.mark()
        log.debug("checkpoint_saved", step=step, where=where, persist=persist, stall_s=round(stall_s, 4))
        return True

    def _persist_direct(self, step: int, rank: int, world_size: int, layout: Any) -> None:
        """Write this rank's shard to storage and get the step committed."""
        t0 = time.monotonic()
        path = shard_path(step, rank, self._round)
        try:
            with self.storage.open_write(path) as f:
                crc = _CrcWriter(f)
                layout.write_to(crc)
        except OSError as exc:
            raise CheckpointError(f"writing step {step} rank {rank} to {self.storage.url!r} failed: {exc}") from exc
        shard = ShardReport(node_id=int(self._node_id or 0), rank=rank, step=step, world_size=world_size,
                            round=self._round, file=path.rsplit("/", 1)[-1], token=self._agent or None, crc32=crc.crc,
                            bytes=layout.data_len, persist_s=round(time.monotonic() - t0, 6))
        if self._client is not None:
            self._client.checkpoint_shard(shard)
            return
        _barrier()
        if rank == 0:  # no master: rank 0 commits once every rank passed the barrier
            self._commit_alone(step, world_size, node_id=shard.node_id)
        _barrier()

    def _commit_alone(self, step: int, world_size: int, *, node_id: int) -> None:
        """Without a master: commit ``step`` from every rank's shard (rank 0 does, after a
        barrier), unless a step at or past it is committed; keep the last ``keep_last``."""
        try:
            latest = self.storage.latest_step()
        except (OSError, ValueError) as exc:
            log.error("checkpoint_marker_unreadable", error=str(exc))
            latest = None
        if latest is not None and step <= latest:
            return
        shards = {r: ShardReport(node_id=node_id, rank=r, step=step, world_size=world_size, round=self._round,
                                 file=shard_path(step, r, self._round).rsplit("/", 1)[-1]) for r in range(world_size)}
        try:
            meta = write_commit(self.storage, step=step, world_size=world_size, round_index=self._round, shards=shards)
        except OSError as exc:
            log.error("checkpoint_commit_failed", step=step, storage=self.storage.url,
                      error=f"{type(exc).__name__}: {exc}")
            return
        log.info("checkpoint_committed", step=step, world_size=world_size, round=self._round)
        tidy(self.storage, step, meta)
        retain(self.storage, latest=step, keep_last=self.config.keep_last)

    # ----- load ------------------------------------------------------------------------

    def _plan(self, rank: int, world_size: int) -> RestoreDecision:
        """The restore decision every rank agreed on through the master (``source``,
        ``step``, and for memory ``snapshot_round``)."""
        client = self._client
        if client is None:
            latest = self.storage.latest_step()
            return RestoreDecision(state="ready", source="storage" if latest is not None else "fresh", step=latest)
        snapshots = self._snapshots(rank)
        held = snapshots.held(world_size) if snapshots is not None else []
        request = RestorePlanRequest(round=self._round, rank=rank, world_size=world_size, memory=tuple(held),
                                     memory_steps=tuple(sorted({s for s, _ in held})))
        answer = self._ask(functools.partial(client.restore_plan, request), rank, "restore_plan")
        if answer.state == "failed":
            raise CheckpointError(answer.reason)
        return answer

    def _ask(self, ask: Callable[[], A], rank: int, what: str) -> A:
        """Ask the master until it answers anything but ``waiting`` (every rank has spoken),
        at most ``Failure.collective_timeout_s``."""
        job = current_job()
        timeout_s = job.failure.collective_timeout_s if job is not None else 300.0
        deadline = time.monotonic() + timeout_s
        while True:
            answer = ask()
            if answer.state != "waiting":
                return answer
            if time.monotonic() > deadline:
                raise CheckpointError(f"ranks did not agree on a restore within {timeout_s:g} s "
                                      f"(rank {rank} waited in {what})")
            time.sleep(0.005)

    def _verified_storage_step(self, step: int, rank: int, world_size: int) -> tuple[int, bytes, dict[str, Any]]:
        """Read and check this rank's shard of ``step``; agree with every rank through the
        master; on a damaged shard anywhere, go to the previous intact committed step.
        Returns ``(step, shard bytes, checkpoint.json)``."""
        while True:
            try:
                data, meta = self._read_shard(step, rank)
                ok, error = True, ""
            except CheckpointError as exc:
                data, meta, ok, error = b"", {}, False, str(exc)
                log.error("checkpoint_shard_damaged", rank=rank, step=step, error=error)
            client = self._client
            if client is None:
                if not ok:
                    raise CheckpointError(error)
                return step, data, meta
            report = RestoreVerify(round=self._round, rank=rank, world_size=world_size, step=step, ok=ok, error=error)
            answer = self._ask(functools.partial(client.restore_verify, report), rank, "restore_verify")
            if answer.state == "ok":
                return step, data, meta
            if answer.state == "failed" or answer.step is None:
                raise CheckpointError(answer.reason)
            log.warning("checkpoint_fallback", rank=rank, damaged_step=step, step=answer.step, reason=answer.reason)
            step = answer.step

    def load(self, state: dict[str, Any] | None = None) -> Restored | None:
        """Restore the newest checkpoint every rank can load, or return ``None`` (fresh start).

        RNG states are restored as a side effect. When ``state`` is given, each of its values
        with ``load_state_dict`` gets the saved value of the same key (DTensor / FSDP2
        states are resharded when the world size changed), and tensors are copied in place.
        Every rank must call it (it agrees with the others through the master). A storage
        step whose shard fails its header or CRC check on any rank is skipped by every rank
        for the previous intact committed step (logged as ``checkpoint_fallback``). A sharded
        job's replacement loads its shard of the step its peers resume after from its node's
        memory, or, where its node lacks it, receives it from a live member of its replica
        group (HSDP; ``source="peer"``).

        Raises:
            CheckpointError: no committed step is intact, or the checkpoint lacks a key of
                ``state``.
        """
        sharded_join = joined()
        if is_live() and is_joiner() and sharded_join is None:  # its state comes from a live peer, in train.steps()
            log.info("checkpoint_load_skipped", reason="a replacement joins the running world with its peers' state")
            return None
        t0, read_before = time.monotonic(), self.storage_bytes_read
        rank, world_size = _rank_world()
        if sharded_join is not None:  # a sharded job's replacement: its shard of the step its peers resume after
            plan = RestoreDecision(state="ready", source="memory" if sharded_join.resume_step >= 0 else "fresh",
                                   step=sharded_join.resume_step if sharded_join.resume_step >= 0 else None,
                                   snapshot_round=None)
            self._snapshots(rank)  # (maps the slots: memory may not be on the plan's path below otherwise)
        else:
            plan = self._plan(rank, world_size)
        source, step = plan.source, plan.step
        if source == "fresh" or step is None:
            log.info("checkpoint_fresh_start", rank=rank, dir=self.storage.url)
            if self._memory is not None:
                self._memory.forget_after(-1)
            get_writer().mark()
            return None
        if state is not None:
            self._saved_state = state  # (go_back's targets until a save names them)
        if source == "memory" and sharded_join is not None and step not in self.memory_steps():
            # this rank's node lacks the step: a live member of its replica group (HSDP) sends it
            job = current_job()
            data = peer.agree(step, rank=rank, world_size=world_size, generation=sharded_join.generation,
                              needs_state=True, groups=job.replica_groups(world_size) if job is not None else [],
                              encode_state=None)
            entries, metadata, start = parse_header(data)
            restored = restore_tree(json.loads(metadata[TREE_KEY]), tensor_views(data, start, entries), state,
                                    copy=True)
            source = "peer"
        elif source == "memory":
            assert self._memory is not None
            with self._memory.read(step, world_size, plan.snapshot_round) as (views, metadata):
                restored = restore_tree(json.loads(metadata[TREE_KEY]), views, state, copy=True)
        else:
            step, data, meta = self._verified_storage_step(step, rank, world_size)
            restored = self._load_storage(step, rank, world_size, state, data=data, meta=meta)
        if self._memory is not None:  # newer snapshots belong to an abandoned lineage
            self._memory.forget_after(step, keep_round=plan.snapshot_round if source == "memory" else None)
        rng = restored.get("rng")
        if rng is not None:
            set_rng_state(rng)
        if source == "peer" and state is not None:
            self._keep_received(step, rank, world_size, state)
        load_s = time.monotonic() - t0
        self.restored_step = step
        writer = get_writer()
        writer.write(RestoreRecord(step=step, source=source, load_s=round(load_s, 6)))
        writer.mark()
        log.info("checkpoint_restored", rank=rank, step=step, source=source, load_s=round(load_s, 4),
                 storage_bytes=self.storage_bytes_read - read_before)
        return Restored(step=step, state=restored["state"], source=source, load_s=load_s)

    def _keep_received(self, step: int, rank: int, world_size: int, state: dict[str, Any]) -> None:
        """Snapshot the state a replica peer sent as this rank's memory snapshot of ``step``,
        as a replacement restored from memory holds it: every rank of the node then holds
        the step its peers resume after where they hold it, which the node's replicas are
        taken of (a buddy replicates the newest step every rank of a node holds; a rank
        without it would keep the others' newest snapshots unconfirmed, and their saves
        skipped, for good), and a second failure finds it here. Unpinned, and only into a
        slot free now: where the node's other ranks lack the step it must not wait for a
        replica of it (:meth:`MemorySnapshots.save`)."""
        snapshots = self._snapshots(rank)
        if snapshots is None:
            return
        layout = build_layout({"state": state, "rng": get_rng_state()}, step=step, rank=rank, world_size=world_size)
        try:
            kept = snapshots.save(layout, step=step, world_size=world_size, persist=False, unpinned=True)
        except ShmTooSmall as exc:
            self._disable_memory(str(exc))
            return
        if kept:
            log.info("checkpoint_peer_state_kept", rank=rank, step=step, waited_s=round(snapshots.waited_s, 4))
        else:
            log.warning("checkpoint_peer_state_not_kept", rank=rank, step=step, waited_for=snapshots.waited_for,
                        reason="no snapshot slot was free: this rank holds no snapshot of the step it resumed after")

    def _read_storage(self, path: str) -> bytes:
        data = self.storage.read(path)
        self.storage_bytes_read += len(data)
        return data

    def _read_shard(self, step: int, rank: int) -> tuple[bytes, dict[str, Any]]:
        """This rank's shard of committed ``step`` (or rank 0's when the step was saved by
        fewer ranks), checked: ``checkpoint.json`` readable, header parseable, CRC32 equal to
        the committed one. Raises CheckpointError naming what is wrong."""
        try:
            meta = json.loads(self._read_storage(f"{step_dir(step)}/checkpoint.json"))
            saved_world = int(meta["world_size"])
            src_rank = rank if rank < saved_world else 0
            entry = (meta.get("shards") or {}).get(str(src_rank), {})
            name = entry.get("file")
            path = f"{step_dir(step)}/{name}" if name else shard_path(step, src_rank)
            data = self._read_storage(path)
        except (OSError, KeyError, ValueError) as exc:
            raise CheckpointError(f"committed step {step} in {self.storage.url!r} is unreadable: "
                                  f"{type(exc).__name__}: {exc}") from exc
        expected = entry.get("crc32")
        if expected is None:
            parse_header(data)  # CheckpointError for a torn file
        else:
            actual = data_crc32(data)  # (parses the header too)
            if actual != expected:
                raise CheckpointError(f"step {step} rank {src_rank}: CRC32 {actual:#x} != committed {expected:#x} "
                                      "(corrupt file)")
        return data, meta

    def _load_storage(self, step: int, rank: int, world_size: int, state: dict[str, Any] | None, *,
                      data: bytes | None = None, meta: dict[str, Any] | None = None) -> dict[str, Any]:
        if data is None or meta is None:
            data, meta = self._read_shard(step, rank)
        saved_world = int(meta["world_size"])
        src_rank = rank if rank < saved_world else 0
        entries, metadata, start = parse_header(data)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only buffer: the views are only read
            views = tensor_views(data, start, entries)
        tree = json.loads(metadata[TREE_KEY])
        if src_rank != rank:
            log.warning("checkpoint_rank_missing", rank=rank, saved_world_size=saved_world, using_rank=src_rank)
            tree = without_rng(tree)
        if state is not None and (saved_world != world_size or shards_differ(views, state)):
            step_path = Path(self.storage.url.removeprefix("file://")) / step_dir(step)
            files = ([s["file"] for s in (meta.get("shards") or {}).values() if "file" in s]
                     or [p.name for p in step_path.glob("*.safetensors")])
            views = reshard(step_path, views, state, storage=self.storage,
                            sharded=json.loads(metadata.get(DTENSORS_KEY, "[]")), files=files)
            self.storage_bytes_read += sum((step_path / f).stat().st_size for f in files)  # (what DCP read)
        return restore_tree(tree, views, state, copy=True)


class _CrcWriter:
    """A binary stream wrapper that keeps a CRC32 of what follows the safetensors header."""

    def __init__(self, f: Any) -> None:
        self._f = f
        self._header_done = False
        self.crc = 0

    def write(self, data: Any) -> int:
        if self._header_done:
            self.crc = zlib.crc32(data, self.crc)
        self._header_done = True
        return self._f.write(data)
