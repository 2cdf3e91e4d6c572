"""README benchmark tables (and plots) generated from ``benchmarks/results/*.json``.

    python benchmarks/tables.py            # rewrite the generated regions of README.md
    python benchmarks/tables.py --check    # exit 1 when README.md is not what the JSON gives
    python benchmarks/tables.py --plots    # one PNG per series into docs/ (needs matplotlib)
    make bench-tables                      # the first, then the third

README.md holds one region per table, between ``<!-- bench:NAME -->`` and
``<!-- /bench:NAME -->``; this script owns everything between the two markers (edit the
JSON or a renderer here, never the table) and leaves the prose around them alone. Each
region ends with the result file and the command that wrote it (the file's ``command``
key; "command not recorded" when the file has none).

One renderer per result file, registered in ``REGISTRY`` (NAME -> file, renderer); a
renderer reads keys with ``get()`` and prints "—" for a missing one, so result files may
gain or lose keys. ``PLOTS`` does the same for the plots; a plot's data is extracted
without matplotlib (the README links a plot when its data has a series of two or more
points), matplotlib is imported only to draw.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import math
import re
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from decimal import ROUND_HALF_UP, Decimal, InvalidOperation
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
DASH = "—"


# ----- formatting ---------------------------------------------------------------------------------


def get(doc: Any, *path: Any, default: Any = None) -> Any:
    """``doc[p0][p1]...``, or ``default`` where any step is missing (or not a container)."""
    for key in path:
        if isinstance(doc, dict) and key in doc:
            doc = doc[key]
        elif isinstance(doc, list) and isinstance(key, int) and -len(doc) <= key < len(doc):
            doc = doc[key]
        else:
            return default
    return doc


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def fixed(x: Any, places: int) -> str:
    """``x`` with ``places`` decimals, rounded half up on the number as the JSON writes it
    (2.745 -> 2.75, as a person rounds it; a float's binary value may lie just below)."""
    if not _is_num(x):
        return DASH
    try:
        d = Decimal(repr(x))
    except InvalidOperation:
        return DASH
    out = str(d.quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP))
    return "0" if places == 0 and out == "-0" else out


def ratio2(x: Any) -> str:
    """A ratio: 2 decimals, or 2 significant digits below 0.1 (0.053, 0.099); ints as they are."""
    if isinstance(x, int) and not isinstance(x, bool):
        return str(x)
    if not _is_num(x):
        return DASH
    if x == 0 or abs(x) >= 0.1:
        return fixed(x, 2)
    return fixed(x, -Decimal(repr(x)).adjusted() + 1)


def plain(x: Any) -> str:
    """A number as the JSON file writes it (0.00729, 15.544, 0)."""
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, (int, float)):
        return repr(x) if math.isfinite(x) else DASH
    return DASH if x is None else str(x)


def short(x: Any) -> str:
    """0.5 -> "0.5", 5.0 -> "5", 10000 -> "10,000"."""
    if not _is_num(x):
        return DASH
    if float(x).is_integer():
        return f"{int(x):,}"
    return f"{x:g}"


def md_table(header: list[str], rows: list[list[str]]) -> str:
    def line(cells: list[str]) -> str:
        return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"

    return "\n".join([line(header), "|" + "|".join("---" for _ in header) + "|", *(line(r) for r in rows)])


def size_label(mib: Any) -> str:
    """1024 -> "1 GiB", 256 -> "256 MiB"."""
    try:
        n = float(mib)
    except (TypeError, ValueError):
        return str(mib)
    if n >= 1024 and (n / 1024).is_integer():
        return f"{int(n // 1024)} GiB"
    return f"{short(n)} MiB"


# ----- renderers: one per result file -------------------------------------------------------------


@dataclass(frozen=True)
class Renderer:
    file: str  # in the results directory
    render: Callable[[dict], str]  # the JSON -> Markdown (tables, notes); no provenance


#: NAME (the README marker) -> its result file and renderer
REGISTRY: dict[str, Renderer] = {}


def renderer(name: str, file: str) -> Callable[[Callable[[dict], str]], Callable[[dict], str]]:
    def register(fn: Callable[[dict], str]) -> Callable[[dict], str]:
        REGISTRY[name] = Renderer(file, fn)
        return fn

    return register


