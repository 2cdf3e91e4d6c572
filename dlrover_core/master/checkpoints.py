"""The master's part of Flash Checkpoint: commit steps, keep the last N, agree on restores.

* **Incarnations and lineage.** Every shard and memory snapshot carries the round (the
  *incarnation*) whose workers took it. A restore in round ``R`` to step ``P`` (``-1`` for
  a fresh start) abandons everything newer than ``P`` taken before ``R``: a snapshot or
  shard ``(step s, round r)`` is *stale* when some restore ``(R, P)`` has ``r < R`` and
  ``P < s``. Stale shards are refused (and pending ones discarded when the restore is
  decided); stale snapshots are never restored. So a step is committed only from shards of
  one incarnation of one lineage.
* **Commits.** A step is committed — ``step_<S>/checkpoint.json`` (every shard's file,
  size, CRC32 and incarnation), then the atomic ``latest`` marker — only when every rank of
  step S reported its shard of one incarnation durable. Commits only move forward; a shard
  of a step at or below the last commit is ignored. (The marker goes back only when a
  restore finds the steps above it damaged: see *Restore*.) Files of the step that the commit does
  not name (late writes of stale incarnations) are deleted.
* **Retention** keeps the last ``keep_last`` committed steps; older step directories, and
  those below the last commit that never completed, are deleted.
* **Restore.** Every rank reports which snapshots it holds in memory; when all ranks of
  the round have, the newest step held by all of them (same incarnation, not stale) wins if
  it is not older than the last commit; otherwise the last commit is loaded from storage;
  otherwise training starts fresh. A storage restore is *verified*: each rank reads its
  shard and checks its header and CRC32, and reports; if any rank's shard is damaged, the
  step is marked damaged (logged with the reason) and every rank falls back to the
  previous intact committed step, instead of failing on the same step round after round.
  The ``latest`` marker goes back to that step with them: the steps the new lineage trains
  again are persisted and committed anew (replacing the damaged commits), and a later job
  starts from the intact step.
* **The rule that every rank saves the same steps.** Ranks announce each save meant for
  storage; when a rank has reported progress past a step that another rank saved for
  storage, without saving it itself, :meth:`CheckpointCoordinator.misuse` says so (the
  master fails the job at once: that step could never be committed).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import attrs

from dlrover_core.checkpoint.commit import committed_steps, retain, tidy, write_commit
from dlrover_core.logging import get_logger
from dlrover_core.protocol.codec import decode, encode
from dlrover_core.protocol.events import EventKind
from dlrover_core.protocol.messages import (
    CheckpointErrorReport,
    RestoreDecision,
    RestorePlanRequest,
    RestoreVerify,
    RestoreVerifyAnswer,
    ShardAnswer,
    ShardReport,
)
from dlrover_core.storage.base import CheckpointStorage

__all__ = ["CheckpointCoordinator"]

log = get_logger()

#: How many announced save steps per round the misuse check remembers.
_ANNOUNCED_KEEP = 64
_WAITING = RestoreDecision(state="waiting")


@attrs.define
class _Verification:
    """The ranks' checks of one storage step of a round (``restore_verify``)."""

    step: int
    reports: dict[int, tuple[bool, str]] = attrs.field(factory=dict)  # rank -> (ok, error)
    answer: RestoreVerifyAnswer | None = None  # once every rank reported
    why: str = ""  # why the step before this one was abandoned


