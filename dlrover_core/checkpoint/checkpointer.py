"""The worker's :class:`Checkpointer`: ``save(step, state)`` and ``load()``.

Layout in storage (one directory per step, one self-contained safetensors file per rank)::

    step_0000000150/rank_00000.safetensors
    step_0000000150/rank_00001.safetensors
    step_0000000150/checkpoint.json        {"step": 150, "world_size": 2, "format": ...}
    latest                                 "150" — written last, atomically: the commit

A step is committed only after every rank's file is durable (each file: staging name, fsync,
rename) and all ranks passed a barrier; a crash at any point leaves the previous committed
step loadable and the torn one invisible (``load`` only follows ``latest``).
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import attrs

from dlrover_core.checkpoint.rng import get_rng_state, set_rng_state
from dlrover_core.checkpoint.state_format import FORMAT_VERSION, decode, encode
from dlrover_core.errors import CheckpointError
from dlrover_core.logging import get_logger
from dlrover_core.storage.base import CheckpointStorage

__all__ = ["Checkpointer", "Restored"]

log = get_logger()

_STEP_DIR = re.compile(r"step_(\d{10})")


def step_dir(step: int) -> str:
    return f"step_{step:010d}"


@attrs.frozen(kw_only=True)
class Restored:
    """A loaded checkpoint.

    Attributes:
        step: the step it was saved at; resume training at ``step + 1``.
        state: the saved state, tensors on CPU.
        source: ``"storage"`` or ``"memory"``.
        load_s: seconds the load took.
    """

    step: int
    state: dict[str, Any]
    source: str
    load_s: float


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    from dlrover_core.train.context import worker_info

    info = worker_info()
    return info.rank, info.world_size


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


class Checkpointer:
    """Saves and restores a worker's training state, including RNG states.

    Args:
        dir: storage location; default ``Job.checkpoint.dir``.
        storage: registered storage name; default ``Job.checkpoint.storage`` (``posix``).
        persist_every_steps: persist when ``step % N == 0``; default from the Job (50).
        keep_last: committed steps kept in storage; default from the Job (3).

    ``state`` values may be tensors, numbers, strings, lists, dicts, numpy arrays or objects
    with ``state_dict()`` / ``load_state_dict()`` (models, optimizers, samplers). Every rank
    must call :meth:`save` with the same steps (it ends with a barrier).
    """

    def __init__(
        self,
        dir: str | None = None,
        *,
        storage: str | None = None,
        persist_every_steps: int | None = None,
        keep_last: int | None = None,
    ) -> None:
        from dlrover_core.plugins import get_host
        from dlrover_core.spec import Checkpoint
        from dlrover_core.train.context import current_job

        job = current_job()
        cfg = job.checkpoint if job is not None else Checkpoint()
        cfg = attrs.evolve(
            cfg,
            **{k: v for k, v in (("dir", dir), ("storage", storage), ("persist_every_steps", persist_every_steps),
                                 ("keep_last", keep_last)) if v is not None},
        )
        self.config = cfg
        self.storage: CheckpointStorage = get_host().registries.storage.get(cfg.storage)(cfg.dir)

    # ----- save ------------------------------------------------------------------------

    def should_persist(self, step: int) -> bool:
        every = self.config.persist_every_steps
        return every > 0 and step % every == 0

    def save(self, step: int, state: dict[str, Any], *, force: bool = False) -> bool:
        """Save ``state`` at ``step`` if the schedule says so (or ``force``); return whether it saved.

        Blocks until every rank's shard is durable and the step is committed.

        Raises:
            CheckpointError: ``state`` holds an unsupported type, or storage failed.
        """
        from dlrover_core.train.progress import get_writer

        if not (force or self.should_persist(step)):
            return False
        t0 = time.monotonic()
        rank, world_size = _rank_world()
        data = encode({"state": state, "rng": get_rng_state()},
                      {"step": str(step), "rank": str(rank), "world_size": str(world_size)})
        try:
            self.storage.write_bytes(f"{step_dir(step)}/rank_{rank:05d}.safetensors", data)
        except OSError as exc:
            raise CheckpointError(f"writing step {step} rank {rank} to {self.storage.url!r} failed: {exc}") from exc
        _barrier()
        if rank == 0:
            meta = {"step": step, "world_size": world_size, "format": FORMAT_VERSION, "time": time.time()}
            self.storage.write_bytes(f"{step_dir(step)}/checkpoint.json", json.dumps(meta).encode())
            self.storage.commit(step)
            self._retain(step)
        stall_s = time.monotonic() - t0
        writer = get_writer()
        if rank == 0:
            writer.write({"type": "checkpoint", "step": step, "stall_s": round(stall_s, 6), "committed": True,
                          "bytes": len(data)})
            log.info("checkpoint_committed", step=step, stall_s=round(stall_s, 3), mb=round(len(data) / 2**20, 2))
        writer.mark()
        return True

    def _retain(self, committed: int) -> None:
        steps = sorted({int(m.group(1)) for p in self.storage.list() if (m := _STEP_DIR.match(p))})
        keep = {s for s in steps if s <= committed}
        keep = set(sorted(keep)[-self.config.keep_last :])
        for s in steps:
            if s not in keep:
                # older than the retention window, or newer than the commit: a torn save
                # of an abandoned lineage (all ranks have passed the barrier of `committed`).
                self.storage.delete(step_dir(s))

    # ----- load ------------------------------------------------------------------------

    def load(self, state: dict[str, Any] | None = None) -> Restored | None:
        """Restore the newest committed step, or return ``None`` when there is none.

        RNG states are restored as a side effect. When ``state`` is given, each of its values
        with ``load_state_dict`` gets the saved value of the same key, and tensors are copied
        in place.

        Raises:
            CheckpointError: the committed checkpoint is unreadable or lacks a key of ``state``.
        """
        from dlrover_core.train.progress import get_writer

        t0 = time.monotonic()
        step = self.storage.latest_step()
        if step is None:
            log.info("checkpoint_fresh_start", dir=self.storage.url)
            return None
        rank, _ = _rank_world()
        try:
            meta = json.loads(self.storage.read(f"{step_dir(step)}/checkpoint.json"))
            saved_world = int(meta["world_size"])
            src_rank = rank if rank < saved_world else 0
            if src_rank != rank:
                log.warning("checkpoint_rank_missing", rank=rank, saved_world_size=saved_world, using_rank=src_rank)
            payload, _ = decode(self.storage.read(f"{step_dir(step)}/rank_{src_rank:05d}.safetensors"))
        except (OSError, KeyError, ValueError) as exc:
            raise CheckpointError(f"committed step {step} in {self.storage.url!r} is unreadable: {exc}") from exc
        set_rng_state(payload["rng"])
        restored = payload["state"]
        if state is not None:
            _apply(state, restored)
        load_s = time.monotonic() - t0
        writer = get_writer()
        writer.write({"type": "restore", "step": step, "source": "storage", "load_s": round(load_s, 6)})
        writer.mark()
        log.info("checkpoint_restored", step=step, source="storage", load_s=round(load_s, 3))
        return Restored(step=step, state=restored, source="storage", load_s=load_s)


def _apply(targets: dict[str, Any], restored: dict[str, Any]) -> None:
    import torch

    for key, target in targets.items():
        if key not in restored:
            raise CheckpointError(f"checkpoint has no entry {key!r} (it has: {', '.join(map(str, restored))})")
        if hasattr(target, "load_state_dict"):
            target.load_state_dict(restored[key])
        elif isinstance(target, torch.Tensor):
            with torch.no_grad():
                target.copy_(restored[key])
