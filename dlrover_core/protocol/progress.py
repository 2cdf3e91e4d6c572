"""Progress records: what a worker appends to its progress file, one JSON object a line.

A worker writes them (``train.report`` → :class:`StepRecord`, ``Checkpointer.save`` →
:class:`CheckpointRecord`, ``Checkpointer.load`` → :class:`RestoreRecord`, the excepthook →
:class:`ExceptionRecord`, ``train.steps()`` → :class:`DoneRecord`, :class:`LiveReadyRecord`,
:class:`LiveRecord`); its agent tails the file (hang detection, failure reports, the saver's
ranks) and forwards rank 0's records to the master in ``Heartbeat.records`` (goodput, the
rate, the metrics); ``dlrover plot`` reads the files a job left. All of them read and write
the records through this module, so there is one format:

* a record is a frozen attrs class; :data:`ProgressRecord` is their union, tagged on the wire
  by the JSON key ``"type"`` (:class:`RecordType`);
* :func:`encode_record` / :func:`record_line` write one (``encode`` of the shared converter
  gives the same dict), :func:`decode_record` / :func:`read_line` read one back;
* the JSON keys are those of the files written before these classes existed (``dt``, ``t``,
  ``gen``, ``bytes``): field names carry their units (``dt_s``, ``unix_time_s``,
  ``size_bytes``) and are renamed on the wire, so old run directories still read;
* a newer worker may add record types and fields: an unknown ``"type"`` decodes to ``None``
  (skipped, never an error) and unknown fields are ignored; a known type with a missing or
  mistyped field is a :class:`~dlrover_core.errors.ProtocolError` naming the record and field.

:class:`WorkerException` lives here too: it is what an exception record carries, and the
agent puts it into its ``WorkerFailure`` (:mod:`dlrover_core.protocol.messages` re-exports it).
"""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Mapping
from typing import Any, ClassVar, get_args, get_origin

import attrs
from cattrs import IterableValidationError
from cattrs.errors import IterableValidationNote
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override

from dlrover_core.errors import ProtocolError
from dlrover_core.protocol.codec import converter, decode

__all__ = [
    "RECORD_CLASSES",
    "CheckpointRecord",
    "DoneRecord",
    "ExceptionRecord",
    "LiveReadyRecord",
    "LiveRecord",
    "ProgressRecord",
    "RecordType",
    "RestoreRecord",
    "StepRecord",
    "WorkerException",
    "decode_record",
    "encode_record",
    "read_line",
    "record_line",
]


class RecordType(str, enum.Enum):
    """The ``"type"`` of a progress record: which class it decodes to (str-valued: the
    files keep the same strings)."""

    #: a step finished (``train.report``): :class:`StepRecord`
    STEP = "step"
    #: a checkpoint save copied the state (``Checkpointer.save``): :class:`CheckpointRecord`
    CHECKPOINT = "checkpoint"
    #: a checkpoint was put back (``Checkpointer.load``): :class:`RestoreRecord`
    RESTORE = "restore"
    #: an uncaught exception, before the worker dies: :class:`ExceptionRecord`
    EXCEPTION = "exception"
    #: the last step of ``train.steps()`` is done (the worker exits): :class:`DoneRecord`
    DONE = "done"
    #: the worker loops in a live world and may be replaced alone: :class:`LiveReadyRecord`
    LIVE_READY = "live_ready"
    #: the worker re-formed its live world (a failure, a joiner): :class:`LiveRecord`
    LIVE = "live"

    def __str__(self) -> str:
        return self.value


@attrs.frozen(kw_only=True)
class WorkerException:
    """The uncaught exception a worker recorded before it died (worker → agent, inside an
    :class:`ExceptionRecord` of its progress file; then inside a
    :class:`~dlrover_core.protocol.messages.WorkerFailure`).

    Attributes:
        exc_type: the exception's type (``ValueError``; ``pkg.mod.Error`` outside builtins).
        message: ``str(exception)``, at most 1,000 characters.
        step: the last step the worker reported or restored (-1: none).
        before_first_step: the worker had not reported a step yet (``None`` from workers
            that did not say; then ``step`` < 0 counts as before).
        traceback: the end of the formatted traceback.
        unix_time_s: when it was raised (seconds since the epoch): the worker's own record,
            or the timestamp torch's ``@record`` wrote into its error file (whole seconds);
            ``None``: unknown.
    """

    exc_type: str
    message: str = ""
    step: int = -1
    before_first_step: bool | None = None
    traceback: str = ""
    unix_time_s: float | None = None

    def raised_before_first_step(self) -> bool:
        """Whether it was raised before the worker's first step (at import or start-up)."""
        if self.before_first_step is None:
            return self.step < 0
        return bool(self.before_first_step)