LAUNCH_PHASES = {
    "to_first_line": "the script's first line",
    "to_first_all_reduce": "its first all-reduce (after `import torch`, `init_process_group`)",
    "to_exit": "the launcher's exit (an empty script)",
}


@renderer("launch", "launch.json")
def render_launch(doc: dict) -> str:
    def cell(m: Any) -> str:
        if not isinstance(m, dict) or not _is_num(m.get("median_s")):
            return DASH
        spread = f" ({fixed(m['min_s'], 2)}–{fixed(m['max_s'], 2)})" if _is_num(m.get("min_s")) and _is_num(m.get("max_s")) else ""
        return f"{fixed(m['median_s'], 2)} s{spread}"

    phases = [k for k in LAUNCH_PHASES if k in doc]
    phases += [k for k, v in doc.items() if k not in LAUNCH_PHASES and isinstance(v, dict)
               and ("torchrun" in v or "dlrover_run" in v)]
    rows = []
    for key in phases:
        t, d = get(doc, key, "torchrun", "median_s"), get(doc, key, "dlrover_run", "median_s")
        ratio = fixed(d / t, 2) if _is_num(t) and _is_num(d) and t else DASH
        rows.append([LAUNCH_PHASES.get(key, f"`{key}`"), cell(get(doc, key, "torchrun")),
                     cell(get(doc, key, "dlrover_run")), ratio])
    return md_table(["from the command to", "torchrun `--standalone`", "`dlrover run`", "ratio"], rows)


#: the order of the recovery goals in the table; goals not named here follow in the file's order
RECOVERY_ORDER = (
    "kill_to_survivor_step_s", "kill_to_survivor_step_vs_torchrun", "kill_to_full_world_vs_torchrun",
    "kill_to_next_step_vs_torchrun", "goodput_vs_torchrun_mtbf180", "goodput_vs_torchft", "recomputed_steps",
    "final_val_loss_vs_uninterrupted", "rerendezvous_2_1_2_s", "kill_to_state_restored_s",
    "goodput_gap_to_young_daly_pts", "hang_detect_vs_torchrun",
)


@renderer("recovery", "recovery-quick.json")
def render_recovery(doc: dict) -> str:
    goals = get(doc, "goals", default={}) or {}
    keys = [k for k in RECOVERY_ORDER if k in goals] + [k for k in goals if k not in RECOVERY_ORDER]
    rows = []
    for key in keys:
        met = get(doc, "met", key)
        rows.append([f"`{key}`", plain(get(doc, "ratios", key)), str(goals[key]),
                     DASH if met is None else ("yes" if met else "no")])
    return md_table(["ratio", "result", "goal", "met"], rows)


def _goals_in_source(path: Path) -> dict:
    """A module-level ``GOALS = {...}`` literal of a benchmark script, read without importing it."""
    try:
        tree = ast.parse(path.read_text())
    except (OSError, SyntaxError):
        return {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "GOALS" for t in node.targets):
            try:
                return ast.literal_eval(node.value)
            except ValueError:
                return {}
    return {}


