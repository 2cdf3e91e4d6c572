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
#: checkpoint.json as the benchmark wrote it before its cold restores (warm restore only, no series)
OLD_CHECKPOINT = Path(__file__).resolve().parent / "golden" / "bench_checkpoint_old_shape.json"


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
        assert r.pending or (RESULTS / r.file).exists(), f"{name}: {r.file} missing"
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
    peer, ours = launch["to_first_line"]["torchrun"], launch["to_first_line"]["dlrover_run"]
    row = (f"| the script's first line | {peer['median_s']:.2f} s ({peer['min_s']:.2f}–{peer['max_s']:.2f}) "
           f"| 0.50 s ({ours['min_s']:.2f}–{ours['max_s']:.2f}) | {0.5 / peer['median_s']:.2f} |")
    assert row in readme.read_text()
    assert check(readme, results) == 0


def test_check_fails_when_the_table_is_edited_by_hand_or_a_marker_is_lost(repo_copy):
    readme, results = repo_copy
    text = readme.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| 1,000 | "))
    readme.write_text(text.replace(row, row.replace("| 1,000 | ", "| 1,001 | ")))
    assert check(readme, results) == 1
    readme.write_text(text.replace("<!-- /bench:optim -->", ""))
    assert check(readme, results) == 1


def test_regions_name_the_command_or_say_it_is_not_recorded(repo_copy):
    readme, results = repo_copy
    text = readme.read_text()
    doc = json.loads((results / "launch.json").read_text())
    assert doc["command"].startswith("python benchmarks/launch.py") and f"written by `{doc['command']}`" in text
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
    doc = json.loads(OLD_CHECKPOINT.read_text())
    doc["ratios"]["restore_cold_vs_dlrover_cold"] = 0.5
    doc["sizes"]["1024"]["ours"]["restore_cold_s"] = 0.25
    doc["series"] = [{"size_mib": m, "side": "dlrover-core", "stall_s": m / 1e4, "durable_s": m / 1e3,
                      "restore_cold_s": m / 2e3} for m in (64, 256)]
    doc["series"].append({"size_mib": 1024, "DLRover FCP": {"stall_s": 0.2}})  # a dict per side
    out = tables.render_checkpoint(doc)
    assert "| `restore_cold_vs_dlrover_cold` | 0.50 | — | — |" in out
    assert "| restore after a worker restart, cold (first load in a fresh process) | **0.250** |" in out
    assert "restore from storage" not in out
    assert "| 64 MiB | 0.006 / 0.064 / 0.032 | — |" in out
    assert "| 1 GiB | — | 0.200 / — / — |" in out
    panels, _ = tables.usable(tables.plot_checkpoint(doc))
    assert any(p.title == "restore after a worker restart, cold" for p in panels)


def test_old_checkpoint_shape_reads_its_restore_as_warm():
    doc = json.loads(OLD_CHECKPOINT.read_text())
    doc.pop("series", None)
    doc.pop("ratios_size_mib", None)
    for at in doc["sizes"].values():
        for key in ("figures", "disk_floor"):
            at.pop(key, None)
        for key in [k for k in at["ours"] if k.startswith("restore_cold")]:
            del at["ours"][key]
    out = tables.render_checkpoint(doc)
    warm = next(line for line in out.splitlines() if line.startswith("| restore, warm (same process) |"))
    cold = next(line for line in out.splitlines() if line.startswith("| restore after a worker restart, cold"))
    ours_restore = doc["sizes"][list(doc["sizes"])[-1]]["ours"]["restore_s"]
    assert f"**{tables.fixed(ours_restore, 3)}**" in warm
    assert cold.split("|")[2].strip() == "—"


def _fig(median, lo, hi, n=3):
    return {"median": median, "min": lo, "max": hi, "n": n}


