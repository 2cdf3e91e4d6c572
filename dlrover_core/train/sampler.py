"""``ElasticSampler``: a data position that survives a change of world size.

The epoch is a permutation of the dataset's indices (seeded by ``seed + epoch``). The
position is the number of samples the whole job has consumed in the epoch — the same on
every rank. Each step, the job consumes the next ``world_size * batch_size`` indices of the
permutation and rank ``r`` takes every ``world_size``-th of them starting at ``r``. Saved in
a checkpoint and loaded at another world size, training goes on from the same position: no
sample of the epoch is skipped or seen twice (DLRover's ``ElasticDistributedSampler`` keeps
a completed-sample count the same way).

The end of an epoch is one ``None`` from :meth:`ElasticSampler.next_batch`, at the same step on
every rank; the call after it starts the next epoch. A training loop therefore never waits on
``None`` forever::

    for step in range(start, steps):
        ids = sampler.next_batch()
        if ids is None:               # the epoch ended: the next call starts the next one
            ids = sampler.next_batch()
        ...                           # ids may be [] on some ranks in an epoch's last step
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from dlrover_core.train.context import worker_info

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
        ValueError: a size is not a positive integer; or, with ``drop_last``, the dataset is
            smaller than one step (``world_size * batch_size``), so every epoch would be empty.
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
            info = worker_info()
            rank = info.rank if rank is None else rank
            world_size = info.world_size if world_size is None else world_size
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if drop_last and dataset_size < world_size * batch_size:
            raise ValueError(f"with drop_last=True every epoch is empty: dataset_size ({dataset_size}) is smaller than "
                             f"one step, world_size ({world_size}) x batch_size ({batch_size}) = "
                             f"{world_size * batch_size}; use drop_last=False or a smaller batch_size")
        self.dataset_size, self.batch_size = dataset_size, batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.rank, self.world_size = rank, world_size
        #: samples per step, job-wide: kept when the live world shrinks or grows
        self.global_batch_size = world_size * batch_size
        self.epoch = 0
        self.consumed = 0
        self._order: list[int] | None = None
        self._epoch_ended = False  # next_batch returned this epoch's None: the next call moves on

    def _permutation(self) -> list[int]:
        if self._order is None:
            if self.shuffle:
                import torch  # heavy: only a shuffling sampler needs it

                g = torch.Generator().manual_seed(self.seed + self.epoch)
                self._order = torch.randperm(self.dataset_size, generator=g).tolist()
            else:
                self._order = list(range(self.dataset_size))
        return self._order

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning."""
        self.epoch, self.consumed, self._order, self._epoch_ended = epoch, 0, None, False

    def next_batch(self) -> list[int] | None:
        """This rank's indices for the next step, or ``None`` once at the end of the epoch.

        ``None`` comes at the same step on every rank (the position is job-wide). The call
        after it starts the next epoch (``epoch + 1``, reshuffled), so a loop that simply keeps
        calling goes on; :meth:`set_epoch` starts a chosen epoch instead. A rank may get
        ``[]`` in an epoch's last step when ``drop_last`` is false and fewer samples than
        ranks remain: it still takes part in that step.
        """
        step_size = self.global_batch_size
        if self._epoch_ended:
            self.set_epoch(self.epoch + 1)
        remaining = self.dataset_size - self.consumed
        if remaining <= 0 or (self.drop_last and remaining < step_size):
            self._epoch_ended = True
            return None
        window = self._permutation()[self.consumed : self.consumed + step_size]
        self.consumed += len(window)
        return window[self.rank :: self.world_size]

    def set_world(self, rank: int, world_size: int) -> None:
        """Follow a new world (``train.steps()`` calls it when the live world re-forms): the
        global batch stays ``global_batch_size``, so each rank's share is about
        ``global_batch_size / world_size`` (accumulate over micro-batches to keep memory flat).

        Raises:
            ValueError: ``rank`` is not in ``[0, world_size)``.
        """
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        self.rank, self.world_size = rank, world_size

    def __iter__(self) -> Iterator[list[int]]:
        """Batches of the rest of the current epoch (of the next one, if the current one has
        already ended); afterwards the sampler stands at the start of the epoch after them."""
        while (batch := self.next_batch()) is not None:
            yield batch
        self.set_epoch(self.epoch + 1)

    def state_dict(self) -> dict[str, Any]:
        """The job-wide position (the same on every rank), for a checkpoint."""
        return {"epoch": self.epoch, "consumed": self.consumed, "seed": self.seed, "dataset_size": self.dataset_size,
                "epoch_ended": self._epoch_ended}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at a saved position, at any world size.

        Raises:
            ValueError: the saved position is for another dataset size or seed.
        """
        if int(state["dataset_size"]) != self.dataset_size or int(state["seed"]) != self.seed:
            raise ValueError(f"sampler state is for dataset_size={state['dataset_size']}, seed={state['seed']}; "
                             f"this sampler has dataset_size={self.dataset_size}, seed={self.seed}")
        self.epoch, self.consumed, self._order = int(state["epoch"]), int(state["consumed"]), None
        self._epoch_ended = bool(state.get("epoch_ended", False))  # absent in states saved before it existed


def accumulation_steps(global_batch_size: int, micro_batch_size: int, world_size: int | None = None) -> int:
    """Gradient-accumulation steps that keep the global batch constant at this world size:
    ``global_batch_size / (micro_batch_size * world_size)``.

    Raises:
        ValueError: the global batch is not a multiple of ``micro_batch_size * world_size``
            (choose ``Nodes(node_unit=...)`` so every allowed world size divides it).
    """
    if world_size is None:
        world_size = worker_info().world_size
    per_step = micro_batch_size * world_size
    if global_batch_size % per_step:
        raise ValueError(f"global_batch_size {global_batch_size} is not a multiple of micro_batch_size "
                         f"{micro_batch_size} x world_size {world_size} = {per_step}")
    return global_batch_size // per_step