@renderer("master_scale", "master_scale.json")
def render_master_scale(doc: dict) -> str:
    # key -> (agents, goal); the file does not record its goals (yet): master_scale.py's GOALS
    goals = get(doc, "goals") or _goals_in_source(HERE / "master_scale.py")
    per = get(doc, "per_agents")
    if isinstance(per, dict) and per:
        runs = [per[k] for k in sorted(per, key=lambda k: float(k) if str(k).replace(".", "", 1).isdigit() else math.inf)]
    else:
        runs = [doc]

    def with_goal(key: str, row: dict, text: str) -> str:
        spec = goals.get(key) if isinstance(goals, dict) else None
        if not isinstance(spec, (list, tuple)) or len(spec) != 2 or text == DASH:
            return text
        n, goal = spec
        if row.get("agents") == n and _is_num(row.get(key)) and row[key] > goal:
            return f"{text} (goal ≤ {short(goal)}: missed)"
        return text

    rows = []
    for r in runs:
        agreement = DASH
        if _is_num(r.get("restore_agreement_s")):
            agreement = f"{fixed(r['restore_agreement_s'], 2)} s"
            per_rank = r.get("restore_requests_per_rank")
            if _is_num(per_rank):
                agreement += f", {short(per_rank)} request{'' if per_rank == 1 else 's'} per rank"
        interval = r.get("heartbeat_interval_s")
        rows.append([
            short(r.get("agents")),
            f"{short(interval)} s" if _is_num(interval) else DASH,
            with_goal("rendezvous_s", r, fixed(r.get("rendezvous_s"), 2)),
            with_goal("heartbeat_p50_ms", r, fixed(r.get("heartbeat_p50_ms"), 1)),
            with_goal("heartbeat_p99_ms", r, fixed(r.get("heartbeat_p99_ms"), 0)),
            with_goal("relaunch_decision_ms", r, fixed(r.get("relaunch_decision_ms"), 0)),
            agreement,
        ])
    table = md_table(["agents", "heartbeat", "rendezvous s", "heartbeat p50 ms", "heartbeat p99 ms",
                      "relaunch decision ms (median)", "restore agreement"], rows)
    if not get(doc, "goals") and goals:
        table += "\n\nGoals: `GOALS` in `benchmarks/master_scale.py` (the result file does not record them)."
    return table


def _checkpoint_size(doc: dict) -> tuple[str | None, dict]:
    """The size the headline table shows: the last one measured (the top-level ratios are its)."""
    sizes = get(doc, "sizes")
    if not isinstance(sizes, dict) or not sizes:
        return None, {}
    key = list(sizes)[-1]
    return key, sizes[key] if isinstance(sizes[key], dict) else {}


def _checkpoint_series(doc: dict) -> list[dict]:
    """``series`` as flat rows {size_mib, side, <metric>_s...}: entries either carry a ``side``
    or hold one dict per side ({"size_mib": 256, "dlrover-core": {"stall_s": ...}, ...})."""
    out = []
    for entry in get(doc, "series", default=[]) or []:
        if not isinstance(entry, dict):
            continue
        size = entry.get("size_mib")
        if "side" in entry:
            out.append(dict(entry))
            continue
        for side, values in entry.items():
            if isinstance(values, dict):
                out.append({"size_mib": size, "side": side, **values})
    return out