def _new_shape_checkpoint() -> dict:
    """A trimmed ``checkpoint.json`` of the current shape (two quick runs' figures: 256 MiB with
    DLRover, 4 GiB where DLRover was killed)."""
    def size(ours, dl, torch, fastest, floor, dl_section, variant, dropped):
        figures = {}
        for side, figs in (("ours", ours), ("dlrover", dl), ("torch", torch), ("dcp_async_fastest", fastest),
                           ("floor", floor)):
            for metric, f in zip(("stall", "durable", "restore_cold", "restore_warm"), figs, strict=False):
                if f:
                    figures[f"{side}.{metric}"] = f
        return {"ours": {"stall_s": ours[0]["median"], "dropped_saves": 0, "saves_during_persist": dropped},
                "peers": {"memcpy_method": "numpy chunked x2 threads", "unavailable": {},
                          "dcp_async_save_fastest_config": {"variant": variant}},
                "dlrover": dl_section, "disk_floor": {"median": floor[1]["median"], "n": floor[1]["n"]},
                "figures": figures}

    floor256 = [_fig(0.0336, 0.0331, 0.0343), _fig(0.4327, 0.1448, 0.8706, 12)]
    floor4g = [_fig(0.234, 0.2199, 0.248, 2), _fig(4.2976, 1.5186, 9.6596, 12)]
    sizes = {
        "256": size([_fig(0.0261, 0.0258, 0.0364), _fig(0.6776, 0.38, 0.9145), _fig(0.0697, 0.0688, 0.1287),
                     _fig(0.0567, 0.0406, 0.0824)],
                    [_fig(0.0753, 0.0246, 0.1792), _fig(1.3181, 1.1952, 1.4031), _fig(0.1458, 0.1038, 0.1975),
                     _fig(0.1449, 0.1439, 0.1994)],
                    [_fig(0.2787, 0.2334, 0.2884), _fig(0.2787, 0.2334, 0.2884), _fig(0.1099, 0.0271, 0.2622),
                     _fig(0.0778, 0.0442, 0.0909)],
                    [_fig(0.0449, 0.0402, 0.0652), _fig(0.4392, 0.4137, 0.7252)], floor256 + [floor256[0]] * 2,
                    {"available": True, "dlrover": "0.6.1", "fsyncs_data": False, "dropped_saves": 55,
                     "memory_saves_during_persist": 57}, "process_async", 18),
        "4096": size([_fig(0.451, 0.4267, 0.4752, 2), _fig(10.0104, 7.6991, 12.3217, 2), _fig(1.2145, 0.4682, 1.9608, 2),
                      _fig(0.4568, 0.358, 0.5556, 2)], [],
                     [_fig(14.6618, 10.172, 19.1516, 2), _fig(14.6618, 10.172, 19.1516, 2), _fig(0.852, 0.7357, 0.9683, 2),
                      _fig(0.2776, 0.2755, 0.2796, 2)],
                     [_fig(0.9305, 0.8703, 0.9907, 2), _fig(10.1681, 10.1594, 10.1768, 2)], floor4g + [floor4g[0]] * 2,
                     {"available": False, "reason": "RuntimeError: dlrover-run failed (1); log kept in x.log; tail:\n"
                                                    "Signal 9 (SIGKILL)"}, "process_sync", 25),
    }
    series = []
    for mib, at in sizes.items():
        for side, label in (("ours", "dlrover-core"), ("dlrover", "DLRover FCP"), ("torch", "torch.save / torch.load"),
                            ("dcp_async_fastest", "DCP async_save (fastest staging)"), ("floor", "floor")):
            row = {"size_mib": int(mib), "side": label}
            for metric in ("stall", "durable", "restore_cold", "restore_warm"):
                f = at["figures"].get(f"{side}.{metric}")
                row[f"{metric}_s"] = f["median"] if f else None
                row[f"{metric}_range"] = [f["min"], f["max"]] if f else None
            series.append(row)
    goals = {"stall_vs_memcpy_floor": 1.1, "stall_vs_dlrover_fcp": 1.0, "durable_vs_disk_floor_same_run": 1.25,
             "dropped_saves": 0, "restore_cold_vs_dlrover_cold": 1.0, "restore_memory_vs_torch_load": 0.25}
    ratios = {"stall_vs_memcpy_floor": 1.9277, "stall_vs_dlrover_fcp": None, "stall_vs_dcp_async_save_fastest": 0.4847,
              "durable_vs_disk_floor_same_run": 2.3293, "step_slowdown_during_persist_all_cores": 2.8115,
              "dropped_saves": 0, "restore_cold_vs_dlrover_cold": None, "restore_memory_vs_torch_load": 1.4254,
              "restore_warm_vs_memcpy_floor": 1.9525, "restore_warm_vs_dlrover_warm": None}
    return {"command": "python benchmarks/checkpoint.py --sizes-mib 256,4096 --reps 2 --json benchmarks/results/checkpoint.json",
            "ratios_size_mib": 4096, "ratios": ratios, "goals": goals, "series": series, "sizes": sizes}


