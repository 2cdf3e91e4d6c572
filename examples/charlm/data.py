"""Text corpus, its windows, and fixed validation batches.

The default corpus is the source of the Python standard library (present offline on every
machine that runs Python). Any text file can be used instead (``--data``).
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

_SKIP_DIRS = {"site-packages", "test", "tests", "encodings", "idlelib", "pydoc_data", "__pycache__"}


def load_corpus(path: str | None = None, max_bytes: int = 4_000_000, val_fraction: float = 0.1) -> tuple[torch.Tensor, torch.Tensor]:
    """``(train, val)`` uint8 tensors of the corpus.

    With ``path``, the file's first ``max_bytes``; its last ``val_fraction`` is held out.
    Without, the Python standard library's ``.py`` files in sorted order (skipping tests,
    codec tables and generated docs) up to ``max_bytes``; every 10th file is held out, so
    both splits are the same kind of code.
    """
    if path:
        data = Path(path).read_bytes()[:max_bytes]
        if len(data) < 10_000:
            raise SystemExit(f"--data {path}: only {len(data)} bytes; need at least 10000")
        n_val = int(len(data) * val_fraction)
        return _tensor(data[:-n_val]), _tensor(data[-n_val:])
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train, val, total = [], [], 0
    every = max(2, round(1 / val_fraction))
    files = [f for f in sorted(stdlib.rglob("*.py")) if not _SKIP_DIRS & set(f.relative_to(stdlib).parts)]
    for i, f in enumerate(files):
        try:
            b = f.read_bytes()
        except OSError:
            continue
        (val if i % every == every - 1 else train).append(b)
        total += len(b)
        if total >= max_bytes:
            break
    return _tensor(b"".join(train)), _tensor(b"".join(val))


def _tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def n_windows(data: torch.Tensor, block_size: int) -> int:
    """How many non-overlapping ``block_size + 1``-byte windows ``data`` holds."""
    return (len(data) - 1) // (block_size + 1)


def windows(data: torch.Tensor, ids: list[int], block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)`` for window indices ``ids``: int64 ``[len(ids), block_size]`` inputs and
    next-byte targets."""
    starts = torch.tensor(ids, dtype=torch.long) * (block_size + 1)
    w = torch.stack([data[s : s + block_size + 1] for s in starts.tolist()]).long()
    return w[:, :-1], w[:, 1:]


class WindowSampler:
    """Batches of ``block_size + 1``-byte windows of ``data`` for one rank, without dlrover
    (``benchmarks/optim.py`` uses it; ``train.py`` uses ``train.ElasticSampler`` over
    :func:`n_windows`). Each epoch shuffles the window starts with a generator seeded by
    ``seed + epoch``; rank ``r`` of ``world_size`` takes every ``world_size``-th window.
    """

    def __init__(self, data: torch.Tensor, *, block_size: int, batch_size: int, rank: int, world_size: int,
                 seed: int) -> None:
        self.data, self.block_size, self.batch_size = data, block_size, batch_size
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.epoch, self.index = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(n_windows(self.data, self.block_size), generator=g)[self.rank :: self.world_size]

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(x, y)``: int64 ``[batch, block]`` inputs and next-byte targets."""
        if self.index + self.batch_size > len(self._order):
            self.epoch, self.index = self.epoch + 1, 0
            self._order = self._permutation()
        ids = self._order[self.index : self.index + self.batch_size].tolist()
        self.index += self.batch_size
        return windows(self.data, ids, self.block_size)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.index = int(state["epoch"]), int(state["index"])
        self._order = self._permutation()


def val_batches(val: torch.Tensor, *, block_size: int, batch_size: int, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed list of validation batches, evenly spaced over the held-out bytes."""
    n = n_batches * batch_size
    stride = max(1, (len(val) - block_size - 1) // n)
    starts = [i * stride for i in range(n)]
    windows = torch.stack([val[s : s + block_size + 1] for s in starts]).long()
    return [(w[:, :-1], w[:, 1:]) for w in windows.split(batch_size)]