@renderer("checkpoint", "checkpoint.json")
def render_checkpoint(doc: dict) -> str:
    size, at = _checkpoint_size(doc)
    ours, peers, dl = at.get("ours") or {}, at.get("peers") or {}, at.get("dlrover") or {}
    dl_on = dl.get("available", bool(dl))

    def s(x: Any, note: str = "", bold: bool = False) -> str:
        if not _is_num(x):
            return DASH
        v = fixed(x, 3)
        return (f"**{v}**" if bold else v) + (f" ({note})" if note else "")

    def d(key: str, note: str = "") -> str:
        return s(dl.get(key), note) if dl_on else DASH

    rows = [
        ["training stall of a save", s(ours.get("stall_s"), "memory", True), d("save_memory_block_s", "memory"),
         s(peers.get("save_s"), "+fsync"), s(peers.get("dcp_save_s")), s(peers.get("dcp_async_save_block_s"), "blocking"),
         s(peers.get("memcpy_s"), "copy")],
        ["save → committed, fsynced", s(ours.get("durable_s"), bold=True),
         d("commit_s", "data *not* fsynced" if dl.get("fsyncs_data") is False else ""), DASH, DASH,
         s(peers.get("dcp_async_save_total_s")), s(ours.get("write_fsync_s"), "write+fsync")],
        ["restore into a live model after a worker restart", s(ours.get("restore_s"), "memory", True),
         d("restore_memory_s", "memory"), s(peers.get("load_s"), "torch.load"), "", "", s(peers.get("memcpy_s"), "copy")],
    ]
    if any(_is_num(side.get("restore_cold_s")) for side in (ours, peers, dl)):
        rows.append(["restore from storage, cold", s(ours.get("restore_cold_s"), bold=True), d("restore_cold_s"),
                     s(peers.get("restore_cold_s")), "", "", ""])

    def lost(dropped: Any, of: Any, bold: bool = False) -> str:
        if not _is_num(dropped):
            return DASH
        v = f"**{dropped}**" if bold else str(dropped)
        return f"{v} of {of}" if _is_num(of) else v

    rows.append(["memory saves lost while a persist runs", lost(ours.get("dropped_saves"), ours.get("saves_during_persist"), True),
                 lost(dl.get("dropped_saves"), dl.get("memory_saves_during_persist")) if dl_on else DASH, "", "", "", ""])
    parts = [md_table(["", "dlrover-core", f"DLRover {dl.get('dlrover', '')} FCP".replace("  ", " "), "torch.save",
                       "DCP save", "DCP async_save", "floor"], rows)]

    ratios, goals = get(doc, "ratios", default={}) or {}, get(doc, "goals", default={}) or {}
    if ratios or goals:
        def ratio_row(key: str) -> list[str]:
            v, goal = ratios.get(key), goals.get(key)
            missed = _is_num(v) and _is_num(goal) and v > goal
            text = ratio2(v)
            if goal is None:
                goal_text = DASH
            elif isinstance(goal, int) and not isinstance(goal, bool):
                goal_text = str(goal)  # a count: exactly this many
            else:
                goal_text = f"≤ {plain(goal)}"
            return [key, f"**{text}**" if missed else text, goal_text + (" (missed)" if missed else "")]

        keys = list(ratios) + [k for k in goals if k not in ratios]
        left = [ratio_row(k) for k in keys if k.startswith("stall_")]
        right = [ratio_row(k) for k in keys if not k.startswith("stall_")]
        label = f"ratio ({size_label(size)})" if size else "ratio"
        rows = []
        for i in range(max(len(left), len(right))):
            a = left[i] if i < len(left) else ["", "", ""]
            b = right[i] if i < len(right) else ["", "", ""]
            rows.append(a + [""] + b)
        parts.append(md_table([label, "value", "goal", "", label, "value", "goal"], rows))

    series = _checkpoint_series(doc)
    if series:
        metrics = [m for m in ("stall_s", "durable_s", "restore_s", "restore_cold_s") if any(m in r for r in series)]
        metrics += sorted({k for r in series for k in r if k.endswith("_s") and k not in metrics})
        rows = [[size_label(r.get("size_mib")), str(r.get("side", DASH))] + [s(r.get(m)) for m in metrics]
                for r in sorted(series, key=lambda r: (r.get("size_mib") if _is_num(r.get("size_mib")) else math.inf))]
        parts.append(md_table(["state", "side"] + [m.removesuffix("_s").replace("_", " ") + " s" for m in metrics], rows))
    return "\n\n".join(parts)


OPTIM_TASKS = {"charlm": "char LM (1M-param GPT)", "digits": "digits (MLP)"}


@renderer("optim", "optim.json")
def render_optim(doc: dict) -> str:
    def lr(x: Any) -> str:
        return f"{x:.3g}" if _is_num(x) else DASH

    def best(t: dict, opt: str) -> str:
        vals = [r.get(f"{opt}_best_val") for r in t.get("per_seed") or [] if isinstance(r, dict)]
        vals = [v for v in vals if _is_num(v)]
        return fixed(statistics.median(vals), 4) if vals else DASH

    def ci(x: Any) -> str:
        return "∞" if x is None else fixed(x, 2)

    rows = []
    for name, t in (get(doc, "tasks", default={}) or {}).items():
        label = OPTIM_TASKS.get(name, name)
        if not isinstance(t, dict):
            continue
        if "skipped" in t:
            rows.append([label, f"skipped: {t['skipped']}", "", "", ""])
            continue
        sr = t.get("steps_ratio") or {}
        lo, hi = get(sr, "ci95", 0), get(sr, "ci95", 1)
        steps = fixed(sr.get("median"), 2) + (f" [{ci(lo)}, {ci(hi)}]" if isinstance(sr.get("ci95"), list) else "")
        rows.append([label, f"{lr(get(t, 'chosen_lr', 'adamw'))} / {best(t, 'adamw')}",
                     f"{lr(get(t, 'chosen_lr', 'agd'))} / {best(t, 'agd')}", steps, fixed(t.get("step_time_ratio"), 2)])
    return md_table(["task", "AdamW lr / best val", "AGD lr / best val", "AGD/AdamW steps to AdamW's best [95% CI]",
                     "AGD/AdamW time per step"], rows)