def test_checkpoint_new_shape_renders(tmp_path, capsys):
    path = tmp_path / "checkpoint.json"
    path.write_text(json.dumps(_new_shape_checkpoint()))
    assert tables.main(["--print", str(path)]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].startswith("| 4 GiB state | dlrover-core | DLRover 0.6.1 FCP | torch.save / load | DCP save | "
                               "DCP async_save (default) | DCP async_save (fastest staging) | floor |")
    assert ("| training stall of a save | **0.451** (0.427–0.475) | — [1] | 14.662 (10.172–19.152) | — | — | "
            "0.931 (0.870–0.991) | 0.234 (0.220–0.248) |") in out
    assert "| save → committed, fsynced | **10.010** (7.699–12.322) | — [1] |" in out
    assert ("| restore after a worker restart, cold (first load in a fresh process) | **1.215** (0.468–1.961) | — [1] | "
            "0.852 (0.736–0.968) | | | | 0.234 (0.220–0.248) |") in out
    assert "| restore, warm (same process) | **0.457** (0.358–0.556) |" in out
    assert "| memory saves lost while a persist runs | **0** of 25 | — [1] |" in out
    assert "[1] did not run: RuntimeError: dlrover-run failed (1); log kept in x.log" in out
    assert "`torch.load(mmap=True)` in a fresh interpreter" in out and "`process_sync`" in out
    assert "restore from storage" not in out
    # growth with the size, from the series
    assert "| 256 MiB | 0.026 / 0.678 / 0.070 | 0.075 / 1.318 / 0.146 | 0.279 / 0.279 / 0.110 |" in out
    assert "| 4 GiB | 0.451 / 10.010 / 1.215 | — | 14.662 / 14.662 / 0.852 |" in out
    # every ratio, with its goal and whether it was met; informational ones marked —
    assert "| ratio of medians (4 GiB) | value | goal | met |" in out
    assert "| `stall_vs_memcpy_floor` | **1.93** | ≤ 1.1 | **missed** |" in out
    assert "| `stall_vs_dlrover_fcp` | — | ≤ 1.0 | — |" in out
    assert "| `stall_vs_dcp_async_save_fastest` | 0.48 | — | — |" in out
    assert "| `dropped_saves` | 0 | 0 | met |" in out
    assert "| `restore_warm_vs_dlrover_warm` | — | — | — |" in out
    panels, _ = tables.usable(tables.plot_checkpoint(json.loads(path.read_text())))
    assert [p.title for p in panels] == ["training stall of a save", "save → committed, fsynced",
                                         "restore after a worker restart, cold"]
    assert panels[2].lines["dlrover-core"] == [(256.0, 0.0697), (4096.0, 1.2145)]
    assert "DLRover FCP" not in panels[0].lines  # one point: not a line


def test_save_overhead_region_before_and_after_its_results(repo_copy):
    readme, results = repo_copy
    (results / "save_overhead.json").unlink(missing_ok=True)
    assert tables.main(["--readme", str(readme), "--results", str(results)]) == 0
    assert "No results yet: `benchmarks/results/save_overhead.json` is written by" in readme.read_text()
    assert check(readme, results) == 0
    rows = [{"size": s, "params": p, "tensors": 30, "state_bytes": b, "kind": k, "n": 60,
             "stall_ms": {"median": 1.5, "min": 1.2, "max": 3.0}, "floor_ms": {"median": 0.5, "min": 0.4, "max": 0.9}}
            for s, p, b in (("1m", 1.2e6, 14e6), ("10m", 1.1e7, 130e6)) for k in ("memory", "persist")]
    (results / "save_overhead.json").write_text(json.dumps({
        "command": "python benchmarks/save_overhead.py --quick", "series": rows,
        "ratios": {"stall_vs_copy_floor_1m": 3.0}, "goals": {"stall_vs_copy_floor_1m": 1.5}}))
    assert check(readme, results) == 1
    assert tables.main(["--readme", str(readme), "--results", str(results)]) == 0
    text = readme.read_text()
    assert "| 1.2M | 13.4 MiB | 30 | memory only | 60 | 1.50 (1.20–3.00) | 0.50 (0.40–0.90) | 1.00 | 3.00 |" in text
    assert "| `stall_vs_copy_floor_1m` | **3.00** | ≤ 1.5 | **missed** |" in text
    assert "written by `python benchmarks/save_overhead.py --quick`" in text
    assert check(readme, results) == 0


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


