"""``ElasticSampler``: a data position that survives a change of world size.

The epoch is a permutation of the dataset's indices (seeded by ``seed + epoch``). The
position is the number of samples the whole job has consumed in the epoch — the same on
every rank. Each step, the job consumes the next ``world_size * batch_size`` indices of the
permutation and rank ``r`` takes every ``world_size``-th of them starting at ``r``. Saved in
a checkpoint and loaded at another world size, training goes on from the same position: no
sample of the epoch is skipped or seen twice (DLRover's ``ElasticDistributedSampler`` keeps
a completed-sample count the same way).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["ElasticSampler", "accumulation_steps"]


class ElasticSampler:
    """Per-rank batches of dataset indices with an elastic, checkpointable position.

    Args:
        dataset_size: number of samples (>= 1).
        batch_size: samples per rank per step (>= 1).
        shuffle: permute the indices every epoch (``torch.randperm`` seeded ``seed + epoch``).
        seed: shuffle seed, the same on every rank.
        drop_last: end the epoch when fewer than ``world_size * batch_size`` samples remain;
            otherwise the last step splits the remainder (some ranks may get fewer, or none).
        rank, world_size: default: the worker's (``train.worker_info()``).

    Raises:
        ValueError: a size is not a positive integer.
    """

    def __init__(
        self,
        dataset_size: int,
        batch_size: int,
        *,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        if dataset_size < 1 or batch_size < 1:
            raise ValueError(f"dataset_size ({dataset_size}) and batch_size ({batch_size}) must be >= 1")
        if rank is None or world_size is None:
            from dlrover_core.train.context import worker_info

            info = worker_info()
            rank = info.rank if rank is None else rank
            world_size = info.world_size if world_size is None else world_size
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.dataset_size, self.batch_size = dataset_size, batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self.consumed = 0
        self._order: list[int] | None = None

    def _permutation(self) -> list[int]:
        if self._order is None:
            if self.shuffle:
                import torch

                g = torch.Generator().manual_seed(self.seed + self.epoch)
                self._order = torch.randperm(self.dataset_size, generator=g).tolist()
            else:
                self._order = list(range(self.dataset_size))
        return self._order

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning."""
        self.epoch, self.consumed, self._order = epoch, 0, None

    def next_batch(self) -> list[int] | None:
        """This rank's indices for the next step, or ``None`` at the end of the epoch (call
        :meth:`set_epoch` or keep iterating to go on)."""
        remaining = self.dataset_size - self.consumed
        step_size = self.world_size * self.batch_size
        if remaining <= 0 or (self.drop_last and remaining < step_size):
            return None
        window = self._permutation()[self.consumed : self.consumed + step_size]
        self.consumed += len(window)
        return window[self.rank :: self.world_size]

    def __iter__(self) -> Iterator[list[int]]:
        """Batches of the current epoch, then moves to the next epoch."""
        while (batch := self.next_batch()) is not None:
            yield batch
        self.set_epoch(self.epoch + 1)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed, "dataset_size": self.dataset_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position, at any world size.

        Raises:
            ValueError: the saved position is for another dataset size or seed.
        """
        if int(state["dataset_size"]) != self.dataset_size or int(state["seed"]) != self.seed:
            raise ValueError(f"sampler state is for dataset_size={state['dataset_size']}, seed={state['seed']}; "
                             f"this sampler has dataset_size={self.dataset_size}, seed={self.seed}")
        self.epoch, self.consumed, self._order = int(state["epoch"]), int(state["consumed"]), None


def accumulation_steps(global_batch_size: int, micro_batch_size: int, world_size: int | None = None) -> int:
    """Gradient-accumulation steps that keep the global batch constant at this world size:
    ``global_batch_size / (micro_batch_size * world_size)``.

    Raises:
        ValueError: the global batch is not a multiple of ``micro_batch_size * world_size``
            (choose ``Nodes(node_unit=...)`` so every allowed world size divides it).
    """
    if world_size is None:
        from dlrover_core.train.context import worker_info

        world_size = worker_info().world_size
    per_step = micro_batch_size * world_size
    if global_batch_size % per_step:
        raise ValueError(f"global_batch_size {global_batch_size} is not a multiple of micro_batch_size "
                         f"{micro_batch_size} x world_size {world_size} = {per_step}")
    return global_batch_size // per_step
