"""README's benchmark tables are generated from benchmarks/results/*.json (benchmarks/tables.py):
every result file renders, README is in sync with the JSON as committed, and a changed figure
makes ``--check`` fail. In-process and without matplotlib (the plots' drawing is not run here)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _load():
    spec = importlib.util.spec_from_file_location("bench_tables", ROOT / "benchmarks" / "tables.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


tables = _load()


@pytest.fixture
def repo_copy(tmp_path: Path) -> tuple[Path, Path]:
    """README.md and benchmarks/results/ copied into tmp_path, laid out as in the repository."""
    results = tmp_path / "benchmarks" / "results"
    shutil.copytree(RESULTS, results)
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    return tmp_path / "README.md", results


def check(readme: Path, results: Path) -> int:
    return tables.main(["--check", "--readme", str(readme), "--results", str(results)])


def test_every_registered_file_exists_and_every_result_file_renders():
    for name, r in tables.REGISTRY.items():
        assert (RESULTS / r.file).exists(), f"{name}: {r.file} missing"
    rendered = 0
    for path in sorted(RESULTS.glob("*.json")):
        out = tables.render_file(path)
        if out is not None:
            assert out.startswith("|") and "\n|---" in out, path.name
            rendered += 1
    assert rendered >= len(tables.REGISTRY)


def test_readme_is_in_sync_with_the_results(capsys):
    assert tables.main(["--check"]) == 0, capsys.readouterr().out


def test_check_fails_when_a_figure_changes(repo_copy, capsys):
    readme, results = repo_copy
    assert check(readme, results) == 0
    launch = json.loads((results / "launch.json").read_text())
    launch["to_first_line"]["dlrover_run"]["median_s"] = 0.5
    (results / "launch.json").write_text(json.dumps(launch))
    assert check(readme, results) == 1
    assert "0.50 s" in capsys.readouterr().out  # the diff shows the new figure
    assert tables.main(["--readme", str(readme), "--results", str(results)]) == 0
    assert "| the script's first line | 1.67 s (1.31–1.78) | 0.50 s (0.73–1.60) | 0.30 |" in readme.read_text()
    assert check(readme, results) == 0


def test_check_fails_when_the_table_is_edited_by_hand_or_a_marker_is_lost(repo_copy):
    readme, results = repo_copy
    text = readme.read_text()
    readme.write_text(text.replace("| 1,000 | 0.5 s | 0.98 |", "| 1,000 | 0.5 s | 0.97 |"))
    assert check(readme, results) == 1
    readme.write_text(text.replace("<!-- /bench:optim -->", ""))
    assert check(readme, results) == 1


def test_regions_name_the_command_or_say_it_is_not_recorded(repo_copy):
    readme, results = repo_copy
    text = readme.read_text()
    assert "written by `python benchmarks/launch.py --repeat 10`" in text
    doc = json.loads((results / "launch.json").read_text())
    del doc["command"]
    (results / "launch.json").write_text(json.dumps(doc))
    tables.main(["--readme", str(readme), "--results", str(results)])
    assert "`benchmarks/results/launch.json` (command not recorded)" in readme.read_text()


def test_the_prose_around_the_regions_is_kept(repo_copy):
    readme, results = repo_copy
    text = readme.read_text()
    stripped = text
    for name in tables.REGISTRY:
        stripped = tables._marker_re(name).sub(lambda m: m.group(1) + m.group(3), stripped)
    readme.write_text(stripped)
    assert tables.main(["--readme", str(readme), "--results", str(results)]) == 0
    assert readme.read_text() == text


def test_renderers_tolerate_missing_and_new_keys():
    for r in tables.REGISTRY.values():
        assert isinstance(r.render({}), str)
    doc = json.loads((RESULTS / "checkpoint.json").read_text())
    doc["ratios"]["restore_cold_vs_dlrover_cold"] = 0.5
    doc["sizes"]["1024"]["ours"]["restore_cold_s"] = 0.25
    doc["series"] = [{"size_mib": m, "side": "dlrover-core", "stall_s": m / 1e4, "durable_s": m / 1e3,
                      "restore_cold_s": m / 2e3} for m in (64, 256)]
    doc["series"].append({"size_mib": 1024, "DLRover FCP": {"stall_s": 0.2}})  # a dict per side
    out = tables.render_checkpoint(doc)
    assert "| restore_cold_vs_dlrover_cold | 0.50 | — |" in out
    assert "| restore from storage, cold | **0.250** |" in out
    assert "| 64 MiB | dlrover-core | 0.006 | 0.064 | 0.032 |" in out
    assert "| 1 GiB | DLRover FCP | 0.200 | — | — |" in out
    panels, _ = tables.usable(tables.plot_checkpoint(doc))
    assert any(p.title == "restore from storage, cold" for p in panels)


def test_formatting_rounds_as_written():
    assert tables.fixed(2.745, 2) == "2.75"
    assert tables.fixed(40.99, 0) == "41"
    assert tables.ratio2(0.05322) == "0.053" and tables.ratio2(0.9802) == "0.98" and tables.ratio2(0) == "0"
    assert tables.fixed(None, 2) == "—"


def test_plot_data_without_matplotlib(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # the tables must not need it
    assert tables.main(["--check"]) == 0
    assert tables.main(["--plots", "--docs", str(tmp_path)]) == 2
    panels, _ = tables.plot_panels("checkpoint", RESULTS)
    assert {p.title for p in panels} >= {"training stall of a save", "save → committed, fsynced"}
    panels, _ = tables.plot_panels("master_scale", RESULTS)
    assert len(panels) == 2
    row = {"params": 1.2e6, "kind": "memory", "stall_ms": {"median": 1.5, "min": 1.2, "max": 2.0}, "floor_ms": {"median": 0.5}}
    (tmp_path / "save_overhead.json").write_text(json.dumps({"series": [row]}))  # one point: no plot, and it says why
    panels, skipped = tables.plot_panels("save_overhead", tmp_path)
    assert panels == [] and any("1 point" in why for why in skipped)
    (tmp_path / "save_overhead.json").write_text(json.dumps({"series": [row, {**row, "params": 1.1e7}]}))
    panels, _ = tables.plot_panels("save_overhead", tmp_path)
    assert set(panels[0].lines) == {"stall, memory-only save", "floor: copy_ of the same tensors"}
