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


def val_batches(val: torch.Tensor, *, block_size: int, batch_size: int, n_batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A fixed list of validation batches, evenly spaced over the held-out bytes."""
    n = n_batches * batch_size
    stride = max(1, (len(val) - block_size - 1) // n)
    starts = [i * stride for i in range(n)]
    windows = torch.stack([val[s : s + block_size + 1] for s in starts]).long()
    return [(w[:, :-1], w[:, 1:]) for w in windows.split(batch_size)]