@attrs.frozen(kw_only=True)
class StepRecord:
    """A step finished: one ``train.report(step, ...)`` call (``"type": "step"``).

    Attributes:
        step: the step that finished, counted from 0.
        rank: the global rank the worker held when it reported (it changes in the live
            world; ``None`` in files of writers that did not say: the file's worker's rank).
        dt_s: seconds the step took, from the previous mark (the previous report, or the end
            of a checkpoint save, restore or live re-form); JSON key ``dt``.
        unix_time_s: when it was reported, seconds since the epoch (the worker's clock;
            ``None``: not recorded); JSON key ``t``.
        metrics: the script's scalars by name (``loss``); NaN and infinities are written as
            the strings ``"nan"``, ``"inf"``, ``"-inf"`` and read back as floats; a value
            that is no number is left out when read.
        generation: the live world's generation the worker trained in (0: the round's own
            process group); the master orders records of different nodes by it; JSON key
            ``gen``, written only when not 0.
        total_steps: how many steps the run trains in all (``None``: not given yet).
        samples: how many samples the whole job processed since the previous report (all
            ranks together; ``None``: not given).
        tokens: the same count in tokens (``None``: not given).
    """

    type: ClassVar[RecordType] = RecordType.STEP

    step: int
    rank: int | None = None
    dt_s: float = 0.0
    unix_time_s: float | None = None
    metrics: dict[str, float] = attrs.field(factory=dict)
    generation: int = 0
    total_steps: int | None = None
    samples: float | None = None
    tokens: float | None = None


@attrs.frozen(kw_only=True)
class CheckpointRecord:
    """A checkpoint save copied this rank's state (``Checkpointer.save``; ``"type": "checkpoint"``).

    Attributes:
        step: the step saved.
        stall_s: seconds training waited for the save (the copy, and a wait for a free slot).
        where: ``"memory"`` (a shared-memory snapshot the agent's saver persists) or
            ``"storage"`` (written directly: no shared memory).
        persist: the save is to become durable in storage (the agent reports the step in
            ``Heartbeat.saves``); ``False``: memory only.
        size_bytes: bytes of this rank's shard; JSON key ``bytes``.
        waited_s: seconds of ``stall_s`` spent waiting for a snapshot slot whose persist was
            still running (the storage writes slower than the job saves).
        rank: the global rank that saved (``None``: the file's worker's rank; writers leave it out).
    """

    type: ClassVar[RecordType] = RecordType.CHECKPOINT

    step: int
    stall_s: float = 0.0
    where: str = "memory"
    persist: bool = False
    size_bytes: int = 0
    waited_s: float = 0.0
    rank: int | None = None


@attrs.frozen(kw_only=True)
class RestoreRecord:
    """A checkpoint was put back (``Checkpointer.load``; ``"type": "restore"``): training goes
    on from ``step + 1``.

    Attributes:
        step: the step restored.
        source: ``"memory"`` (a snapshot in shared memory), ``"storage"``, or ``"peer"``
            (a sharded world's replacement got the state from a live member of its
            replica group: ``train.peer``).
        load_s: seconds the restore took.
        rank: the global rank that restored (``None``: the file's worker's rank; writers leave it out).
    """

    type: ClassVar[RecordType] = RecordType.RESTORE

    step: int
    source: str = ""
    load_s: float = 0.0
    rank: int | None = None


@attrs.frozen(kw_only=True)
class ExceptionRecord:
    """An uncaught exception, recorded before the worker dies (``"type": "exception"``).

    On the wire the exception's fields sit in the record itself (``{"type": "exception",
    "exc_type": ..., "message": ..., ...}``).

    Attributes:
        exception: the exception, as the agent reports it in its ``WorkerFailure``.
        rank: the global rank that raised it (``None``: the file's worker's rank; writers leave it out).
    """

    type: ClassVar[RecordType] = RecordType.EXCEPTION

    exception: WorkerException
    rank: int | None = None


