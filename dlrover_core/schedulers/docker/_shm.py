"""How large /dev/shm of an agent container is: Flash Checkpoint keeps its snapshots there."""

from __future__ import annotations

import math

from dlrover_core.spec import JobSpec

__all__ = ["MASTER_SHM_BYTES", "MIN_SHM_BYTES", "parse_size", "shm_size_bytes"]

_MIB = 2**20
_GIB = 2**30
#: Smallest /dev/shm an agent container gets.
MIN_SHM_BYTES = 1 * _GIB
#: /dev/shm of the master container (it holds no snapshot).
MASTER_SHM_BYTES = 256 * _MIB


def parse_size(text: str) -> int:
    """``"8g"`` → bytes; accepts a plain byte count or a ``k``/``m``/``g``/``t`` suffix (powers of 1024)."""
    value = text.strip().lower().removesuffix("b").removesuffix("i")
    units = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
    try:
        if value and value[-1] in units:
            return int(float(value[:-1]) * units[value[-1]])
        return int(value)
    except ValueError:
        raise ValueError(f"{text!r} is not a size like 8g, 512m or a number of bytes") from None


def shm_size_bytes(job: JobSpec, nproc: int, *, shm_size: str | None = None, state_mb: float | None = None) -> int:
    """/dev/shm size of an agent container, in bytes.

    Flash Checkpoint keeps two snapshot slots per rank in /dev/shm, each as large as the
    rank's state. The rule:

    - ``shm_size`` (the scheduler option) when set: exactly that;
    - else, with a state hint of S MiB per rank (``Checkpoint.state_size_mb`` where the spec
      has it, else ``state_mb``, the scheduler option) and memory snapshots on:
      ``max(1 GiB, nproc × 2 × S MiB × 1.25 + 256 MiB)``, rounded up to a MiB (25 % for
      headers and metadata, 256 MiB for what torch and gloo put there);
    - else 1 GiB (:data:`MIN_SHM_BYTES`). A state larger than the slots allow is saved to
      storage only, with a warning naming the size needed.

    Raises:
        ValueError: ``shm_size`` is not a size.
    """
    if shm_size:
        return parse_size(shm_size)
    hint = getattr(job.checkpoint, "state_size_mb", None) or state_mb
    if not hint or job.checkpoint.memory_every_steps == 0:
        return MIN_SHM_BYTES
    need = nproc * 2 * float(hint) * _MIB * 1.25 + 256 * _MIB
    return max(MIN_SHM_BYTES, math.ceil(need / _MIB) * _MIB)