def renderer_for(path: Path) -> Renderer | None:
    """The renderer of a result file: by file name, else by the name before a ``-`` (optim-quick)."""
    for r in REGISTRY.values():
        if r.file == path.name:
            return r
    return REGISTRY.get(path.stem.split("-")[0])


def render_file(path: Path) -> str | None:
    """The Markdown for any result file that has a renderer (None when it has none)."""
    r = renderer_for(path)
    return None if r is None else r.render(json.loads(path.read_text()))


# ----- plots: their data without matplotlib, drawn with it ---------------------------------------


@dataclass
class Panel:
    title: str
    xlabel: str
    ylabel: str
    lines: dict[str, list[tuple[float, float]]]
    logx: bool = True
    logy: bool = True
    marks: list[tuple[float, float, str]] | None = None  # goals: (x, y, label)


@dataclass(frozen=True)
class Plot:
    png: str  # in docs/
    file: str  # its result file
    region: str | None  # the README region that links it (None: no table)
    title: str
    extract: Callable[[dict], list[Panel]]


PLOTS: dict[str, Plot] = {}


def plot(name: str, png: str, file: str, region: str | None, title: str) -> Callable:
    def register(fn: Callable[[dict], list[Panel]]) -> Callable[[dict], list[Panel]]:
        PLOTS[name] = Plot(png, file, region, title, fn)
        return fn

    return register


def usable(panels: list[Panel]) -> tuple[list[Panel], list[str]]:
    """The panels with their lines of two or more points; and what was left out, and why."""
    kept, skipped = [], []
    for p in panels:
        lines = {}
        for label, pts in p.lines.items():
            pts = sorted((x, y) for x, y in pts if _is_num(x) and _is_num(y) and (not p.logx or x > 0) and (not p.logy or y > 0))
            if len(pts) >= 2:
                lines[label] = pts
            else:
                skipped.append(f"{p.title} / {label}: {len(pts)} point{'' if len(pts) == 1 else 's'}")
        if lines:
            kept.append(Panel(p.title, p.xlabel, p.ylabel, lines, p.logx, p.logy, p.marks))
    return kept, skipped


#: (side label, metric, section of sizes[<MiB>], key): the checkpoint series read from ``sizes``
CHECKPOINT_SIDES = (
    ("dlrover-core", "stall_s", "ours", "stall_s"), ("dlrover-core", "durable_s", "ours", "durable_s"),
    ("dlrover-core", "restore_s", "ours", "restore_s"), ("dlrover-core", "restore_cold_s", "ours", "restore_cold_s"),
    ("DLRover FCP", "stall_s", "dlrover", "save_memory_block_s"),
    ("DLRover FCP", "durable_s", "dlrover", "commit_s"),
    ("DLRover FCP", "restore_s", "dlrover", "restore_memory_s"),
    ("DLRover FCP", "restore_cold_s", "dlrover", "restore_cold_s"),
    ("torch.save / load", "stall_s", "peers", "save_s"), ("torch.save / load", "restore_s", "peers", "load_s"),
    ("torch.save / load", "restore_cold_s", "peers", "restore_cold_s"),
    ("DCP save", "stall_s", "peers", "dcp_save_s"),
    ("DCP async_save", "stall_s", "peers", "dcp_async_save_block_s"),
    ("DCP async_save", "durable_s", "peers", "dcp_async_save_total_s"),
    ("floor", "stall_s", "peers", "memcpy_s"), ("floor", "durable_s", "ours", "write_fsync_s"),
    ("floor", "restore_s", "peers", "memcpy_s"),
)
#: what a ``series`` entry may call a side -> the plot's name for it (one line per side)
SIDE_ALIASES = {
    "ours": "dlrover-core", "dlrover_core": "dlrover-core", "dlrover": "DLRover FCP", "dlrover_fcp": "DLRover FCP",
    "dlrover fcp": "DLRover FCP", "torch_save": "torch.save / load", "torch.save": "torch.save / load",
    "dcp": "DCP save", "dcp_save": "DCP save", "dcp_async_save": "DCP async_save", "dcp async_save": "DCP async_save",
}
CHECKPOINT_METRICS = {
    "stall_s": "training stall of a save", "durable_s": "save → committed, fsynced",
    "restore_s": "restore after a worker restart", "restore_cold_s": "restore from storage, cold",
}


