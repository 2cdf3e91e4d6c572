"""The master's part of Flash Checkpoint: commit steps, keep the last N, agree on restores.

* A step is committed — ``step_<S>/checkpoint.json`` (every shard's size and CRC32), then
  the atomic ``latest`` marker — only when every rank of step S reported its shard durable.
  Commits only move forward; a shard of a step at or below the last commit is ignored.
* Retention keeps the last ``keep_last`` committed steps; older step directories, and those
  below the last commit that never completed, are deleted.
* Restore: every rank reports which steps it holds in memory; when all ranks of the round
  have, the newest step held by all of them wins if it is not older than the last commit;
  otherwise the last commit is loaded from storage; otherwise training starts fresh.
  (With two slots per rank, a rank killed while overwriting its newer slot during a long
  persist of the older one holds only the older step; if no step is common, storage wins.)
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Any

from dlrover_core.checkpoint.layout import FORMAT_VERSION
from dlrover_core.checkpoint.saver import step_dir
from dlrover_core.logging import get_logger
from dlrover_core.storage.base import CheckpointStorage

__all__ = ["CheckpointCoordinator"]

log = get_logger()

_STEP_DIR = re.compile(r"step_(\d{10})/")


class CheckpointCoordinator:
    """Commits and restore decisions for one job (not thread-safe: the master holds its lock).

    Args:
        storage: the job's checkpoint storage.
        keep_last: committed steps to keep.
        event: called as ``event(kind, **data)`` for ``checkpoint_committed``,
            ``checkpoint_commit_failed`` and ``restore_decided``.
    """

    def __init__(self, storage: CheckpointStorage, *, keep_last: int, event: Callable[..., None]) -> None:
        self.storage = storage
        self.keep_last = keep_last
        self._event = event
        try:
            self.latest: int | None = storage.latest_step()
        except (OSError, ValueError) as exc:
            log.error("checkpoint_marker_unreadable", error=str(exc))
            self.latest = None
        self._shards: dict[tuple[int, int], dict[int, dict[str, Any]]] = {}
        self._plans: dict[tuple[int, int], dict[int, list[int]]] = {}
        self._decisions: dict[tuple[int, int], dict[str, Any]] = {}

    # ----- commits -----------------------------------------------------------------------

    def shard_done(self, *, step: int, rank: int, world_size: int, info: dict[str, Any]) -> dict[str, Any]:
        """Record a durable shard; commit its step when all ranks are in. Returns
        ``{"committed": latest}``."""
        if self.latest is not None and step <= self.latest:
            return {"committed": self.latest}
        shards = self._shards.setdefault((step, world_size), {})
        shards[rank] = info
        if len(shards) == world_size:
            self._commit(step, world_size, shards)
        return {"committed": self.latest}

    def _commit(self, step: int, world_size: int, shards: dict[int, dict[str, Any]]) -> None:
        meta = {
            "step": step, "world_size": world_size, "format": FORMAT_VERSION, "time": time.time(),
            "shards": {str(r): {k: shards[r][k] for k in ("crc32", "bytes") if k in shards[r]} for r in sorted(shards)},
        }
        try:
            self.storage.write_bytes(f"{step_dir(step)}/checkpoint.json", json.dumps(meta, indent=1).encode())
            self.storage.commit(step)
        except OSError as exc:
            log.error("checkpoint_commit_failed", step=step, error=str(exc))
            self._event("checkpoint_commit_failed", step=step, error=f"{type(exc).__name__}: {exc}")
            return
        self.latest = step
        for key in [k for k in self._shards if k[0] <= step]:
            del self._shards[key]
        log.info("checkpoint_committed", step=step, world_size=world_size,
                 mb=round(sum(s.get("bytes", 0) for s in shards.values()) / 2**20, 1))
        self._event("checkpoint_committed", step=step, world_size=world_size)
        self._retain()

    def _retain(self) -> None:
        try:
            steps = sorted({int(m.group(1)) for p in self.storage.list() if (m := _STEP_DIR.match(p))})
            committed = []
            for s in steps:
                if self.latest is not None and s <= self.latest and self.storage.exists(f"{step_dir(s)}/checkpoint.json"):
                    committed.append(s)
            keep = set(committed[-self.keep_last :])
            for s in steps:
                if self.latest is not None and s <= self.latest and s not in keep:
                    self.storage.delete(step_dir(s))
        except OSError as exc:  # retention is best effort; the commit stands
            log.warning("checkpoint_retention_failed", error=str(exc))

    def pending_shards(self) -> list[dict[str, Any]]:
        """Durable shards of steps not committed yet (for the master's journal)."""
        return [{"step": step, "world_size": world, "rank": rank, "info": info}
                for (step, world), shards in self._shards.items() for rank, info in shards.items()]

    # ----- restores ------------------------------------------------------------------------

    def restore_plan(self, *, round_index: int, rank: int, world_size: int, memory_steps: list[int]) -> dict[str, Any]:
        """Record what ``rank`` holds in memory; answer the decision once all ranks reported."""
        key = (round_index, world_size)
        if key in self._decisions:
            return self._decisions[key]
        reports = self._plans.setdefault(key, {})
        reports[rank] = sorted(set(memory_steps))
        if len(reports) < world_size:
            return {"state": "waiting"}
        common = set.intersection(*(set(v) for v in reports.values()))
        newest = max(common) if common else None
        if newest is not None and (self.latest is None or newest >= self.latest):
            decision = {"state": "ready", "source": "memory", "step": newest}
        elif self.latest is not None:
            decision = {"state": "ready", "source": "storage", "step": self.latest}
        else:
            decision = {"state": "ready", "source": "fresh", "step": None}
        self._decisions[key] = decision
        del self._plans[key]
        held = {str(r): v for r, v in sorted(reports.items())}
        log.info("restore_decided", round=round_index, world_size=world_size, committed=self.latest, held=held,
                 source=decision["source"], step=decision["step"])
        self._event("restore_decided", round=round_index, world_size=world_size, committed=self.latest, held=held,
                    source=decision["source"], step=decision["step"])
        return decision
