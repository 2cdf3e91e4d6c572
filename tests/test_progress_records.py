"""Progress records as protocol types (dlrover_core.protocol.progress): the worker writes them,
the agent reads them, the heartbeat carries them typed, the master folds them in, and the
file format is the one older run directories have."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import pytest
import structlog

from dlrover_core import Job, Nodes
from dlrover_core.agent.progress import ProgressTail
from dlrover_core.errors import ProtocolError
from dlrover_core.master.job_master import JobMaster
from dlrover_core.protocol import Heartbeat, Join, Poll, Register, decode, encode
from dlrover_core.protocol.progress import (
    RECORD_CLASSES,
    CheckpointRecord,
    DoneRecord,
    ExceptionRecord,
    LiveReadyRecord,
    LiveRecord,
    RecordType,
    RestoreRecord,
    StepRecord,
    WorkerException,
    decode_record,
    encode_record,
    read_line,
    record_line,
)
from dlrover_core.train.progress import ProgressWriter

GOLDEN = Path(__file__).parent / "golden" / "progress_before_typed_records.jsonl"

EXCEPTION = WorkerException(exc_type="ValueError", message="boom", step=9, before_first_step=False,
                            traceback="Traceback ...", unix_time_s=1.7e9)

#: One record of every kind, with the JSON object a progress file holds for it.
RECORDS = [
    (StepRecord(step=3, rank=0, dt_s=0.25, unix_time_s=1.7e9, metrics={"loss": 2.5}, generation=2, total_steps=10,
                samples=64, tokens=8192),
     {"type": "step", "step": 3, "rank": 0, "dt": 0.25, "t": 1.7e9, "metrics": {"loss": 2.5}, "gen": 2,
      "total_steps": 10, "samples": 64, "tokens": 8192}),
    (StepRecord(step=0, rank=1, dt_s=0.5, unix_time_s=1.7e9, metrics={}),
     {"type": "step", "step": 0, "rank": 1, "dt": 0.5, "t": 1.7e9, "metrics": {}}),
    (CheckpointRecord(step=5, stall_s=0.01, where="memory", persist=True, size_bytes=4096, waited_s=0.002),
     {"type": "checkpoint", "step": 5, "stall_s": 0.01, "where": "memory", "persist": True, "bytes": 4096,
      "waited_s": 0.002}),
    (RestoreRecord(step=5, source="storage", load_s=0.3),
     {"type": "restore", "step": 5, "source": "storage", "load_s": 0.3}),
    (ExceptionRecord(exception=EXCEPTION),
     {"type": "exception", "exc_type": "ValueError", "message": "boom", "step": 9, "before_first_step": False,
      "traceback": "Traceback ...", "unix_time_s": 1.7e9}),
    (DoneRecord(rank=0, step=29), {"type": "done", "rank": 0, "step": 29}),
    (LiveReadyRecord(rank=1), {"type": "live_ready", "rank": 1}),
    (LiveRecord(rank=0, reason="error", generation=1, world_size=1, step=12, reform_s=0.04, unix_time_s=1.7e9),
     {"type": "live", "rank": 0, "reason": "error", "generation": 1, "world_size": 1, "step": 12, "reform_s": 0.04,
      "t": 1.7e9}),
]


# ----- the format ---------------------------------------------------------------------------------


def test_every_record_type_has_a_class_and_an_example():
    assert set(RECORD_CLASSES) == set(RecordType)
    assert {type(record) for record, _ in RECORDS} == set(RECORD_CLASSES.values())
    assert all(cls.type is kind for kind, cls in RECORD_CLASSES.items())


@pytest.mark.parametrize(("record", "wire"), RECORDS, ids=[type(r).__name__ for r, _ in RECORDS])
def test_a_record_is_written_with_the_keys_progress_files_always_had(record, wire):
    assert encode_record(record) == wire
    assert json.loads(record_line(record)) == wire
    assert "\n" not in record_line(record)


@pytest.mark.parametrize(("record", "wire"), RECORDS, ids=[type(r).__name__ for r, _ in RECORDS])
def test_a_record_comes_back_equal_from_its_line(record, wire):
    assert read_line(record_line(record)) == record
    assert decode_record(wire) == record


def test_files_written_before_the_records_were_typed_read_the_same():
    """tests/golden/progress_before_typed_records.jsonl was written by the writer and the
    checkpoint, live and excepthook code before this module existed; every line decodes,
    and written again it is the same JSON object (the exception record's extra ``t``, a
    second copy of ``unix_time_s``, aside)."""
    lines = GOLDEN.read_text().splitlines()
    records = [read_line(line) for line in lines]
    assert [type(r) for r in records] == [StepRecord, StepRecord, CheckpointRecord, RestoreRecord, LiveReadyRecord,
                                          LiveRecord, DoneRecord, ExceptionRecord]
    first, second = records[0], records[1]
    assert (first.step, first.rank, first.metrics, first.total_steps, first.samples, first.tokens) == (
        0, 0, {"loss": 2.5, "lr": 0.1}, 10, 64, 8192)
    assert second.generation == 1 and math.isnan(second.metrics["loss"])
    assert records[2].size_bytes == 4096 and records[2].persist
    assert records[7].exception.exc_type == "ValueError" and not records[7].exception.before_first_step
    for line, record in zip(lines, records, strict=True):
        old = json.loads(line)
        if record.type == RecordType.EXCEPTION:
            old.pop("t")
        assert json.loads(record_line(record)) == old


def test_the_writer_writes_what_the_readers_read(tmp_path):
    """``train.report`` through :class:`ProgressWriter`: one line per call, read back as the
    same StepRecord; the total is repeated, NaN survives as a string on disk."""
    path = tmp_path / "p.jsonl"
    w = ProgressWriter(str(path))
    w.step(0, {"loss": 1.0}, total_steps=10, samples=64, tokens=8192)
    w.generation = 3
    w.step(1, {"loss": float("nan")})
    w.write(RestoreRecord(step=1, source="memory", load_s=0.1))
    first, second, restore = (read_line(line) for line in path.read_text().splitlines())
    assert (first.step, first.rank, first.total_steps, first.samples, first.metrics) == (0, 0, 10, 64, {"loss": 1.0})
    assert second.generation == 3 and second.total_steps == 10 and math.isnan(second.metrics["loss"])
    assert second.samples is None and '"loss":"nan"' in path.read_text().splitlines()[1]
    assert restore == RestoreRecord(step=1, source="memory", load_s=0.1)
    assert (w.last_step, w.restored_step) == (1, 1)


# ----- what a newer worker or a damaged file may hold -------------------------------------------------


@pytest.mark.parametrize("line", [
    '{"type": "profile", "step": 3, "flops": 1e12}',  # a record type a newer worker writes
    '{"step": 3}',  # no type at all
    '{"type": 7, "step": 3}',
])
def test_a_record_of_a_type_this_version_does_not_know_decodes_to_none(line):
    assert read_line(line) is None


def test_fields_a_newer_worker_adds_are_ignored_and_missing_optional_ones_default():
    record = read_line('{"type": "step", "step": 4, "dt": 0.5, "rank": 0, "flops": 1e12, "metrics": {"loss": 1}}')
    assert record == StepRecord(step=4, dt_s=0.5, rank=0, metrics={"loss": 1.0})
    assert read_line('{"type": "checkpoint", "step": 2}') == CheckpointRecord(step=2)


def test_a_metric_that_is_no_number_is_left_out_and_non_finite_ones_read_back_as_floats():
    record = read_line('{"type": "step", "step": 1, "metrics": {"loss": "nan", "acc": "inf", "note": "hi", "x": null}}')
    assert set(record.metrics) == {"loss", "acc"} and math.isnan(record.metrics["loss"])
    assert record.metrics["acc"] == math.inf


@pytest.mark.parametrize(("line", "names"), [
    ('{"type": "step", "dt": 0.5}', "StepRecord: required field missing @ $.step"),
    ('{"type": "restore", "step": "three"}', "RestoreRecord: invalid value for type, expected int @ $.step"),
    ('{"type": "exception", "message": "boom"}', "exc_type"),
    ('[1, 2]', "expected a JSON object"),
    ('{"type": "step", "step": 3', "not JSON"),
])
def test_a_malformed_record_of_a_known_type_is_a_protocol_error_naming_the_field(line, names):
    with pytest.raises(ProtocolError, match=names.replace("$", r"\$").replace("[", r"\[")):
        read_line(line)


# ----- the agent ------------------------------------------------------------------------------------


def _append(path: Path, *lines: str) -> None:
    with open(path, "a") as f:
        f.write("".join(line + "\n" for line in lines))


def test_the_agent_reads_typed_records_and_skips_what_it_cannot_read(tmp_path):
    """The tail returns the records it knows, keeps the newest step, step times, the live
    and done marks and the exception; a newer worker's record type counts as progress but
    is not forwarded; a damaged line and a half-written last line never stop it."""
    tail = ProgressTail(tmp_path / "p.jsonl", started=time.monotonic() - 100.0)
    _append(tail.path, record_line(StepRecord(step=0, rank=0, dt_s=0.5)), '{"type": "step"}', "not json",
            record_line(LiveReadyRecord(rank=0)), '{"type": "profile", "flops": 1}')
    before = tail.last_progress
    records = tail.read()
    assert records == [StepRecord(step=0, rank=0, dt_s=0.5), LiveReadyRecord(rank=0)]
    assert (tail.last_step, tail.step_times, tail.live, tail.done) == (0, [0.5], True, False)
    assert tail.last_progress > before and tail.take_unsent() == records
    with open(tail.path, "a") as f:
        f.write(record_line(ExceptionRecord(exception=EXCEPTION)) + "\n" + record_line(DoneRecord(rank=0, step=0))[:9])
    assert tail.read() == [ExceptionRecord(exception=EXCEPTION)] and tail.exception == EXCEPTION
    _append(tail.path, record_line(DoneRecord(rank=0, step=0))[9:])  # the rest of the half-written line
    assert tail.read() == [DoneRecord(rank=0, step=0)] and tail.done
    stale = tail.last_progress
    _append(tail.path, "garbage")
    assert tail.read() == [] and tail.last_progress == stale  # not a record: no progress


# ----- the heartbeat and the master --------------------------------------------------------------------


def test_the_heartbeat_carries_records_typed_and_drops_types_the_master_does_not_know():
    beat = Heartbeat(node_id=0, round=0, records=(StepRecord(step=1, rank=0, dt_s=0.1), LiveRecord(rank=0, step=2)))
    wire = json.loads(json.dumps(encode(beat)))
    assert wire["records"][0] == {"type": "step", "step": 1, "rank": 0, "dt": 0.1, "metrics": {}}
    assert decode(Heartbeat, wire) == beat
    wire["records"].insert(1, {"type": "profile", "flops": 1e12})
    assert decode(Heartbeat, wire) == beat


def test_a_malformed_record_in_a_heartbeat_is_named_with_its_index():
    with pytest.raises(ProtocolError, match=r"Heartbeat: required field missing @ \$\.records\[1\]\.step"):
        decode(Heartbeat, {"node_id": 0, "records": [{"type": "done"}, {"type": "restore", "source": "memory"}]})


def test_the_master_folds_typed_records_into_metrics_goodput_and_events(tmp_path):
    (tmp_path / "t.py").write_text("")
    job = Job(name="m", entrypoint=str(tmp_path / "t.py"), nodes=Nodes(min=1, max=1))
    events = []
    m = JobMaster(job, "job-1", store_host="127.0.0.1", store_factory=lambda: (5000, None), emit=events.append)
    m.register(Register(node_id=0, host="h", pid=100))
    m.join(Join(node_id=0, nproc=1))
    m.poll(Poll(node_id=0))
    records = (StepRecord(step=0, rank=0, dt_s=1.0, unix_time_s=10.0, metrics={"loss": 2.0, "lr": 0.1}),
               StepRecord(step=1, rank=0, dt_s=1.0, unix_time_s=11.0, metrics={"loss": 1.5}, total_steps=4),
               CheckpointRecord(step=1, stall_s=0.25, persist=True, waited_s=0.5),
               RestoreRecord(step=0, source="memory", load_s=0.125))
    with structlog.testing.capture_logs() as logs:
        m.heartbeat(Heartbeat(node_id=0, round=0, records=records))
    assert m.metrics == {"loss": 1.5, "lr": 0.1}
    assert (m.goodput.checkpoint_stall_s, m.goodput.restore_s, m.goodput.last_step) == (0.25, 0.125, 0)
    assert m.rate.total_steps == 4
    kinds = [(e.kind, e.data) for e in events if e.kind.startswith("checkpoint")]
    assert kinds == [("checkpoint_backpressure", {"step": 1, "waited_s": 0.5}),
                     ("checkpoint_restored", {"step": 0, "source": "memory", "load_s": 0.125})]
    assert {"event": "checkpoint_restored", "log_level": "info", "step": 0, "source": "memory",
            "load_s": 0.125} in logs


def test_docs_architecture_lists_every_record_type_and_class():
    doc = (Path(__file__).resolve().parents[1] / "docs" / "architecture.md").read_text()
    missing = [name for kind, cls in RECORD_CLASSES.items() for name in (kind.value, cls.__name__)
               if f"`{name}`" not in doc]
    assert missing == []