@plot("checkpoint", "bench-checkpoint-sizes.png", "checkpoint.json", "checkpoint", "Flash Checkpoint vs state size")
def plot_checkpoint(doc: dict) -> list[Panel]:
    data: dict[str, dict[str, dict[float, float]]] = {m: {} for m in CHECKPOINT_METRICS}
    for mib, at in (get(doc, "sizes", default={}) or {}).items():
        try:
            x = float(mib)
        except ValueError:
            continue
        for side, metric, section, key in CHECKPOINT_SIDES:
            v = get(at, section, key)
            if _is_num(v) and (section != "dlrover" or get(at, "dlrover", "available", default=True)):
                data[metric].setdefault(side, {})[x] = v
    for r in _checkpoint_series(doc):  # the series, where present, has the last word
        for metric, value in r.items():
            if metric.endswith("_s") and _is_num(value) and _is_num(r.get("size_mib")):
                side = str(r.get("side"))
                side = SIDE_ALIASES.get(side.lower(), side)
                data.setdefault(metric, {}).setdefault(side, {})[float(r["size_mib"])] = value
    return [Panel(CHECKPOINT_METRICS.get(m, m), "state size (MiB)", "seconds",
                  {side: list(pts.items()) for side, pts in sides.items()})
            for m, sides in data.items() if sides]


@plot("master_scale", "bench-master-scale.png", "master_scale.json", "master_scale", "job master vs agents")
def plot_master_scale(doc: dict) -> list[Panel]:
    per = get(doc, "per_agents", default={}) or {}
    rows = [r for r in per.values() if isinstance(r, dict) and _is_num(r.get("agents"))]
    goals = get(doc, "goals") or _goals_in_source(HERE / "master_scale.py")

    def marks(key: str) -> list[tuple[float, float, str]]:
        spec = goals.get(key) if isinstance(goals, dict) else None
        if isinstance(spec, (list, tuple)) and len(spec) == 2 and all(_is_num(v) for v in spec):
            return [(spec[0], spec[1], f"goal at {short(spec[0])} agents")]
        return []

    def series(key: str) -> list[tuple[float, float]]:
        return [(r["agents"], r.get(key)) for r in rows]

    return [
        Panel("rendezvous (all agents ready)", "agents", "seconds", {"rendezvous": series("rendezvous_s")},
              marks=marks("rendezvous_s")),
        Panel("heartbeat latency", "agents", "ms", {"p99": series("heartbeat_p99_ms"), "p50": series("heartbeat_p50_ms")},
              marks=marks("heartbeat_p99_ms")),
    ]


@plot("optim", "bench-optim.png", "optim.json", "optim", "validation loss, median over seeds")
def plot_optim(doc: dict) -> list[Panel]:
    panels = []
    for name, t in (get(doc, "tasks", default={}) or {}).items():
        if not isinstance(t, dict) or "skipped" in t:
            continue
        lines = {}
        for opt, label in (("adamw", "AdamW"), ("agd", "AGD")):
            by_step: dict[float, list[float]] = {}
            for seed in t.get("per_seed") or []:
                for pt in get(seed, "evals", opt, default=[]) or []:
                    if isinstance(pt, (list, tuple)) and len(pt) == 2 and _is_num(pt[0]) and _is_num(pt[1]):
                        by_step.setdefault(pt[0], []).append(pt[1])
            lines[label] = [(step, statistics.median(v)) for step, v in by_step.items()]
        lrs = [f"{label} {get(t, 'chosen_lr', opt):.3g}" for opt, label in (("adamw", "AdamW"), ("agd", "AGD"))
               if _is_num(get(t, "chosen_lr", opt))]
        title = OPTIM_TASKS.get(name, name) + (f"\nlr: {', '.join(lrs)}" if lrs else "")
        panels.append(Panel(title, "step", "validation loss", lines, logx=False, logy=True))
    return panels