@attrs.frozen(kw_only=True)
class DoneRecord:
    """The worker left ``train.steps()`` after its last step (``"type": "done"``): it is
    exiting, not hung.

    Attributes:
        rank: the global rank it held.
        step: its last step (-1: it trained none).
    """

    type: ClassVar[RecordType] = RecordType.DONE

    rank: int | None = None
    step: int = -1


@attrs.frozen(kw_only=True)
class LiveReadyRecord:
    """The worker loops with ``train.steps()`` in a live world (``"type": "live_ready"``): its
    agent may replace it alone when it fails.

    Attributes:
        rank: the global rank it holds.
    """

    type: ClassVar[RecordType] = RecordType.LIVE_READY

    rank: int | None = None


@attrs.frozen(kw_only=True)
class LiveRecord:
    """The worker re-formed its live world and trains on (``"type": "live"``).

    Attributes:
        rank: the global rank it holds in the new generation.
        reason: why: ``"error"`` (a collective failed: a peer died), ``"grow"`` (the
            generation ended for a replacement to join) or ``"join"`` (this worker is the
            replacement that joined).
        generation: the new generation.
        world_size: its number of workers.
        step: the step it trains next.
        reform_s: seconds from leaving the old process group to training in the new one
            (the survivors' lost time; a joiner's includes its wait to join).
        unix_time_s: when it finished re-forming, seconds since the epoch (``None``: not
            recorded); JSON key ``t``.
    """

    type: ClassVar[RecordType] = RecordType.LIVE

    rank: int | None = None
    reason: str = ""
    generation: int = 0
    world_size: int = 0
    step: int = -1
    reform_s: float = 0.0
    unix_time_s: float | None = None


#: Any progress record.
ProgressRecord = (StepRecord | CheckpointRecord | RestoreRecord | ExceptionRecord | DoneRecord | LiveReadyRecord
                  | LiveRecord)

#: The class of each record type.
RECORD_CLASSES: dict[RecordType, type[Any]] = {
    cls.type: cls for cls in (StepRecord, CheckpointRecord, RestoreRecord, ExceptionRecord, DoneRecord,
                              LiveReadyRecord, LiveRecord)
}
_BY_TAG: dict[str, type[Any]] = {kind.value: cls for kind, cls in RECORD_CLASSES.items()}


# ----- the wire format ----------------------------------------------------------------------


def _structure_metrics(data: Any, _: Any) -> dict[str, float]:
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise TypeError(f"expected an object of metrics, got {data!r}")
    out = {}
    for name, value in data.items():
        try:
            out[str(name)] = float(value)  # "nan", "inf", "-inf" too
        except (TypeError, ValueError):
            continue  # not a number: left out (the master never could use it)
    return out


def _unstructure_metrics(metrics: Mapping[str, float]) -> dict[str, Any]:
    return {name: (value if math.isfinite(value) else str(value)) for name, value in metrics.items()}


def _optional(*names: str) -> dict[str, Any]:
    return {name: override(omit_if_default=True) for name in names}


#: Per class: the fields renamed on the wire (field -> JSON key) and left out while at their default.
_WIRE: dict[type[Any], dict[str, Any]] = {
    StepRecord: {"dt_s": override(rename="dt"), "unix_time_s": override(rename="t", omit_if_default=True),
                 "metrics": override(struct_hook=_structure_metrics, unstruct_hook=_unstructure_metrics),
                 "generation": override(rename="gen", omit_if_default=True),
                 **_optional("rank", "total_steps", "samples", "tokens")},
    CheckpointRecord: {"size_bytes": override(rename="bytes"), **_optional("rank")},
    RestoreRecord: _optional("rank"),
    DoneRecord: {},
    LiveReadyRecord: {},
    LiveRecord: {"unix_time_s": override(rename="t")},
}


def _register(cls: type[Any], overrides: dict[str, Any]) -> None:
    unstructure = make_dict_unstructure_fn(cls, converter, **overrides)
    tag = cls.type.value
    # the keys in field order, as the writers before these classes wrote them (cattrs puts
    # the fields left out at their default last)
    keys = [overrides[a.name].rename if a.name in overrides and overrides[a.name].rename else a.name
            for a in attrs.fields(cls)]

    def unstructure_tagged(record: Any) -> dict[str, Any]:
        data = unstructure(record)
        return {"type": tag, **{key: data[key] for key in keys if key in data}}

    converter.register_unstructure_hook(cls, unstructure_tagged)
    converter.register_structure_hook(cls, make_dict_structure_fn(cls, converter, _cattrs_forbid_extra_keys=False,
                                                                  **overrides))