class CheckpointCoordinator:
    """Commits and restore decisions for one job (not thread-safe: the master holds its lock).

    Args:
        storage: the job's checkpoint storage.
        keep_last: committed steps to keep.
        event: the master's event (it logs at ``level`` and keeps the event), called as
            ``event(kind, *, level="info", **data)`` for ``checkpoint_committed``,
            ``checkpoint_commit_failed``, ``checkpoint_damaged`` and ``restore_decided``.
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
        self._shards: dict[tuple[int, int, int], dict[int, ShardReport]] = {}  # (step, world, round) -> rank -> shard
        self._restores: list[tuple[int, int]] = []  # (round, step restored to; -1 = fresh)
        self._plans: dict[tuple[int, int], dict[int, list[tuple[int, int]]]] = {}
        self._decisions: dict[tuple[int, int], RestoreDecision] = {}  # (round, world) -> the answer every rank gets
        self._verifying: dict[tuple[int, int], _Verification] = {}
        self.damaged: dict[int, str] = {}  # step -> why it cannot be loaded
        self._announced: dict[int, dict[int, set[int]]] = {}  # round -> step -> ranks that saved it for storage
        self._progress: dict[int, dict[int, int]] = {}  # round -> rank -> newest step reported
        self.commit_error: tuple[int, str] | None = None  # (step, error) of the newest failed commit
        self.persist_error: CheckpointErrorReport | None = None  # the newest failed shard write (not fatal)
        self.not_persisted: set[int] = set()  # steps whose shard write was given up on some rank
        self.last_persist_error: str | None = None
        #: why the newest restore decision did not restore from memory ("" where it did, or
        #: where no rank held a snapshot: a first start)
        self.restore_why: str = ""

    # ----- lineage -------------------------------------------------------------------------

    @property
    def restore_count(self) -> int:
        """Restores decided so far (each changes the lineage: journal it)."""
        return len(self._restores)

    def stale(self, step: int, round_index: int) -> tuple[int, int] | None:
        """The restore ``(round, step)`` that abandoned ``(step, round_index)``, if any."""
        for r, p in self._restores:
            if round_index < r and p < step:
                return (r, p)
        return None

    def _restored(self, round_index: int, step: int) -> None:
        """Record a restore decision and drop the pending shards it made stale."""
        if (round_index, step) in self._restores:
            return
        self._restores.append((round_index, step))
        for key in [k for k in self._shards if self.stale(k[0], k[2])]:
            dropped = self._shards.pop(key)
            log.info("checkpoint_shards_discarded", step=key[0], round=key[2], ranks=sorted(dropped),
                     reason=f"round {round_index} went back to step {step}")

    # ----- commits -----------------------------------------------------------------------

    def shard_done(self, shard: ShardReport) -> ShardAnswer:
        """Record a durable shard; commit its step when all ranks of its incarnation are in.
        The answer holds the newest commit, and says ``stale`` with a reason when the shard
        belongs to an abandoned lineage (it is not recorded)."""
        step, round_index = shard.step, shard.round
        if self.latest is not None and step <= self.latest:
            return ShardAnswer(committed=self.latest)
        why = self.stale(step, round_index)
        if why is not None:
            return ShardAnswer(committed=self.latest, stale=True,
                               reason=f"round {why[0]} went back to step {why[1]}: shard of step {step} from round "
                                      f"{round_index} is stale")
        shards = self._shards.setdefault((step, shard.world_size, round_index), {})
        shards[shard.rank] = shard
        if len(shards) == shard.world_size:
            self._commit(step, shard.world_size, round_index, shards)
        return ShardAnswer(committed=self.latest)

    def persist_failed(self, error: CheckpointErrorReport) -> None:
        """A shard write was given up (or is stuck): shown in the status until the next
        commit, and its step is counted as lost unless committed later."""
        self.persist_error = error
        self.last_persist_error = error.error
        if error.step is not None:
            self.not_persisted.add(error.step)

    def _commit(self, step: int, world_size: int, round_index: int, shards: dict[int, ShardReport]) -> None:
        try:
            meta = write_commit(self.storage, step=step, world_size=world_size, round_index=round_index, shards=shards)
        except OSError as exc:
            error = f"{type(exc).__name__}: {exc}"
            self.commit_error = (step, error)
            self._event(EventKind.CHECKPOINT_COMMIT_FAILED, level="error", step=step, storage=self.storage.url,
                        error=error)
            return
        self.latest = step
        self.damaged.pop(step, None)  # committed anew by the lineage that went back below it
        self.commit_error = None
        self.persist_error = None
        for key in [k for k in self._shards if k[0] <= step]:
            del self._shards[key]
        self._event(EventKind.CHECKPOINT_COMMITTED, step=step, world_size=world_size, round=round_index,
                    mb=round(sum(s.bytes for s in shards.values()) / 2**20, 1))
        tidy(self.storage, step, meta)
        retain(self.storage, latest=self.latest, keep_last=self.keep_last, damaged=self.damaged)

    def committed_steps(self) -> list[int]:
        """Committed steps still in storage (with their ``checkpoint.json``), oldest first."""
        return committed_steps(self.storage, self.latest)

    def pending_shards(self) -> list[dict[str, Any]]:
        """Durable shards of steps not committed yet, as their reports (for the master's journal)."""
        return [encode(shard) for shards in self._shards.values() for shard in shards.values()]

    def lost_steps(self) -> list[int]:
        """Steps due for persistence that some rank could not write (storage errors) and that
        were never committed: what a job that ends well still lost."""
        committed = set(self.committed_steps()) if self.not_persisted else set()
        return sorted(s for s in self.not_persisted if s not in committed)

    def final_problem(self) -> str | None:
        """Why the job must not end SUCCEEDED for its checkpoints: shards of a step newer
        than the last commit that never got all ranks (a save on some ranks only), or a
        failed commit of the newest step. ``None`` when nothing is wrong."""
        if self.commit_error is not None and (self.latest is None or self.commit_error[0] > self.latest):
            step, error = self.commit_error
            return f"checkpoint step {step} not committed: writing its commit to storage {self.storage.url!r} failed: {error}"
        # (a step only some nodes wrote at a breakpoint, none saving it for storage, is no misuse)
        newer = [(k, v) for k, v in self._shards.items()
                 if (self.latest is None or k[0] > self.latest) and any(s.due for s in v.values())]
        if newer:
            (step, world, _), shards = max(newer, key=lambda kv: kv[0][0])
            missing = [r for r in range(world) if r not in shards]
            return (f"checkpoint step {step} not committed: shards of ranks {sorted(shards)} are durable but rank(s) "
                    f"{missing} never saved it; every rank must call Checkpointer.save() for the same steps")
        return None

    # ----- the same-steps rule -------------------------------------------------------------

    def note_saves(self, round_index: int, rank: int, steps: Iterable[int]) -> None:
        """``rank`` saved ``steps`` for storage (forced or due) in ``round_index``."""
        per_step = self._announced.setdefault(round_index, {})
        for step in steps:
            per_step.setdefault(int(step), set()).add(rank)
        if len(per_step) > _ANNOUNCED_KEEP:
            for old in sorted(per_step)[: len(per_step) - _ANNOUNCED_KEEP]:
                del per_step[old]

    def note_progress(self, round_index: int, rank: int, step: int) -> None:
        """``rank`` reported ``step`` in ``round_index``."""
        ranks = self._progress.setdefault(round_index, {})
        ranks[rank] = max(step, ranks.get(rank, -1))

    def fold(self, round_index: int, saves: dict[int, tuple[int, ...]], steps: dict[int, int]) -> str | None:
        """Ranks' storage saves and progress of ``round_index`` (a heartbeat's), folded into
        the same-steps rule: why the job must fail (a step that can never be committed), or
        ``None``."""
        for rank, saved in saves.items():
            self.note_saves(round_index, rank, saved)
        for rank, step in steps.items():
            self.note_progress(round_index, rank, step)
        return self.misuse(round_index) if saves or steps else None

    def misuse(self, round_index: int) -> str | None:
        """The first violation of "every rank saves the same steps" seen in a round: a rank
        went past a step another rank saved for storage without saving it."""
        progress = self._progress.get(round_index, {})
        for step, savers in sorted(self._announced.get(round_index, {}).items()):
            skipped = sorted(r for r, newest in progress.items() if newest > step and r not in savers)
            if skipped:
                return (f"every rank must call Checkpointer.save() for the same steps: rank(s) {sorted(savers)} "
                        f"saved step {step} for storage, but rank(s) {skipped} went past step {step} without saving "
                        "it, so it can never be committed (save on every rank; to write from one rank only, "
                        "use torch.save yourself)")
        return None

    # ----- restores ------------------------------------------------------------------------

    def restore_plan(self, request: RestorePlanRequest) -> RestoreDecision:
        """Record what a rank holds in memory (``(step, round)`` pairs; steps without their
        round count as round 0); answer the decision once all ranks reported."""
        round_index, world_size = request.round, request.world_size
        key = (round_index, world_size)
        if key in self._decisions:
            return self._decisions[key]
        reports = self._plans.setdefault(key, {})
        held = list(request.memory) if request.memory or not request.memory_steps else [
            (s, 0) for s in request.memory_steps]
        reports[request.rank] = sorted({h for h in held if self.stale(*h) is None})
        if len(reports) < world_size:
            return _WAITING
        common = set.intersection(*(set(v) for v in reports.values()))
        newest = max(common) if common else None
        storage_step = self._storage_candidate()
        if newest is not None and (self.latest is None or newest[0] >= self.latest):
            decision = RestoreDecision(state="ready", source="memory", step=newest[0], snapshot_round=newest[1])
        elif storage_step is not None:
            decision = RestoreDecision(state="ready", source="storage", step=storage_step)
        elif self.latest is not None:  # every committed step is damaged
            decision = RestoreDecision(state="failed", reason=self._no_intact_reason())
        else:
            decision = RestoreDecision(state="ready", source="fresh", step=None)
        self._decisions[key] = decision
        del self._plans[key]
        if decision.state == "ready":
            self._restored(round_index, -1 if decision.step is None else decision.step)
        held_by = {str(r): [s for s, _ in v] for r, v in sorted(reports.items())}
        self.restore_why = "" if decision.source == "memory" else _memory_miss(reports, newest, self.latest)
        self._event(EventKind.RESTORE_DECIDED, round=round_index, world_size=world_size, committed=self.latest,
                    held=held_by, source=decision.source, step=decision.step,
                    **({"why": self.restore_why} if self.restore_why else {}))
        return decision

    def _storage_candidate(self, below: int | None = None) -> int | None:
        """The newest committed step not known to be damaged (below ``below`` if given)."""
        if self.latest is None:
            return None
        steps = [self.latest] if not self.damaged and below is None else self.committed_steps()
        for step in reversed(steps):
            if step not in self.damaged and (below is None or step < below):
                return step
        return None

    def _roll_back_marker(self, fallback: int) -> None:
        """Every committed step above ``fallback`` is damaged (the restore goes below them):
        the ``latest`` marker goes back to ``fallback``, so that the new lineage commits those
        steps again as it re-trains them (the savers write what they find above the marker)
        and a later job starts from the intact step without checking the damaged ones again.
        The damaged files stay until a new commit of their step replaces them. If the marker
        cannot be written, ``latest`` stays (logged): the re-trained steps up to it are then
        not persisted, as before."""
        if self.latest is None or self.latest <= fallback:
            return
        try:
            self.storage.commit(fallback)
        except OSError as exc:
            log.error("checkpoint_marker_rollback_failed", step=fallback, storage=self.storage.url,
                      error=f"{type(exc).__name__}: {exc}")
            return
        log.warning("checkpoint_marker_rolled_back", step=fallback, was=self.latest, storage=self.storage.url)
        self.latest = fallback

    def _no_intact_reason(self) -> str:
        damaged = "; ".join(f"step {s}: {why}" for s, why in sorted(self.damaged.items(), reverse=True))
        return f"no intact committed checkpoint in {self.storage.url!r} ({damaged})"

    def verify(self, report: RestoreVerify) -> RestoreVerifyAnswer:
        """A rank read its shard of a storage step and checked it. Answers ``waiting``;
        ``ok`` (every rank's shard is intact: load it); ``retry`` with the previous intact
        committed step to check next (this one is damaged); or ``failed`` (no intact
        committed step is left)."""
        round_index, step = report.round, report.step
        key = (round_index, report.world_size)
        state = self._verifying.setdefault(key, _Verification(step=step))
        if state.step != step:  # this rank checked a step the others already moved past
            return state.answer or RestoreVerifyAnswer(state="retry", step=state.step, reason=state.why)
        state.reports[report.rank] = (report.ok, report.error)
        if state.answer is not None:
            return state.answer
        if len(state.reports) < report.world_size:
            return RestoreVerifyAnswer(state="waiting")
        bad = {r: e for r, (good, e) in sorted(state.reports.items()) if not good}
        if not bad:
            state.answer = RestoreVerifyAnswer(state="ok", step=step)
            return state.answer
        first = next(iter(bad.items()))
        why = f"rank {first[0]}'s shard: {first[1]}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else "")
        self.damaged[step] = why
        fallback = self._storage_candidate(below=step)
        self._event(EventKind.CHECKPOINT_DAMAGED, level="error", step=step, reason=why, fallback=fallback,
                    storage=self.storage.url)
        if fallback is None:
            state.answer = RestoreVerifyAnswer(state="failed", reason=self._no_intact_reason())
            return state.answer
        self._roll_back_marker(fallback)
        self._restored(round_index, fallback)
        self._verifying[key] = _Verification(step=fallback, why=f"step {step}: {why}")
        return RestoreVerifyAnswer(state="retry", step=fallback, reason=why)

    # ----- journal -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """What a restarted master needs (JSON-safe): pending shards, restores and the
        decisions already answered (ranks that got one do not ask again), damaged steps."""
        return {"pending_shards": self.pending_shards(), "restores": [list(r) for r in self._restores],
                "damaged": {str(k): v for k, v in self.damaged.items()},
                "decisions": [[r, w, encode(d)] for (r, w), d in self._decisions.items()],
                "verifying": [[r, w, {"step": v.step, "reports": {str(k): list(x) for k, x in v.reports.items()},
                                      "answer": encode(v.answer) if v.answer is not None else None, "why": v.why}]
                              for (r, w), v in self._verifying.items()]}

    def load_dict(self, data: dict[str, Any]) -> None:
        """Take back :meth:`to_dict`'s state (after a master restart)."""
        self._restores = [(int(r), int(s)) for r, s in data.get("restores", [])]
        self.damaged = {int(k): str(v) for k, v in (data.get("damaged") or {}).items()}
        self._decisions = {(int(r), int(w)): decode(RestoreDecision, d) for r, w, d in data.get("decisions", [])}
        self._verifying = {
            (int(r), int(w)): _Verification(
                step=int(v["step"]), reports={int(k): (bool(x[0]), str(x[1])) for k, x in v["reports"].items()},
                answer=decode(RestoreVerifyAnswer, v["answer"]) if v.get("answer") else None, why=v.get("why") or "")
            for r, w, v in data.get("verifying", [])}
        for shard in data.get("pending_shards", []):
            # (journals of format 2 before typed messages kept the report's fields under "info")
            self.shard_done(decode(ShardReport, {**shard.get("info", {}), **{k: v for k, v in shard.items() if k != "info"}}))


#: Ranks named one by one in :func:`_memory_miss` (a 10,000-rank world is summarised).
_NAMED_RANKS = 8


def _memory_miss(reports: dict[int, list[tuple[int, int]]], newest: tuple[int, int] | None,
                 committed: int | None) -> str:
    """Why a restore did not come from memory, in words (``""``: no rank held a snapshot, as
    at a job's first start): ranks that hold none (a lost node whose buddy held no replica,
    or ``replicas=0``), no step that every rank holds (a replica behind the survivors' two
    slots), or memory older than the committed step."""
    if not any(reports.values()):
        return ""
    empty = sorted(r for r, held in reports.items() if not held)
    if empty:
        named = ", ".join(map(str, empty[:_NAMED_RANKS])) + (f" and {len(empty) - _NAMED_RANKS} more"
                                                               if len(empty) > _NAMED_RANKS else "")
        return f"rank(s) {named} hold no snapshot in memory (a lost node without a replica, or replicas=0)"
    if newest is None:
        lines = [f"rank {r}: {sorted({s for s, _ in held})}" for r, held in sorted(reports.items())[:_NAMED_RANKS]]
        more = f"; {len(reports) - _NAMED_RANKS} more ranks" if len(reports) > _NAMED_RANKS else ""
        return f"no step is in every rank's memory ({'; '.join(lines)}{more}): a replica behind the others"
    return f"the newest step in every rank's memory ({newest[0]}) is older than the committed step {committed}"