SAVE_KINDS = {"memory": "memory-only save", "persist": "save due for persistence"}


def _median_of(v: Any) -> Any:
    """A figure, or the median of a ``{"median": ..., "min": ..., "max": ...}`` summary."""
    return v.get("median") if isinstance(v, dict) else v


@plot("save_overhead", "bench-save-overhead.png", "save_overhead.json", None, "per-save training stall vs parameters")
def plot_save_overhead(doc: dict) -> list[Panel]:
    # series: [{"params": 1.2e6, "kind": "memory", "stall_ms": {"median": ...}, "floor_ms": {...}, ...}, ...]
    rows = [r for r in get(doc, "series", default=[]) or [] if isinstance(r, dict) and _is_num(r.get("params"))]
    stall: dict[str, list[tuple[float, float]]] = {}
    floor: dict[float, list[float]] = {}
    for r in rows:
        kind = str(r.get("kind", "save"))
        for key, scale in (("stall_ms", 1.0), ("stall_s", 1e3)):
            v = _median_of(r.get(key))
            if _is_num(v):
                stall.setdefault(f"stall, {SAVE_KINDS.get(kind, kind)}", []).append((r["params"], v * scale))
        for key, scale in (("floor_ms", 1.0), ("floor_s", 1e3)):
            v = _median_of(r.get(key))
            if _is_num(v):
                floor.setdefault(r["params"], []).append(v * scale)
    lines = dict(stall)
    if floor:  # the same copy, measured beside each kind: one line, their median
        lines["floor: copy_ of the same tensors"] = [(x, statistics.median(v)) for x, v in floor.items()]
    return [Panel("Checkpointer.save, median stall", "parameters", "ms", lines)] if lines else []


def plot_panels(name: str, results: Path) -> tuple[list[Panel], list[str]]:
    spec = PLOTS[name]
    path = results / spec.file
    if not path.exists():
        return [], [f"{spec.file} not found"]
    panels, skipped = usable(spec.extract(json.loads(path.read_text())))
    if not panels:
        skipped.append("no series with two or more points")
    return panels, skipped


def draw(panels: list[Panel], title: str, out: Path) -> None:
    import matplotlib  # only here: the tables must not need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    def label_g(v: float, _pos: int) -> str:
        return f"{v:g}"

    labels = list(dict.fromkeys(label for p in panels for label in p.lines))
    colors = {label: f"C{i % 10}" for i, label in enumerate(labels)}  # a side keeps its colour in every panel
    fig, axes = plt.subplots(1, len(panels), figsize=(max(6.0, 4.2 * len(panels)), 3.6), squeeze=False)
    for ax, p in zip(axes[0], panels, strict=True):
        xs = sorted({x for pts in p.lines.values() for x, _ in pts})
        for label, pts in p.lines.items():
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o" if len(pts) <= 12 else None,
                    linestyle="--" if label.startswith("floor") else "-", color=colors[label], label=label)
        for x, y, label in p.marks or []:
            ax.plot([x], [y], marker="x", color="red", linestyle="none", markersize=9, label=label)
        if p.logx:
            ax.set_xscale("log")
            if len(xs) <= 8:  # the measured sizes as the ticks
                ax.set_xticks(xs)
            ax.xaxis.set_major_formatter(FuncFormatter(label_g))
            ax.xaxis.set_minor_formatter(NullFormatter())
        if p.logy:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FuncFormatter(label_g))
            ax.yaxis.set_minor_locator(LogLocator(base=10, subs=(2.0, 5.0)))
            ax.yaxis.set_minor_formatter(FuncFormatter(label_g))
        ax.set_title(p.title, fontsize=10)
        ax.set_xlabel(p.xlabel)
        ax.set_ylabel(p.ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100, metadata={"Software": None})  # no version stamp: same data, same file
    plt.close(fig)