for _cls, _overrides in _WIRE.items():
    _register(_cls, _overrides)


def _unstructure_exception_record(record: ExceptionRecord) -> dict[str, Any]:
    out = {"type": RecordType.EXCEPTION.value, **converter.unstructure(record.exception)}
    if record.rank is not None:
        out["rank"] = record.rank
    return out


def _structure_exception_record(data: Any, _: Any) -> ExceptionRecord:
    if not isinstance(data, Mapping):
        raise TypeError(f"expected an object, got {data!r}")
    rank = data.get("rank")
    return ExceptionRecord(exception=converter.structure(data, WorkerException),
                           rank=None if rank is None else converter.structure(rank, int))


converter.register_unstructure_hook(ExceptionRecord, _unstructure_exception_record)
converter.register_structure_hook(ExceptionRecord, _structure_exception_record)


def _record_class(data: Any) -> type[Any] | None:
    """The class of the record ``data`` (``None``: a type this version does not know)."""
    if not isinstance(data, Mapping):
        raise TypeError(f"expected a JSON object, got {data!r}")
    tag = data.get("type")
    return _BY_TAG.get(tag) if isinstance(tag, str) else None


def _is_records(cl: Any) -> bool:
    """``tuple[ProgressRecord, ...]`` (``Heartbeat.records``)."""
    return get_origin(cl) is tuple and get_args(cl) == (ProgressRecord, ...)


def _structure_records(data: Any, _: Any) -> tuple[ProgressRecord, ...]:
    """The known records of a list (a newer peer's types are dropped); the errors of the
    malformed ones together, each with its index."""
    if isinstance(data, (str, bytes, Mapping)) or not isinstance(data, (list, tuple)):
        raise TypeError(f"expected a list of progress records, got {data!r}")
    records, errors = [], []
    for i, item in enumerate(data):
        try:
            cls = _record_class(item)
            if cls is not None:
                records.append(converter.structure(item, cls))
        except Exception as exc:
            exc.__notes__ = [*getattr(exc, "__notes__", []),
                             IterableValidationNote(f"Structuring progress record @ index {i}", i, object)]
            errors.append(exc)
    if errors:
        raise IterableValidationError("While structuring progress records", errors, tuple)
    return tuple(records)


converter.register_structure_hook_func(_is_records, _structure_records)
converter.register_unstructure_hook_func(_is_records, lambda records: [encode_record(r) for r in records])


# ----- reading and writing -----------------------------------------------------------------------


def encode_record(record: ProgressRecord) -> dict[str, Any]:
    """``record`` as the JSON object of a progress file: ``{"type": ..., <its fields>}``."""
    return converter.unstructure(record)


def decode_record(data: Any) -> ProgressRecord | None:
    """The record ``data`` (a JSON object of a progress file) holds.

    Returns ``None`` for a record whose ``"type"`` this version does not know (a newer
    worker's): skip it. Fields it does not know are ignored; missing optional ones take
    their defaults.

    Raises:
        ProtocolError: ``data`` is not a JSON object, or a field of a known type is missing
            or mistyped (the message names the record and the field).
    """
    try:
        cls = _record_class(data)
    except TypeError as exc:
        raise ProtocolError(f"malformed progress record: {exc}") from None
    return None if cls is None else decode(cls, data)


def record_line(record: ProgressRecord) -> str:
    """``record`` as one line of a progress file (compact JSON, no newline)."""
    return json.dumps(encode_record(record), allow_nan=True, separators=(",", ":"))


def read_line(line: str | bytes) -> ProgressRecord | None:
    """The record on one line of a progress file (``None``: a type this version does not
    know; see :func:`decode_record`).

    Raises:
        ProtocolError: the line is not JSON, or not a well-formed record of a known type.
    """
    try:
        data = json.loads(line)
    except ValueError as exc:
        raise ProtocolError(f"malformed progress record: not JSON ({exc})") from None
    return decode_record(data)