def test_checkpoint_merge_adds_a_size_measured_by_another_run():
    """``benchmarks/checkpoint.py --merge-into``: the 4 GiB point of a separate run joins the
    earlier file; each size names the run that measured it; the headline ratios are the
    largest size's; the tables render from the merged file."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        spec = importlib.util.spec_from_file_location("bench_checkpoint", ROOT / "benchmarks" / "checkpoint.py")
        bench = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(bench)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    old = json.loads((RESULTS / "checkpoint.json").read_text())
    old_sizes = list(old["sizes"])
    new = json.loads(json.dumps(old))  # a run of the largest old size only, as if at 8 GiB
    big = old_sizes[-1]
    new["sizes"] = {"8192": new["sizes"][big]}
    new["sizes"]["8192"]["ratios"] = {**new["sizes"]["8192"]["ratios"], "stall_vs_dlrover_fcp": 0.123}
    new["series"] = [{**r, "size_mib": 8192} for r in new["series"] if str(r["size_mib"]) == big]
    new["command"], new["wall_s"], new["sizes_mib"] = "python benchmarks/checkpoint.py --sizes-mib 8192", 10.0, [8192]
    merged = bench.merge(old, new)
    assert list(merged["sizes"]) == [*old_sizes, "8192"]
    assert merged["ratios_size_mib"] == 8192 and merged["ratios"]["stall_vs_dlrover_fcp"] == 0.123
    assert merged["sizes"]["8192"]["run"]["command"] == new["command"]
    first = old["sizes"][old_sizes[0]].get("run") or old
    assert merged["sizes"][old_sizes[0]]["run"]["command"] == first["command"]
    assert [r["command"] for r in merged["runs"]][-1] == new["command"] and len(merged["runs"]) >= 2
    assert {r["size_mib"] for r in merged["series"]} == {*map(int, old_sizes), 8192}
    assert new["command"] in merged["command"]
    # measured again: the new entry replaces the old, the series rows too
    again = bench.merge(merged, {**new, "command": "rerun"})
    assert again["sizes"]["8192"]["run"]["command"] == "rerun"
    assert sum(1 for r in again["series"] if r["size_mib"] == 8192) == sum(1 for r in new["series"])
    assert "8192" in tables.render_checkpoint(merged) or "4 GiB" in tables.render_checkpoint(merged)


def test_recovery_sides_pool_the_kills_of_both_runs_and_keep_only_uninterrupted_ones():
    def kill(s, ok=True):
        return {"survivor_step_s": s, "survivor_step_uninterrupted": ok,
                "next_step_s": s * 10, "next_step_uninterrupted": ok}

    doc = {"results": {"a": {
        "mtbf": {
            "dlrover-core": {"wall_s": 60.04, "goodput": 0.8126, "step_dt_median_full_world_s": 0.1712,
                             "kills": [{}, {}, {}], "kill_samples": [kill(0.5), kill(0.9, ok=False), kill(0.3)]},
            "torchrun": {"wall_s": 50.0, "kills": [{}], "kill_samples": [{"next_step_s": 3.5, "next_step_uninterrupted": True}]},
        },
        "series": {"dlrover-core": {"kills": [{}, {}], "kill_samples": [kill(0.4), kill(0.7)]}},
    }}}
    out = tables.recovery_sides(doc)
    lines = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in out.splitlines()[2:]}
    # 0.5, 0.3, 0.4, 0.7 (0.9 came after the next kill): median 0.45, 4 samples
    assert lines["kill → a survivor's next step"] == ["0.45 (0.30–0.70), n=4", "—"]
    assert lines["kill → the replacement's first step"] == ["4.50 (3.00–7.00), n=4", "3.50 (n=1)"]
    assert lines["kills (run with random failures + the series)"] == ["5", "1"]
    assert lines["time to finish, random failures"] == ["60.0", "50.0"]
    assert lines["goodput (same definition on every side)"] == ["0.813", "—"]
    assert lines["step time, median (world size 2)"] == ["0.171", "—"]
    assert "TorchFT" not in out.splitlines()[0]  # a side that did not run has no column