def write_plots(results: Path, docs: Path) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plots need matplotlib: pip install 'dlrover-core[bench]' (or pip install matplotlib)", file=sys.stderr)
        return 2
    for name, spec in PLOTS.items():
        panels, skipped = plot_panels(name, results)
        for why in skipped:
            print(f"{spec.png}: skipped {why}")
        if panels:
            draw(panels, f"{spec.title} ({spec.file})", docs / spec.png)
            print(f"{spec.png}: written ({len(panels)} panel{'' if len(panels) == 1 else 's'})")
    return 0


# ----- README regions ------------------------------------------------------------------------------


def _shown(path: Path, readme: Path) -> str:
    try:
        return path.resolve().relative_to(readme.resolve().parent).as_posix()
    except ValueError:
        return path.as_posix()


def region(name: str, results: Path, readme: Path) -> str:
    """What goes between the markers of ``name``: its table(s), plots, and where they come from."""
    spec = REGISTRY[name]
    path = results / spec.file
    doc = json.loads(path.read_text())
    command = doc.get("command") if isinstance(doc, dict) else None
    source = f"`{_shown(path, readme)}`, written by `{command}`" if command else f"`{_shown(path, readme)}` (command not recorded)"
    parts = [f"<!-- generated by benchmarks/tables.py from {_shown(path, readme)}: edit the JSON, not this table -->",
             spec.render(doc)]
    for pname, p in PLOTS.items():
        if p.region == name and p.file == spec.file and plot_panels(pname, results)[0]:
            parts.append(f"![{p.title}](docs/{p.png})")
    parts.append(f"Figures from {source}; table{' and plot' if len(parts) > 2 else ''} by `make bench-tables`.")
    return "\n\n".join(parts)


def _marker_re(name: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- bench:{re.escape(name)} -->\n)(.*?)(<!-- /bench:{re.escape(name)} -->)", re.S)


def regenerate(text: str, results: Path, readme: Path) -> tuple[str, list[str]]:
    """README text with every region regenerated; and the problems (a missing marker or file)."""
    problems = []
    for name, spec in REGISTRY.items():
        pattern = _marker_re(name)
        if len(pattern.findall(text)) != 1:
            problems.append(f"README: expected one <!-- bench:{name} --> ... <!-- /bench:{name} --> region")
            continue
        if not (results / spec.file).exists():
            problems.append(f"{results / spec.file}: not found (region {name!r} left as it is)")
            continue
        body = region(name, results, readme)
        text = pattern.sub(lambda m, body=body: f"{m.group(1)}\n{body}\n\n{m.group(3)}", text)
    return text, problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--readme", type=Path, default=ROOT / "README.md")
    p.add_argument("--results", type=Path, default=HERE / "results", help="the result JSON files")
    p.add_argument("--docs", type=Path, default=ROOT / "docs", help="where --plots writes the PNGs")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 when README is not what the JSON gives; write nothing")
    mode.add_argument("--plots", action="store_true", help="write one PNG per series into --docs (needs matplotlib)")
    mode.add_argument("--print", dest="show", metavar="FILE", type=Path, help="print the table(s) of one result file")
    a = p.parse_args(argv)
    if a.plots:
        return write_plots(a.results, a.docs)
    if a.show:
        out = render_file(a.show)
        if out is None:
            print(f"{a.show}: no renderer (known: {', '.join(r.file for r in REGISTRY.values())})", file=sys.stderr)
            return 2
        print(out)
        return 0
    old = a.readme.read_text()
    new, problems = regenerate(old, a.results, a.readme)
    for problem in problems:
        print(problem, file=sys.stderr)
    if a.check:
        if new != old:
            diff = difflib.unified_diff(old.splitlines(), new.splitlines(), str(a.readme), "from the JSON", lineterm="", n=1)
            print("\n".join(diff))
            print(f"{a.readme} is not up to date with {a.results}: run `make bench-tables`", file=sys.stderr)
            return 1
        return 1 if problems else 0
    if new != old:
        a.readme.write_text(new)
        print(f"{a.readme}: tables regenerated")
    else:
        print(f"{a.readme}: up to date")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
