"""A picture of one job from the files it left: ``dlrover plot JOB_ID -o job.png``.

Two steps, so the data can be checked without drawing:

* :func:`read_job` turns a job's directory into a :class:`JobPlotData` (plain data, no
  matplotlib): rank 0's steps and loss over wall time, the world size over time, every
  failure with when it was reported and when its rank last made progress, the moments
  training resumed, the committed checkpoints, the intervals the files let us place in time
  (detection, restart + rendezvous, startup, live re-forms, recomputed steps) and the
  goodput totals of ``result.json``;
* :func:`draw` (a figure) and :func:`render` (a PNG) draw it with matplotlib and return a
  :class:`PlotSummary` of what is on the figure.

What a job directory holds and what is read from it:

* ``events.jsonl``: the master's events; ``time_s`` (seconds since the master started) is
  the time axis; ``unix_time_s`` lines progress records up with it;
* ``node_<n>/round_<r>/progress_rank<k>*.jsonl``: what each worker reported, read through
  :mod:`dlrover_core.protocol.progress` (step records with their Unix time, step time and
  metrics; live re-forms); files written before the records were typed read the same, and
  record types this version does not know are skipped;
* ``result.json`` (else ``goodput.json``; the master writes both as the job ends): the
  goodput totals. The master keeps totals only, so they are drawn as one bar of totals, not
  as a timeline; while the job runs there is none.

Errors: everything raised on purpose is a :class:`JobPlotError` that names the file or field
and the fix.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import attrs

from dlrover_core import rundir
from dlrover_core.errors import DLRoverError, ProtocolError
from dlrover_core.logging import get_logger
from dlrover_core.protocol.events import EventKind
from dlrover_core.protocol.progress import LiveRecord, ProgressRecord, StepRecord, read_line

__all__ = [
    "Commit",
    "FailureMark",
    "JobPlotData",
    "JobPlotError",
    "Phase",
    "PlotSummary",
    "Recovery",
    "StepPoint",
    "draw",
    "find_job_dir",
    "read_job",
    "render",
]

log = get_logger()

EVENTS_FILE = rundir.EVENTS
RESULT_FILE = rundir.RESULT
GOODPUT_FILE = rundir.GOODPUT
HANDLE_FILE = rundir.JOB  # what `dlrover status` looks for
PLOT_EXTRA_HINT = "pip install 'dlrover-core[plot]'"

#: The goodput totals drawn in the bar, in order: key in result.json -> label.
GOODPUT_PARTS = {
    "productive_s": "productive",
    "checkpoint_stall_s": "checkpoint stall",
    "restore_s": "restore",
    "recomputed_s": "recomputed",
    "detection_s": "detection",
    "restart_s": "restart",
    "rendezvous_s": "rendezvous",
    "startup_s": "startup",
    "reform_s": "live re-form",
    "other_s": "other",
}

#: Intervals placed in time (``Phase.kind``) -> legend label.
PHASE_LABELS = {
    "rendezvous": "start + first rendezvous (master started → round formed)",
    "detection": "detection (last progress → failure reported)",
    "restart": "restart + rendezvous (reported → next round formed)",
    "startup": "startup + restore (round formed → first step)",
    "reform": "live re-form (rank 0)",
    "recomputed": "recomputed (steps trained again later)",
}

_COLORS = {
    "productive_s": "#4caf50", "checkpoint_stall_s": "#fdd835", "restore_s": "#8d6e63",
    "recomputed_s": "#9e9e9e", "detection_s": "#ff9800", "restart_s": "#e53935",
    "rendezvous_s": "#f48fb1", "startup_s": "#8e24aa", "reform_s": "#00acc1", "other_s": "#e0e0e0",
}
_PHASE_COLORS = {"rendezvous": "#f48fb1", "detection": "#ff9800", "restart": "#e53935", "startup": "#8e24aa",
                 "reform": "#00acc1", "recomputed": "#9e9e9e"}
_MARKER_COLORS = {"failure": "#b71c1c", "detection": "#ef6c00", "recovery": "#1b5e20", "commit": "#1565c0"}


class JobPlotError(DLRoverError, ValueError):
    """A job cannot be drawn: no such job, a missing or malformed file, or matplotlib is not
    installed. The message names the job, file or field and the fix.

    Attributes:
        path: the file or directory at fault (``None`` when it is not about a file).
    """

    def __init__(self, message: str, path: Path | None = None) -> None:
        self.path = path
        super().__init__(message)


# ----- the data ---------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class StepPoint:
    """One step rank 0 reported.

    Attributes:
        time_s: when the step ended, in seconds since the job master started.
        step: the step number.
        dt_s: how long the step took, in seconds.
        metric: the plotted metric's value at this step (``None``: not reported).
        lost: ``True`` when rank 0 trained this step again later (its time was recomputed).
    """

    time_s: float
    step: int
    dt_s: float
    metric: float | None
    lost: bool = False


@attrs.frozen(kw_only=True)
class FailureMark:
    """One ``worker_failed`` event.

    Attributes:
        reported_s: when the master heard of it (the event's ``time_s``), in seconds since start.
        failed_s: when the failed rank last made progress before that (its newest step record),
            in seconds since start; ``reported_s`` when no record tells.
        failed_from: where ``failed_s`` comes from: ``"progress"`` (the failed rank's records),
            ``"rank0"`` (rank 0's, when the failed rank left none) or ``"report"``.
        step: the job's newest step when it failed.
        rank: the failed worker's global rank (``None``: the whole node failed).
        node_id: its node.
        round: the rendezvous round it happened in (``None``: not recorded).
        detail: the failure in words (``"SIGKILL"``).
        recovery: ``"live"``, ``"restart_all"`` or ``""`` (a consequence of an earlier failure,
            or the job stopped).
    """

    reported_s: float
    failed_s: float
    failed_from: str
    step: int | None
    rank: int | None
    node_id: int | None
    round: int | None
    detail: str
    recovery: str


@attrs.frozen(kw_only=True)
class Recovery:
    """Training resumed: rank 0's first step after one or more failures were reported.

    Attributes:
        time_s: when that step ended, in seconds since start.
        step: its step number.
        failures: how many failures it ended.
    """

    time_s: float
    step: int
    failures: int


@attrs.frozen(kw_only=True)
class Commit:
    """A ``checkpoint_committed`` event: ``step`` became durable at ``time_s`` (seconds since start)."""

    time_s: float
    step: int


@attrs.frozen(kw_only=True)
class Phase:
    """An interval of lost time that the files place on the time axis.

    Attributes:
        kind: a key of :data:`PHASE_LABELS`.
        start_s: where it begins, in seconds since start.
        end_s: where it ends, in seconds since start (``> start_s``).
    """

    kind: str
    start_s: float
    end_s: float


@attrs.frozen(kw_only=True)
class JobPlotData:
    """Everything :func:`draw` puts on the figure, read from one job directory.

    Attributes:
        job_id: the job's id.
        state: ``SUCCEEDED``, ``FAILED``, ``CANCELLED``, or ``UNFINISHED`` while no
            ``job_finished`` event exists (the job runs, or its master died).
        end_s: the end of the time axis: the job's end, or its newest event or step, in seconds.
        metric: the name of the plotted metric (``"loss"``).
        steps: rank 0's step records in time order.
        world_sizes: ``(time_s, world size)`` from ``rendezvous_completed`` and
            ``live_reformed`` events, and ``0`` at ``workers_restarted`` (every worker stops).
        failures: one per ``worker_failed`` event, in order.
        recoveries: when training resumed after failures.
        commits: one per ``checkpoint_committed`` event.
        phases: lost time placed in time, merged where intervals of one kind overlap.
        goodput: the goodput totals in seconds (keys of :data:`GOODPUT_PARTS`; ``other_s`` is
            the rest of the wall time); empty when the job left neither ``result.json`` nor
            ``goodput.json``.
        goodput_fraction: productive / wall time (0..1); ``None`` when unknown.
        wall_time_s: the wall time the totals divide, in seconds (``None`` when unknown).
        final_step: the newest step rank 0 reported (``-1``: none).
        restarts: restarts taken from the job's budget (``None`` when unknown).
    """

    job_id: str
    state: str
    end_s: float
    metric: str
    steps: tuple[StepPoint, ...]
    world_sizes: tuple[tuple[float, int], ...]
    failures: tuple[FailureMark, ...]
    recoveries: tuple[Recovery, ...]
    commits: tuple[Commit, ...]
    phases: tuple[Phase, ...]
    goodput: dict[str, float]
    goodput_fraction: float | None
    wall_time_s: float | None
    final_step: int
    restarts: int | None


def find_job_dir(job_id: str, log_dir: str | Path = "dlrover-runs") -> Path:
    """The directory of ``job_id`` under ``log_dir``, as ``dlrover status`` finds it
    (``<log_dir>/<job_id>/job.json``).

    Raises:
        JobPlotError: no such job under ``log_dir`` (pass ``--log-dir`` with the Job's log_dir).
    """
    run_dir = Path(log_dir) / job_id
    if not (run_dir / HANDLE_FILE).is_file():
        raise JobPlotError(f"no job {job_id!r} under {str(log_dir)!r} ({run_dir / HANDLE_FILE} does not exist); "
                           "pass --log-dir with the Job's log_dir", run_dir)
    return run_dir


def _read_json_lines(path: Path) -> Iterable[dict[str, Any]]:
    """The JSON objects of ``path``, one a line; a line being written (the job runs) or
    otherwise undecodable is skipped and counted in a ``jobplot_lines_skipped`` event."""
    skipped = 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            skipped += 1
            continue
        if isinstance(obj, dict):
            yield obj
        else:
            skipped += 1
    if skipped:
        log.warning("jobplot_lines_skipped", path=str(path), lines=skipped)


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text())
    except ValueError as exc:
        raise JobPlotError(f"{path} is not JSON ({exc}); it is written when the job ends: rerun once it has ended, "
                           f"or delete it to plot without the goodput totals", path) from exc
    if not isinstance(data, dict):
        raise JobPlotError(f"{path} holds {type(data).__name__}, not a JSON object", path)
    return data


def _read_progress(path: Path) -> Iterable[ProgressRecord]:
    """The progress records of ``path``; a line that is no well-formed record (being written:
    the job runs; or damaged) is skipped and counted in a ``jobplot_lines_skipped`` event, a
    record of a type this version does not know is skipped silently."""
    skipped = 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            record = read_line(line)
        except ProtocolError:
            skipped += 1
            continue
        if record is not None:
            yield record
    if skipped:
        log.warning("jobplot_lines_skipped", path=str(path), lines=skipped)


@attrs.frozen
class _Record:
    """A progress record with where it came from."""

    node_id: int
    round: int
    data: ProgressRecord


def _progress_records(run_dir: Path, node_id: int | None = None, round_index: int | None = None,
                      keep: Callable[[ProgressRecord], bool] = lambda r: True) -> list[_Record]:
    """The progress records under ``run_dir`` that ``keep`` keeps, of one node and round
    when given (a large job's records do not all fit in memory, and need not)."""
    out = []
    for path in rundir.RunDir(run_dir).progress_files(node_id, round_index):
        n, r = rundir.node_of_dir(path.parent.parent.name), rundir.round_of_dir(path.parent.name)
        if n is None or r is None:
            continue  # not a directory the agent wrote
        out += [_Record(n, r, d) for d in _read_progress(path) if keep(d)]
    return out


def _is_step(record: ProgressRecord) -> bool:
    """A step record placed in time (it has its Unix time)."""
    return isinstance(record, StepRecord) and record.unix_time_s is not None


def _time(record: ProgressRecord) -> float:
    """The Unix time of a step or live record that has one (see :func:`_is_step`)."""
    assert isinstance(record, (StepRecord, LiveRecord)) and record.unix_time_s is not None
    return record.unix_time_s


def _is_rank0(record: ProgressRecord) -> bool:
    """Rank 0's step records and live re-forms (what the time panels draw)."""
    return record.rank == 0 and (_is_step(record) or isinstance(record, LiveRecord))


def _number(event: dict[str, Any], key: str, where: str) -> float:
    value = event.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise JobPlotError(f"{where}: field {key!r} is {value!r}, not a number; the file is damaged or not a "
                           "dlrover-core events file")
    return float(value)


def _merge(phases: Iterable[Phase], gap_s: float = 0.0) -> list[Phase]:
    """Phases of one kind that overlap (or are at most ``gap_s`` apart) become one."""
    out: list[Phase] = []
    for p in sorted(phases, key=lambda p: (p.kind, p.start_s)):
        if out and out[-1].kind == p.kind and p.start_s <= out[-1].end_s + gap_s:
            out[-1] = attrs.evolve(out[-1], end_s=max(out[-1].end_s, p.end_s))
        else:
            out.append(p)
    return sorted(out, key=lambda p: (p.start_s, p.kind))


def read_job(run_dir: str | Path, *, metric: str = "loss") -> JobPlotData:
    """Read the job directory ``run_dir`` (``<log_dir>/<job_id>``) into a :class:`JobPlotData`.

    Times are seconds since the job master started (the events' ``time_s``); a progress
    record's Unix time ``t`` is moved onto that axis with the events' ``unix_time_s``.

    Args:
        run_dir: the job's directory.
        metric: which metric of rank 0's step records to keep (``"loss"``).

    Raises:
        JobPlotError: ``run_dir`` or its ``events.jsonl`` is missing or empty, an event lacks
            ``kind`` or ``time_s``, no event has ``unix_time_s`` (written by a dlrover-core
            too old to line progress up with events), or ``result.json`` is not a JSON object.
    """
    run_dir = Path(run_dir)
    events_path = run_dir / EVENTS_FILE
    if not run_dir.is_dir():
        raise JobPlotError(f"{run_dir} is not a directory; pass a job's directory (<log_dir>/<job_id>)", run_dir)
    if not events_path.is_file():
        raise JobPlotError(f"{events_path} does not exist: the job master writes it when the job starts; "
                           "is this a job's directory, and did its master start?", events_path)
    events = list(_read_json_lines(events_path))
    if not events:
        raise JobPlotError(f"{events_path} holds no events yet; plot again once the job has formed its first round",
                           events_path)
    for i, e in enumerate(events, 1):
        if not isinstance(e.get("kind"), str):
            raise JobPlotError(f"{events_path}, event {i}: field 'kind' is {e.get('kind')!r}, not an event name",
                               events_path)
        _number(e, "time_s", f"{events_path}, event {i}")
    anchors = [e["unix_time_s"] - e["time_s"] for e in events if isinstance(e.get("unix_time_s"), (int, float))]
    if not anchors:
        raise JobPlotError(f"{events_path}: no event has the field 'unix_time_s' (a dlrover-core older than the "
                           "plot wrote it), so progress records cannot be placed on the events' time axis; "
                           "rerun the job with this version", events_path)
    start_unix = sorted(anchors)[len(anchors) // 2]

    def since_start(t: float) -> float:
        return t - start_unix

    records = _progress_records(run_dir, keep=_is_rank0)
    rank0 = sorted((r for r in records if _is_step(r.data)), key=lambda r: _time(r.data))
    steps = _steps(rank0, metric, since_start)

    by_kind: dict[str, list[dict[str, Any]]] = {}
    for e in events:
        by_kind.setdefault(e["kind"], []).append(e)
    finished = by_kind.get(EventKind.JOB_FINISHED, [])
    result = _read_json(run_dir / RESULT_FILE)
    goodput_doc = result if result is not None else _read_json(run_dir / GOODPUT_FILE)
    latest = max([e["time_s"] for e in events] + [p.time_s for p in steps])
    end_s = finished[-1]["time_s"] if finished else latest

    failures = tuple(_failure(e, run_dir, rank0, since_start) for e in by_kind.get(EventKind.WORKER_FAILED, []))
    recoveries = _recoveries(failures, steps)
    commits = tuple(Commit(time_s=e["time_s"], step=int(e["step"]))
                    for e in by_kind.get(EventKind.CHECKPOINT_COMMITTED, []) if isinstance(e.get("step"), int))
    world = sorted(
        [(e["time_s"], int(e["world_size"])) for e in events
         if e["kind"] in (EventKind.RENDEZVOUS_COMPLETED, EventKind.LIVE_REFORMED)
         and isinstance(e.get("world_size"), int)]
        + [(e["time_s"], 0) for e in by_kind.get(EventKind.WORKERS_RESTARTED, [])])
    phases = _phases(by_kind, failures, rank0, records, steps, since_start)

    goodput, fraction, wall = _goodput(goodput_doc)
    state = str(finished[-1].get("state", "")) if finished else "UNFINISHED"
    restarts = finished[-1].get("restarts") if finished else (result or {}).get("restarts")
    return JobPlotData(
        job_id=str(events[0].get("job_id") or run_dir.name), state=state, end_s=end_s, metric=metric, steps=steps,
        world_sizes=tuple(world), failures=failures, recoveries=recoveries, commits=commits, phases=phases,
        goodput=goodput, goodput_fraction=fraction, wall_time_s=wall,
        final_step=max((p.step for p in steps), default=-1),
        restarts=restarts if isinstance(restarts, int) else None,
    )


def _steps(rank0: Sequence[_Record], metric: str, since_start: Callable[[float], float]) -> tuple[StepPoint, ...]:
    """Rank 0's steps; a step trained again later (after a restore, or in a newer live
    generation) is marked lost."""
    records = [r.data for r in rank0 if isinstance(r.data, StepRecord)]
    newest_index: dict[int, int] = {}
    for i, record in enumerate(records):
        newest_index[record.step] = i
    out = []
    for i, record in enumerate(records):
        value = record.metrics.get(metric)
        ok = value is not None and math.isfinite(value)
        out.append(StepPoint(time_s=since_start(_time(record)), step=record.step, dt_s=record.dt_s,
                             metric=value if ok else None, lost=newest_index[record.step] != i))
    return tuple(out)


def _failure(event: dict[str, Any], run_dir: Path, rank0: Sequence[_Record],
             since_start: Callable[[float], float]) -> FailureMark:
    """A ``worker_failed`` event, with when its rank last made progress before the report."""
    reported_s = event["time_s"]
    node_id, rank, round_index = event.get("node_id"), event.get("rank"), event.get("round")
    before = reported_s + 1e-3  # the report's time is rounded to the millisecond

    def last(records: Iterable[_Record]) -> float | None:
        times = [since_start(_time(r.data)) for r in records]
        times = [t for t in times if t <= before]
        return max(times) if times else None

    own = []
    if isinstance(node_id, int) and isinstance(round_index, int):
        own = _progress_records(run_dir, node_id, round_index,
                                keep=lambda d: _is_step(d) and (rank is None or d.rank == rank))
    failed_s, failed_from = last(own), "progress"
    if failed_s is None:
        failed_s, failed_from = last(rank0), "rank0"
    if failed_s is None:
        failed_s, failed_from = reported_s, "report"
    step = event.get("step")
    return FailureMark(
        reported_s=reported_s, failed_s=min(failed_s, reported_s), failed_from=failed_from,
        step=step if isinstance(step, int) else None, rank=rank if isinstance(rank, int) else None,
        node_id=node_id if isinstance(node_id, int) else None,
        round=round_index if isinstance(round_index, int) else None,
        detail=str(event.get("detail") or event.get("signal") or event.get("failure_kind") or ""),
        recovery=str(event.get("recovery") or ""))


def _recoveries(failures: Sequence[FailureMark], steps: Sequence[StepPoint]) -> tuple[Recovery, ...]:
    """For each failure, rank 0's first step after it was reported; failures that share that
    step share one recovery."""
    ended: dict[int, int] = {}  # index into steps -> failures it ended
    for f in failures:
        first = next((i for i, p in enumerate(steps) if p.time_s > f.reported_s), None)
        if first is not None:
            ended[first] = ended.get(first, 0) + 1
    return tuple(Recovery(time_s=steps[i].time_s, step=steps[i].step, failures=n) for i, n in sorted(ended.items()))


def _phases(by_kind: dict[str, list[dict[str, Any]]], failures: Sequence[FailureMark], rank0: Sequence[_Record],
            records: Sequence[_Record], steps: Sequence[StepPoint],
            since_start: Callable[[float], float]) -> tuple[Phase, ...]:
    """The intervals of lost time the events and progress records place in time (see
    :data:`PHASE_LABELS`)."""
    out: list[Phase] = []
    rounds = sorted(by_kind.get(EventKind.RENDEZVOUS_COMPLETED, []), key=lambda e: e["time_s"])
    for i, f in enumerate(failures):
        # a consequence (no action of its own) of a failure reported earlier in its round was
        # detected with that one
        consequence = not f.recovery and any(g.round == f.round and g.reported_s <= f.reported_s
                                             for g in failures[:i])
        if f.reported_s > f.failed_s and not consequence:
            out.append(Phase(kind="detection", start_s=f.failed_s, end_s=f.reported_s))
    for e in rounds:
        formed, index = e["time_s"], e.get("round")
        if index == 0 or e is rounds[0]:
            if formed > 0:
                out.append(Phase(kind="rendezvous", start_s=0.0, end_s=formed))
        else:
            previous = _formed_before(rounds, formed)
            reports = [f.reported_s for f in failures if previous <= f.reported_s <= formed]
            if reports and formed > min(reports):
                out.append(Phase(kind="restart", start_s=min(reports), end_s=formed))
        first = [since_start(_time(r.data)) - r.data.dt_s for r in rank0
                 if r.round == index and isinstance(r.data, StepRecord)]
        first = [t for t in first if t >= formed]
        if first and min(first) > formed:
            out.append(Phase(kind="startup", start_s=formed, end_s=min(first)))
    for r in records:
        d = r.data
        if (isinstance(d, LiveRecord) and d.rank == 0 and d.reason != "join" and d.unix_time_s is not None
                and d.reform_s > 0):
            end = since_start(d.unix_time_s)
            out.append(Phase(kind="reform", start_s=end - d.reform_s, end_s=end))
    lost = [Phase(kind="recomputed", start_s=p.time_s - p.dt_s, end_s=p.time_s) for p in steps if p.lost and p.dt_s > 0]
    out += _merge(lost, gap_s=1.0)
    return tuple(_merge(out))


def _formed_before(rounds: Sequence[dict[str, Any]], formed: float) -> float:
    """When the round before the one formed at ``formed`` formed (``-inf``: none)."""
    earlier = [e["time_s"] for e in rounds if e["time_s"] < formed]
    return max(earlier) if earlier else -math.inf


def _goodput(doc: dict[str, Any] | None) -> tuple[dict[str, float], float | None, float | None]:
    if doc is None:
        return {}, None, None
    wall = doc.get("wall_time_s")
    parts = {k: float(doc[k]) for k in GOODPUT_PARTS if k != "other_s" and isinstance(doc.get(k), (int, float))}
    if isinstance(wall, (int, float)) and wall > 0:
        parts["other_s"] = max(0.0, float(wall) - sum(parts.values()))
    fraction = doc.get("goodput")
    return (parts, float(fraction) if isinstance(fraction, (int, float)) else None,
            float(wall) if isinstance(wall, (int, float)) else None)


# ----- the picture ------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class PlotSummary:
    """What :func:`draw` put on the figure, counted from its artists.

    Attributes:
        path: where :func:`render` wrote the PNG (``None`` from :func:`draw`).
        markers: vertical lines or points per kind: ``failure``, ``detection``, ``recovery``,
            ``commit``.
        phases: shaded intervals per kind (keys of :data:`PHASE_LABELS`), on the steps panel.
        steps: points of rank 0's step series.
        metric: points of the metric series (steps that reported it).
        world_size: changes of the world size drawn.
        goodput: the bar's segments, label -> seconds.
        title: the figure's title.
    """

    path: str | None
    markers: dict[str, int]
    phases: dict[str, int]
    steps: int
    metric: int
    world_size: int
    goodput: dict[str, float]
    title: str


def _figure_class() -> Any:
    """matplotlib's ``Figure``: drawn without pyplot, so no global backend or figure list is
    touched (``savefig`` renders with Agg)."""
    try:
        from matplotlib.figure import Figure  # optional extra (dlrover-core[plot]): only drawing needs it
    except ImportError as exc:
        raise JobPlotError(f"drawing a job needs matplotlib, which is not installed: {PLOT_EXTRA_HINT}") from exc
    return Figure


def _title(data: JobPlotData) -> str:
    goodput = f"goodput {data.goodput_fraction:.1%}" if data.goodput_fraction is not None else "goodput unknown"
    restarts = f", {data.restarts} restart(s)" if data.restarts is not None else ""
    step = f"final step {data.final_step}" if data.final_step >= 0 else "no step yet"
    return (f"job {data.job_id} — {data.state}: {step}, {goodput}, "
            f"{len(data.failures)} failure(s){restarts}")


def draw(data: JobPlotData) -> tuple[Any, PlotSummary]:
    """Draw ``data`` on a new matplotlib figure (not registered with pyplot, 14 x 10 inches).

    Three panels share the time axis (seconds since the job master started): rank 0's step
    with every failure, detection, recovery and commit marked and the lost time shaded; the
    world size; the metric. Beside them, the legend and the first failure zoomed in (when it
    is short on the time axis); below, one bar of the goodput totals.

    Each mark on the steps panel carries its kind as the artist's ``gid`` (``failure``,
    ``detection``, ``recovery``, ``commit``, ``steps``, ``phase:<kind>``; ``world_size``,
    ``metric``, ``goodput:<key>`` on the others; the zoom's copies start with ``zoom:``).

    Returns:
        ``(figure, summary)``: a ``matplotlib.figure.Figure`` and what is on it.

    Raises:
        JobPlotError: matplotlib is not installed (``pip install 'dlrover-core[plot]'``).
    """
    fig = _figure_class()(figsize=(14, 10), layout="constrained")
    grid = fig.add_gridspec(4, 2, height_ratios=[3.2, 1.2, 2.0, 0.9], width_ratios=[3.0, 1.0])
    ax_steps = fig.add_subplot(grid[0, 0])
    ax_world = fig.add_subplot(grid[1, 0], sharex=ax_steps)
    ax_metric = fig.add_subplot(grid[2, 0], sharex=ax_steps)
    ax_bar = fig.add_subplot(grid[3, 0])
    ax_legend = fig.add_subplot(grid[0, 1])
    ax_bar_legend = fig.add_subplot(grid[3, 1])
    for ax in (ax_legend, ax_bar_legend):
        ax.axis("off")
    title = _title(data)
    fig.suptitle(title, fontsize=13)
    end = max(data.end_s, 1e-3)

    # the steps panel holds the counted marks; the world size and metric panels repeat the shading
    for ax in (ax_world, ax_metric):
        for p in data.phases:
            ax.axvspan(p.start_s, p.end_s, color=_PHASE_COLORS[p.kind], alpha=0.22, lw=0,
                       hatch="//" if p.kind == "recomputed" else None).set_gid(f"phase-copy:{p.kind}")
    pieces = _draw_progress(ax_steps, data, prefix="", labels=True)
    ax_steps.set_ylabel("step")
    ax_steps.set_title("training progress (rank 0) with failures, detections, recoveries and commits",
                       fontsize=10, loc="left")
    ax_steps.grid(alpha=0.3)
    ax_legend.legend(*ax_steps.get_legend_handles_labels(), loc="upper left", fontsize=8, frameon=False)
    window = _zoom_window(data)
    if window is not None:  # the first failure and its recovery: seconds wide on a long time axis
        _draw_zoom(fig.add_subplot(grid[1:3, 1]), data, window)
    _draw_world(ax_world, data, prefix="")
    ax_world.set_ylim(-0.2, max([w for _, w in data.world_sizes] + [1]) + 0.8)
    ax_world.set_ylabel("world size\n(workers)")
    ax_world.grid(alpha=0.3)
    points = _draw_metric(ax_metric, data)
    ax_metric.set_xlabel("wall time since the job master started (s)")
    ax_steps.set_xlim(0, end * 1.01)
    for ax in (ax_steps, ax_world):
        ax.tick_params(labelbottom=False)
    segments = _draw_goodput(ax_bar, ax_bar_legend, data)

    summary = PlotSummary(
        path=None,
        markers={kind: _count(fig, kind) for kind in ("failure", "detection", "recovery", "commit")},
        phases={kind: n for kind in PHASE_LABELS if (n := _count(fig, f"phase:{kind}"))},
        steps=sum(len(piece) for piece in pieces),
        metric=len(points),
        world_size=len(data.world_sizes),
        goodput=segments,
        title=title,
    )
    return fig, summary


def _draw_zoom(ax: Any, data: JobPlotData, window: tuple[float, float]) -> None:
    """The steps panel again, over ``window`` (seconds), with the world size on a second axis."""
    _draw_progress(ax, data, prefix="zoom:", labels=False)
    shown = [p.step for p in data.steps if window[0] <= p.time_s <= window[1]]
    ax.set_xlim(*window)
    if shown:
        ax.set_ylim(min(shown) - 1, max(shown) + 1)
    ax.set_title("the first failure, zoomed in", fontsize=10, loc="left")
    ax.set_xlabel("wall time (s)")
    ax.set_ylabel("step")
    ax.grid(alpha=0.3)
    if data.world_sizes:  # who trained: the survivors alone, then the whole world again
        sizes = ax.twinx()
        _draw_world(sizes, data, prefix="zoom:", alpha=0.7)
        sizes.set_ylim(-0.2, max(max(w for _, w in data.world_sizes), 1) * 2.2)  # under the step line
        values = sorted({w for _, w in data.world_sizes})
        if len(values) <= 6:
            sizes.set_yticks(values)
        sizes.set_ylabel("world size (workers)", color="#3949ab", fontsize=8)
        sizes.tick_params(labelsize=7, colors="#3949ab")


def _draw_world(ax: Any, data: JobPlotData, *, prefix: str, alpha: float = 1.0) -> None:
    """The world size as a step line to the end of the time axis (integer ticks)."""
    if not data.world_sizes:
        ax.text(0.5, 0.5, "no rendezvous event yet", transform=ax.transAxes, ha="center", va="center")
        return
    xs = [t for t, _ in data.world_sizes] + [max(data.end_s, data.world_sizes[-1][0])]
    ys = [w for _, w in data.world_sizes] + [data.world_sizes[-1][1]]
    (line,) = ax.step(xs, ys, where="post", color="#3949ab", lw=1.6 if not prefix else 1.2, alpha=alpha)
    line.set_gid(f"{prefix}world_size")
    ax.yaxis.get_major_locator().set_params(integer=True)


def _draw_metric(ax: Any, data: JobPlotData) -> list[StepPoint]:
    """Rank 0's metric over time, cut at failures; returns the points drawn."""
    points = [p for p in data.steps if p.metric is not None]
    for piece in _pieces(points, [f.reported_s for f in data.failures]):
        (line,) = ax.plot([p.time_s for p in piece], [p.metric for p in piece], "-", color="#d81b60", lw=1.0)
        line.set_gid("metric")
    if not points:
        ax.text(0.5, 0.5, f"rank 0 reported no {data.metric!r}", transform=ax.transAxes, ha="center", va="center")
    ax.set_ylabel(f"{data.metric} (rank 0)")
    ax.grid(alpha=0.3)
    return points


def _draw_goodput(ax: Any, legend_ax: Any, data: JobPlotData) -> dict[str, float]:
    """The goodput totals as one stacked bar (the master keeps totals, not a timeline), its
    legend on ``legend_ax``; returns label -> seconds drawn."""
    segments: dict[str, float] = {}
    wall = data.wall_time_s or sum(data.goodput.values())
    left = 0.0
    for key, label in GOODPUT_PARTS.items():
        seconds = data.goodput.get(key, 0.0)
        if seconds <= 0:
            continue
        bar = ax.barh(0, seconds, left=left, color=_COLORS[key], edgecolor="white", lw=0.5,
                      label=f"{label} {seconds:.1f} s ({_percent(seconds / wall)})")
        bar.patches[0].set_gid(f"goodput:{key}")
        segments[label] = seconds
        left += seconds
    ax.set_yticks([])
    if segments:
        ax.set_xlim(0, max(left, data.end_s) * 1.01)
        ax.set_xlabel("seconds")
        ax.set_title(f"where the {wall:.1f} s went (goodput totals from result.json, summed: not in time order)",
                     fontsize=10, loc="left")
        legend_ax.legend(*ax.get_legend_handles_labels(), loc="center left", ncol=2, fontsize=8, frameon=False)
    else:
        ax.text(0.5, 0.5, "no goodput totals yet: the master writes them (goodput.json, result.json) as the job ends",
                transform=ax.transAxes, ha="center", va="center")
        ax.set_xticks([])
    return segments


def _percent(fraction: float) -> str:
    """``0.763`` -> ``"76%"``; below 1 % one decimal (``"0.2%"``, ``"<0.1%"``), so a small
    phase does not read as none."""
    if fraction >= 0.01 or fraction == 0:
        return f"{fraction:.0%}"
    return f"{fraction:.1%}" if fraction >= 0.001 else "<0.1%"


def _draw_progress(ax: Any, data: JobPlotData, *, prefix: str, labels: bool) -> list[list[StepPoint]]:
    """Rank 0's steps on ``ax`` with the shaded phases, a line per failure, detection and
    recovery, and a point per commit; each artist's gid is ``prefix`` + its kind. Returns
    the pieces the step line was drawn in."""
    shown: set[str] = set()
    for p in data.phases:
        span = ax.axvspan(p.start_s, p.end_s, color=_PHASE_COLORS[p.kind], alpha=0.22, lw=0,
                          hatch="//" if p.kind == "recomputed" else None,
                          label=PHASE_LABELS[p.kind] if labels and p.kind not in shown else None)
        span.set_gid(f"{prefix}phase:{p.kind}")
        shown.add(p.kind)
    pieces = _pieces(data.steps, [f.reported_s for f in data.failures])
    for i, piece in enumerate(pieces):
        (line,) = ax.plot([p.time_s for p in piece], [p.step for p in piece], "-", color="#263238", lw=1.4,
                          label="rank 0's step" if labels and i == 0 else None)
        line.set_gid(f"{prefix}steps")
    lost = [p for p in data.steps if p.lost]
    if lost:
        (line,) = ax.plot([p.time_s for p in lost], [p.step for p in lost], "x", color="#616161", ms=4,
                          label="steps trained again later" if labels else None)
        line.set_gid(f"{prefix}lost-steps")
    for i, f in enumerate(data.failures):
        first = labels and i == 0
        ax.axvline(f.failed_s, color=_MARKER_COLORS["failure"], lw=1.6,
                   label="failure (failed rank's last progress)" if first else None).set_gid(f"{prefix}failure")
        ax.axvline(f.reported_s, color=_MARKER_COLORS["detection"], lw=1.3, ls="--",
                   label="detection (failure reported to the master)" if first else None).set_gid(f"{prefix}detection")
        if labels and f.step is not None:
            who = f"rank {f.rank}" if f.rank is not None else f"node {f.node_id}"
            what = f.detail.split(":")[0][:24]  # "SIGKILL", "RuntimeError": the message is in result.json
            note = ax.annotate(f"{who} {what}".strip(), (f.failed_s, f.step), xytext=(-4, 6 + 11 * (i % 4)),
                               textcoords="offset points", fontsize=8, ha="right", color=_MARKER_COLORS["failure"])
            note.set_in_layout(False)
    for i, r in enumerate(data.recoveries):
        ax.axvline(r.time_s, color=_MARKER_COLORS["recovery"], lw=1.3, ls=":",
                   label="recovery (first step after the failure)" if labels and i == 0 else None,
                   ).set_gid(f"{prefix}recovery")
    if data.commits:
        commits = ax.scatter([c.time_s for c in data.commits], [c.step for c in data.commits], marker="D", s=28,
                             color=_MARKER_COLORS["commit"], zorder=3, label="checkpoint committed" if labels else None)
        commits.set_gid(f"{prefix}commit")
    return pieces


def _zoom_window(data: JobPlotData) -> tuple[float, float] | None:
    """Seconds around the first failure: from a few steps before its rank's last progress to
    a few steps after training resumed and the world size is back to what it was; ``None``
    without failures, or when that is a fifth of the time axis or more (the main panel shows
    it well enough)."""
    if not data.failures:
        return None
    first = data.failures[0]
    resumed = min((r.time_s for r in data.recoveries if r.time_s > first.reported_s), default=first.reported_s)
    before = [w for t, w in data.world_sizes if t <= first.failed_s]
    regrown = [t for t, w in data.world_sizes if t > first.reported_s and before and w >= before[-1]]
    end = max(resumed, min(regrown, default=resumed))  # training resumed, and the world is whole again
    dts = sorted(p.dt_s for p in data.steps if p.dt_s > 0)
    margin = 4 * (dts[len(dts) // 2] if dts else 0.5)
    lo, hi = first.failed_s - margin, max(end, first.reported_s) + margin
    if hi - lo >= data.end_s / 5:
        return None
    return lo, hi


def _pieces(points: Sequence[StepPoint], breaks: Sequence[float]) -> list[list[StepPoint]]:
    """``points`` cut where a failure was reported between two of them: the line does not
    join the last step before a failure to the first one after its recovery."""
    out: list[list[StepPoint]] = []
    for p in points:
        if out and not any(out[-1][-1].time_s < b < p.time_s for b in breaks):
            out[-1].append(p)
        else:
            out.append([p])
    return out


def _count(fig: Any, gid: str) -> int:
    """How many marks with ``gid`` the figure holds (a scatter counts its points)."""
    n = 0
    for artist in fig.findobj(lambda a: a.get_gid() == gid):
        offsets = getattr(artist, "get_offsets", None)
        n += len(offsets()) if offsets is not None else 1
    return n


def render(data: JobPlotData, path: str | Path, *, dpi: int = 110) -> PlotSummary:
    """Draw ``data`` (see :func:`draw`) into the image ``path`` (PNG, or what its suffix names).

    Args:
        data: what :func:`read_job` read.
        path: the image to write; its directory is created.
        dpi: dots per inch (the figure is 14 x 10 inches).

    Returns:
        What is on the image, with ``path`` set.

    Raises:
        JobPlotError: matplotlib is not installed, or ``path`` cannot be written.
    """
    fig, summary = draw(data)
    out = Path(path)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(out, dpi=dpi)
    except (OSError, ValueError) as exc:
        raise JobPlotError(f"cannot write the plot to {out}: {exc}; pass -o with a writable .png path", out) from exc
    log.info("job_plotted", job_id=data.job_id, path=str(out), failures=summary.markers["failure"],
             steps=summary.steps)
    return attrs.evolve(summary, path=str(out))
