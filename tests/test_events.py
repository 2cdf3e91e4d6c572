"""Event kinds as protocol types (dlrover_core.protocol.events.EventKind): every kind the core
emits is declared, every declared kind is emitted, and events.jsonl keeps the same strings."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from dlrover_core.protocol import EventKind, JobEvent

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "dlrover_core"
#: The names the core emits events through: ``JobMaster.event`` / ``MasterContext.event``,
#: the collaborators' ``_event`` callbacks, and ``JobMaster._checkpoint_event``.
EMITTERS = ("event", "_event", "_checkpoint_event")


def _called_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Attribute):
        return func.attr
    if isinstance(func, ast.Name):
        return func.id
    return None


def emitted_kinds() -> dict[str, list[str]]:
    """Every event kind a call in ``dlrover_core`` emits, as a string literal or an
    ``EventKind`` member -> where (``path:line``). Calls that pass a kind through (``kind``,
    a variable) are not kinds of their own."""
    found: dict[str, list[str]] = {}
    for path in sorted(CORE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not (isinstance(node, ast.Call) and _called_name(node.func) in EMITTERS and node.args):
                continue
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                kind = arg.value
            elif isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name) and arg.value.id == "EventKind":
                kind = EventKind[arg.attr].value if arg.attr in EventKind.__members__ else f"EventKind.{arg.attr}"
            else:
                continue
            found.setdefault(kind, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_event_kind_the_core_emits_is_declared():
    """A new ``event("...")`` call needs its kind in EventKind (with its data fields)."""
    emitted = emitted_kinds()
    undeclared = {kind: where for kind, where in emitted.items() if kind not in {k.value for k in EventKind}}
    assert not undeclared, f"declare these in dlrover_core/protocol/events.py EventKind: {undeclared}"


def test_every_declared_event_kind_is_emitted_somewhere():
    """EventKind lists what the master emits, nothing it stopped emitting."""
    emitted = emitted_kinds()
    assert len(emitted) > 15, emitted  # the scan found the call sites
    assert sorted(k.value for k in EventKind if k.value not in emitted) == []


@pytest.mark.parametrize("kind", list(EventKind), ids=lambda k: k.value)
def test_an_event_kind_is_written_to_events_jsonl_as_its_plain_string(kind):
    event = JobEvent(kind=kind, job_id="job-1", time_s=1.0, data={"step": 3})
    line = json.dumps(event.to_dict())
    assert json.loads(line)["kind"] == kind.value and f'"kind": "{kind.value}"' in line
    assert kind == kind.value and str(kind) == kind.value and f"{kind}" == kind.value
    assert EventKind(kind.value) is kind  # a reader turns the string back into the member


def test_docs_architecture_lists_every_event_kind():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    assert [k.value for k in EventKind if f"`{k.value}`" not in doc] == []
