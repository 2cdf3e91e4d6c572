"""Committing a checkpoint step in storage, and keeping the last N.

A step is committed by writing ``step_<S>/checkpoint.json`` (every shard's file, size, CRC32
and incarnation), then the atomic ``latest`` marker. The master commits once every rank
reported its shard durable (:mod:`dlrover_core.master.checkpoints`); a job without a master
commits from rank 0 after a barrier (:class:`dlrover_core.train.Checkpointer`). Both use
these functions; they raise nothing but :class:`OSError` from :func:`write_commit`, and the
clean-ups are best effort (logged).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Collection, Mapping
from typing import Any

from dlrover_core.checkpoint.layout import FORMAT_VERSION
from dlrover_core.checkpoint.saver import step_dir
from dlrover_core.logging import get_logger
from dlrover_core.protocol.messages import ShardReport
from dlrover_core.storage.base import CheckpointStorage

__all__ = ["committed_steps", "retain", "tidy", "write_commit"]

log = get_logger()

_STEP_DIR = re.compile(r"step_(\d{10})/")


def _shard_meta(shard: ShardReport) -> dict[str, Any]:
    """A shard's entry in ``checkpoint.json`` (fields it was not reported with left out)."""
    meta: dict[str, Any] = {"file": shard.file, "crc32": shard.crc32, "bytes": shard.bytes, "round": shard.round}
    return {k: v for k, v in meta.items() if v is not None and v != ""}


def write_commit(storage: CheckpointStorage, *, step: int, world_size: int, round_index: int,
                 shards: Mapping[int, ShardReport]) -> dict[str, Any]:
    """Commit ``step`` (written by incarnation ``round_index``) from its ranks' shards:
    ``checkpoint.json``, then the ``latest`` marker. Returns the ``checkpoint.json`` written.

    Raises:
        OSError: the storage refused either write (the step is not committed).
    """
    meta = {
        "step": step, "world_size": world_size, "format": FORMAT_VERSION, "time": time.time(),
        "round": round_index,
        "shards": {str(r): _shard_meta(shards[r]) for r in sorted(shards)},
    }
    storage.write_bytes(f"{step_dir(step)}/checkpoint.json", json.dumps(meta, indent=1).encode())
    storage.commit(step)
    return meta


def tidy(storage: CheckpointStorage, step: int, meta: dict[str, Any]) -> None:
    """Delete files of a committed step that its commit does not name (late writes of a
    stale incarnation). Best effort."""
    named = {f"{step_dir(step)}/{s['file']}" for s in meta["shards"].values() if "file" in s}
    if not named:
        return
    try:
        for path in storage.list(step_dir(step)):
            if path.endswith(".safetensors") and path not in named:
                storage.delete(path)
    except OSError as exc:
        log.warning("checkpoint_tidy_failed", step=step, error=str(exc))


def committed_steps(storage: CheckpointStorage, latest: int | None) -> list[int]:
    """Committed steps still in storage (with their ``checkpoint.json``) up to ``latest``,
    oldest first (``[latest]`` when the storage cannot be listed)."""
    if latest is None:
        return []
    try:
        steps = sorted({int(m.group(1)) for p in storage.list() if (m := _STEP_DIR.match(p))})
        return [s for s in steps if s <= latest and storage.exists(f"{step_dir(s)}/checkpoint.json")]
    except OSError as exc:
        log.warning("checkpoint_list_failed", error=str(exc))
        return [latest]


def retain(storage: CheckpointStorage, *, latest: int | None, keep_last: int, damaged: Collection[int] = ()) -> None:
    """Keep the last ``keep_last`` intact committed steps up to ``latest``; delete older step
    directories and those below ``latest`` that never completed. Best effort."""
    try:
        steps = sorted({int(m.group(1)) for p in storage.list() if (m := _STEP_DIR.match(p))})
        committed = [s for s in steps if latest is not None and s <= latest
                     and storage.exists(f"{step_dir(s)}/checkpoint.json") and s not in damaged]
        keep = set(committed[-keep_last:])
        for s in steps:
            if latest is not None and s <= latest and s not in keep:
                storage.delete(step_dir(s))
    except OSError as exc:  # retention is best effort; the commit stands
        log.warning("checkpoint_retention_failed", error=str(exc))
