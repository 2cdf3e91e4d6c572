"""README benchmark tables (and plots) generated from ``benchmarks/results/*.json``.

    python benchmarks/tables.py            # rewrite the generated regions of README.md
    python benchmarks/tables.py --check    # exit 1 when README.md is not what the JSON gives
    python benchmarks/tables.py --plots    # one PNG per series into docs/ (needs matplotlib)
    python benchmarks/tables.py --print FILE [--as NAME]   # the table(s) of one result file
    make bench-tables                      # the first, then the third

README.md holds one region per table, between ``<!-- bench:NAME -->`` and
``<!-- /bench:NAME -->``; this script owns everything between the two markers (edit the
JSON or a renderer here, never the table) and leaves the prose around them alone. Each
region ends with the result file and the command that wrote it (the file's ``command``
key; "command not recorded" when the file has none).

One renderer per result file, registered in ``REGISTRY`` (NAME -> file, renderer); a
renderer reads keys with ``get()`` and prints "—" for a missing one, so result files may
gain or lose keys. A renderer registered with ``pending=COMMAND`` is for a file that may not
be written yet: until it is, its region says so (and names the command), and ``--check`` passes.
The checkpoint renderer reads both the current ``checkpoint.json`` (``figures``, ``series``,
cold and warm restores) and the earlier one (``sizes`` only; its ``restore_s`` was warm). ``PLOTS`` does the same for the plots; a plot's data is extracted
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
    #: the command that writes ``file``; set for a file that may not exist yet: its region then says so
    pending: str | None = None


#: NAME (the README marker) -> its result file and renderer
REGISTRY: dict[str, Renderer] = {}


def renderer(name: str, file: str, pending: str | None = None) -> Callable[[Callable[[dict], str]], Callable[[dict], str]]:
    def register(fn: Callable[[dict], str]) -> Callable[[dict], str]:
        REGISTRY[name] = Renderer(file, fn, pending)
        return fn

    return register


def median_cell(m: Any) -> str:
    """A side's ``{median_s, min_s, max_s}`` (``_results.summary``) as "median s (min–max)"."""
    if not isinstance(m, dict) or not _is_num(m.get("median_s")):
        return DASH
    spread = f" ({fixed(m['min_s'], 2)}–{fixed(m['max_s'], 2)})" if _is_num(m.get("min_s")) and _is_num(m.get("max_s")) else ""
    return f"{fixed(m['median_s'], 2)} s{spread}"


LAUNCH_PHASES = {
    "to_first_line": "the script's first line",
    "to_first_all_reduce": "its first all-reduce (after `import torch`, `init_process_group`)",
    "to_first_step": "its first training step (forward, backward, all-reduce, an AdamW step)",
    "to_exit": "the launcher's exit (an empty script)",
}


@renderer("launch", "launch.json")
def render_launch(doc: dict) -> str:
    phases = [k for k in LAUNCH_PHASES if k in doc]
    phases += [k for k, v in doc.items() if k not in LAUNCH_PHASES and isinstance(v, dict)
               and ("torchrun" in v or "dlrover_run" in v)]
    rows = []
    for key in phases:
        t, d = get(doc, key, "torchrun", "median_s"), get(doc, key, "dlrover_run", "median_s")
        ratio = fixed(d / t, 2) if _is_num(t) and _is_num(d) and t else DASH
        rows.append([LAUNCH_PHASES.get(key, f"`{key}`"), median_cell(get(doc, key, "torchrun")),
                     median_cell(get(doc, key, "dlrover_run")), ratio])
    return md_table(["from the command to", "torchrun `--standalone`", "`dlrover run`", "ratio"], rows)


JOB_CPU_SIDES = {
    "torchrun": "torchrun, one `--nnodes` launcher per node",
    "dlrover_shared": "dlrover-core, the nodes' standbys forked from one shared process",
    "dlrover_per_node": "dlrover-core, a standby process per node (`DLROVER_SHARED_STANDBY=0`)",
}


@renderer("job_cpu", "job_cpu.json")
def render_job_cpu(doc: dict) -> str:
    base = get(doc, "cpu", "torchrun", "median_s")
    rows = []
    for side, label in JOB_CPU_SIDES.items():
        cpu = get(doc, "cpu", side, "median_s")
        ratio = fixed(cpu / base, 2) if _is_num(cpu) and _is_num(base) and base else DASH
        rows.append([label, median_cell(get(doc, "cpu", side)), ratio, median_cell(get(doc, "wall", side))])
    return md_table([f"a {plain(doc.get('nodes'))}-node job on one host, {plain(doc.get('steps'))} steps",
                     "CPU time, every process", "vs torchrun", "wall time"], rows)


#: the order of the recovery goals in the table; goals not named here follow in the file's order
RECOVERY_ORDER = (
    "kill_to_survivor_step_s", "kill_to_survivor_step_vs_torchrun", "kill_to_full_world_vs_torchrun",
    "kill_to_next_step_vs_torchrun", "goodput_vs_torchrun_mtbf180", "goodput_vs_torchft", "recomputed_steps",
    "final_val_loss_vs_uninterrupted", "rerendezvous_2_1_2_s", "kill_to_state_restored_s",
    "goodput_gap_to_young_daly_pts", "hang_detect_vs_torchrun",
)


@renderer("recovery", "recovery.json")
def render_recovery(doc: dict) -> str:
    goals = get(doc, "goals", default={}) or {}
    keys = [k for k in RECOVERY_ORDER if k in goals] + [k for k in goals if k not in RECOVERY_ORDER]
    rows = []
    for key in keys:
        met = get(doc, "met", key)
        rows.append([f"`{key}`", plain(get(doc, "ratios", key)), str(goals[key]),
                     DASH if met is None else ("yes" if met else "no")])
    out = md_table(["ratio", "result", "goal", "met"], rows)
    sides = recovery_sides(doc)
    if sides:
        out += "\n\n" + sides
    return out


#: the sides of experiment a, as the JSON names them
RECOVERY_SIDES = ("dlrover-core", "torchrun", "torchft")
#: per kill measure -> its row label (``kill_samples[i]["<measure>_s"]``)
RECOVERY_MEASURES = {
    "survivor_step": "kill → a survivor's next step",
    "next_step": "kill → the replacement's first step",
    "full_world": "kill → the full world again",
}


def _spread(values: list[float], places: int = 2) -> str:
    """``median (min–max), n=N`` of ``values``, or "—"."""
    values = [v for v in values if _is_num(v)]
    if not values:
        return DASH
    mid = fixed(statistics.median(values), places)
    if len(values) == 1:
        return f"{mid} (n=1)"
    return f"{mid} ({fixed(min(values), places)}–{fixed(max(values), places)}), n={len(values)}"


def recovery_sides(doc: dict) -> str:
    """Experiment a per side: each kill measure as median (min–max) over the kills of every
    run of a (``mtbf``, and ``series`` in a full run) whose measure came before the next kill
    (``<measure>_uninterrupted``, the benchmark's own filter), then the run of a with random
    failures (``mtbf``): time to finish, goodput, launch to first step, step time."""
    a = get(doc, "results", "a", default={}) or {}
    sides = [s for s in RECOVERY_SIDES if isinstance(get(a, "mtbf", s), dict) and get(a, "mtbf", s, "wall_s") is not None]
    if not sides:
        return ""

    def samples(side: str, measure: str) -> list[float]:
        out = []
        for run in ("mtbf", "series"):
            for k in get(a, run, side, "kill_samples", default=[]) or []:
                if isinstance(k, dict) and k.get(f"{measure}_uninterrupted"):
                    out.append(k.get(f"{measure}_s"))
        return out

    def run_value(key: str, places: int) -> Callable[[str], str]:
        return lambda side: fixed(get(a, "mtbf", side, key), places)

    rows = [[label, *(_spread(samples(s, m)) for s in sides)] for m, label in RECOVERY_MEASURES.items()]
    for label, fn in (
        ("kills (run with random failures + the series)", lambda s: str(sum(
            len(get(a, run, s, "kills", default=[]) or []) for run in ("mtbf", "series")))),
        ("time to finish, random failures", run_value("wall_s", 1)),
        ("goodput (same definition on every side)", run_value("goodput", 3)),
        ("launch → first step", run_value("launch_to_first_step_s", 1)),
        ("checkpoint stalls, total", run_value("checkpoint_stall_total_s", 1)),
        ("step time, median (every step)", run_value("step_dt_median_s", 3)),
        ("step time, median (world size 2)", run_value("step_dt_median_full_world_s", 3)),
        ("steps trained again (progress records)", lambda s: plain(get(a, "mtbf", s, "recomputed_steps_from_progress"))),
    ):
        rows.append([label, *(fn(s) for s in sides)])
    return md_table(["experiment a (seconds unless named)", *({"torchft": "TorchFT"}.get(s, s) for s in sides)], rows)


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


#: the checkpoint table's columns: (key in ``figures`` / ``series``, header)
CKPT_COLUMNS = (
    ("ours", "dlrover-core"), ("dlrover", "DLRover {v} FCP"), ("torch", "torch.save / load"), ("dcp_save", "DCP save"),
    ("dcp_async_default", "DCP async_save (default)"), ("dcp_async_fastest", "DCP async_save (fastest staging)"),
    ("floor", "floor"),
)
#: a ``series`` row's ``side`` (lower case) -> its column key
CKPT_SIDE_KEYS = {
    "dlrover-core": "ours", "ours": "ours", "dlrover_core": "ours",
    "dlrover fcp": "dlrover", "dlrover": "dlrover", "dlrover_fcp": "dlrover", "dlrover 0.6.1": "dlrover",
    "torch.save / load": "torch", "torch.save / torch.load": "torch", "torch.save": "torch", "torch_save": "torch",
    "torch": "torch", "dcp save": "dcp_save", "dcp": "dcp_save", "dcp_save": "dcp_save",
    "dcp async_save": "dcp_async_default", "dcp_async_save": "dcp_async_default",
    "dcp async_save (default)": "dcp_async_default", "dcp_async_default": "dcp_async_default",
    "dcp async_save (fastest staging)": "dcp_async_fastest", "dcp_async_fastest": "dcp_async_fastest",
    "floor": "floor",
}
#: the headline figures, in table order -> their label (``restore_cold``: the first load in a fresh process)
CKPT_METRICS = {
    "stall": "training stall of a save",
    "durable": "save → committed, fsynced",
    "restore_cold": "restore after a worker restart, cold (first load in a fresh process)",
    "restore_warm": "restore, warm (same process)",
}
#: (column, metric) -> (section of sizes[<MiB>], names tried in turn): a figure read from the side's own
#: ``<name>_samples`` / ``<name>_s`` where ``figures`` lacks it (result files before ``figures``);
#: a figure read under a name in ``CKPT_FALLBACK_NOTES`` is shown with that note
CKPT_FALLBACK = {
    ("ours", "stall"): ("ours", ("stall",)), ("ours", "durable"): ("ours", ("durable",)),
    ("ours", "restore_cold"): ("ours", ("restore_cold",)),
    ("dlrover", "stall"): ("dlrover", ("save_memory_block",)), ("dlrover", "durable"): ("dlrover", ("commit",)),
    ("dlrover", "restore_cold"): ("dlrover", ("restore_cold", "restore_memory")),  # its one restore: after a restart
    ("dlrover", "restore_warm"): ("dlrover", ("restore_warm",)),
    ("torch", "stall"): ("peers", ("save",)), ("torch", "durable"): ("peers", ("save",)),
    ("torch", "restore_cold"): ("peers", ("load_cold",)), ("torch", "restore_warm"): ("peers", ("load_mmap_into_model", "load_into_model")),
    ("dcp_save", "stall"): ("peers", ("dcp_save",)), ("dcp_save", "durable"): ("peers", ("dcp_save",)),
    ("dcp_async_default", "stall"): ("peers", ("dcp_async_save_block",)),
    ("dcp_async_default", "durable"): ("peers", ("dcp_async_save_total",)),
    ("dcp_async_fastest", "stall"): ("peers", ("dcp_async_save_fastest_block",)),
    ("dcp_async_fastest", "durable"): ("peers", ("dcp_async_save_fastest_total",)),
    ("floor", "stall"): ("peers", ("memcpy",)), ("floor", "durable"): ("ours", ("write_fsync",)),
    ("floor", "restore_cold"): ("peers", ("memcpy",)), ("floor", "restore_warm"): ("peers", ("memcpy",)),
}

CKPT_FALLBACK_NOTES = {"load_into_model": "(`torch.load`, no mmap)"}


def _stats(samples: Any, median: Any = None) -> dict | None:
    """``{"median", "min", "max", "n"}`` of samples (or of the one median a file has)."""
    xs = [x for x in samples if _is_num(x)] if isinstance(samples, list) else []
    if xs:
        return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}
    return {"median": median, "n": 1} if _is_num(median) else None


def _checkpoint_size(doc: dict) -> tuple[str | None, dict]:
    """The size the headline tables show: ``ratios_size_mib`` (the top-level ratios are its), else the last."""
    sizes = get(doc, "sizes")
    if not isinstance(sizes, dict) or not sizes:
        return None, {}
    key = str(doc.get("ratios_size_mib")) if str(doc.get("ratios_size_mib")) in sizes else list(sizes)[-1]
    return key, sizes[key] if isinstance(sizes[key], dict) else {}


def _checkpoint_figures(at: dict) -> dict[tuple[str, str], dict]:
    """(column, metric) -> stats at one size: ``figures`` ("ours.stall" -> stats), else the sides' samples.
    Old files' ``ours.restore_s`` was a warm restore (same process): it is read as one."""
    out: dict[tuple[str, str], dict] = {}
    for name, f in (get(at, "figures", default={}) or {}).items():
        key, _, metric = str(name).partition(".")
        if isinstance(f, dict) and _is_num(f.get("median")):
            out[(key, metric)] = f
    ours = at.get("ours") if isinstance(at.get("ours"), dict) else {}
    fallback = dict(CKPT_FALLBACK)
    if "restore_cold_s" not in ours and "restore_cold_samples" not in ours:
        fallback[("ours", "restore_warm")] = ("ours", ("restore_warm", "restore"))
    else:
        fallback[("ours", "restore_warm")] = ("ours", ("restore_warm",))
    pooled = _stats(get(at, "disk_floor", "samples"), get(at, "disk_floor", "median"))
    if pooled and ("floor", "durable") not in out:
        out[("floor", "durable")] = pooled
    for (key, metric), (section, names) in fallback.items():
        if (key, metric) in out:
            continue
        d = at.get(section) if isinstance(at.get(section), dict) else {}
        if not d.get("available", True):
            continue
        for name in names:
            f = _stats(d.get(f"{name}_samples"), d.get(f"{name}_s"))
            if f:
                if name in CKPT_FALLBACK_NOTES:
                    f["note"] = CKPT_FALLBACK_NOTES[name]
                out[(key, metric)] = f
                break
    return out


def _checkpoint_series(doc: dict) -> list[dict]:
    """One row per size and column {size_mib, side (a column key), <metric>_s medians}: ``series``
    where the file has one (rows carry a ``side``, or hold one dict per side), else read from ``sizes``."""
    out = []
    for entry in get(doc, "series", default=[]) or []:
        if not isinstance(entry, dict):
            continue
        pairs = [(entry.get("side"), entry)] if "side" in entry else [(k, v) for k, v in entry.items() if isinstance(v, dict)]
        for side, values in pairs:
            row = {k: v for k, v in values.items() if k.endswith("_s")}
            out.append({**row, "size_mib": entry.get("size_mib"), "side": CKPT_SIDE_KEYS.get(str(side).lower(), str(side))})
    if out:
        return out
    for mib, at in (get(doc, "sizes", default={}) or {}).items():
        if not isinstance(at, dict):
            continue
        figs = _checkpoint_figures(at)
        for key in dict.fromkeys(k for k, _ in figs):
            out.append({"size_mib": float(mib) if str(mib).replace(".", "", 1).isdigit() else mib, "side": key,
                        **{f"{m}_s": figs[(key, m)]["median"] for m in CKPT_METRICS if (key, m) in figs}})
    return out


def _first_line(text: Any, n: int = 120) -> str:
    lines = str(text or "").strip().splitlines()
    line = lines[0].strip().removesuffix("tail:").strip().removesuffix(";") if lines else "no reason recorded"
    line = line.replace("|", "\\|")
    return line if len(line) <= n else line[: n - 1] + "…"


def _ckpt_col_label(key: str, version: Any) -> str:
    label = dict(CKPT_COLUMNS).get(key, key)
    return label.format(v=version or "").replace("  ", " ") if "{v}" in label else label


@renderer("checkpoint", "checkpoint.json")
def render_checkpoint(doc: dict) -> str:
    size, at = _checkpoint_size(doc)
    ours, peers, dl = (at.get(k) if isinstance(at.get(k), dict) else {} for k in ("ours", "peers", "dlrover"))
    figs = _checkpoint_figures(at)
    # DLRover's version: from any size where it ran
    version = dl.get("dlrover") or next((get(v, "dlrover", "dlrover") for v in (get(doc, "sizes", default={}) or {}).values()
                                         if get(v, "dlrover", "dlrover")), "")

    # why a column has no figures: a side reported {"available": false, "reason": ...}
    why: dict[str, str] = {}
    for section, keys in (("ours", ("ours",)), ("dlrover", ("dlrover",)),
                          ("peers", ("torch", "dcp_save", "dcp_async_default", "dcp_async_fastest"))):
        d = at.get(section)
        if isinstance(d, dict) and d.get("available") is False:
            for k in keys:
                why[k] = d.get("reason", "")
    unavailable = peers.get("unavailable") if isinstance(peers.get("unavailable"), dict) else {}
    for name, reason in unavailable.items():
        for k in {"torch_save": ("torch",), "dcp": ("dcp_save", "dcp_async_default", "dcp_async_fastest"),
                  "floors": ("floor",)}.get(name, ()):
            why.setdefault(k, reason)
    notes: dict[str, int] = {}  # reason -> footnote number

    def mark(key: str) -> str:
        if key not in why:
            return DASH
        n = notes.setdefault(_first_line(why[key]), len(notes) + 1)
        return f"{DASH} [{n}]"

    def cell(key: str, metric: str, note: str = "", bold: bool = False) -> str:
        f = figs.get((key, metric))
        if f is None:
            return mark(key) if metric == "stall" or key in why else DASH
        v = fixed(f["median"], 3)
        text = f"**{v}**" if bold else v
        if _is_num(f.get("min")) and _is_num(f.get("max")) and f.get("n", 2) > 1:
            text += f" ({fixed(f['min'], 3)}–{fixed(f['max'], 3)})"
        note = " ".join(x for x in (note, f.get("note")) if x)
        return text + (f" {note}" if note else "")

    cols = [k for k, _ in CKPT_COLUMNS]
    na = ""  # a side that does not have this figure at all
    rows = [
        [CKPT_METRICS["stall"], cell("ours", "stall", "", True), cell("dlrover", "stall"), cell("torch", "stall"),
         cell("dcp_save", "stall"), cell("dcp_async_default", "stall"), cell("dcp_async_fastest", "stall"),
         cell("floor", "stall")],
        [CKPT_METRICS["durable"], cell("ours", "durable", "", True), cell("dlrover", "durable", "¹" if dl.get("fsyncs_data") is False else ""),
         cell("torch", "durable"), cell("dcp_save", "durable"), cell("dcp_async_default", "durable"),
         cell("dcp_async_fastest", "durable"), cell("floor", "durable")],
        [CKPT_METRICS["restore_cold"], cell("ours", "restore_cold", "", True), cell("dlrover", "restore_cold"),
         cell("torch", "restore_cold"), na, na, na, cell("floor", "restore_cold")],
        [CKPT_METRICS["restore_warm"], cell("ours", "restore_warm", "", True), cell("dlrover", "restore_warm"),
         cell("torch", "restore_warm"), na, na, na, cell("floor", "restore_warm")],
    ]

    def lost(d: dict, dropped_key: str, of_key: str, bold: bool = False) -> str:
        dropped, of = d.get(dropped_key), d.get(of_key)
        if not _is_num(dropped):
            return DASH
        v = f"**{dropped}**" if bold else str(dropped)
        return f"{v} of {of}" if _is_num(of) else v

    rows.append(["memory saves lost while a persist runs", lost(ours, "dropped_saves", "saves_during_persist", True),
                 lost(dl, "dropped_saves", "memory_saves_during_persist") if "dlrover" not in why else mark("dlrover"),
                 na, na, na, na, na])
    title = f"{size_label(size)} state" if size else ""
    parts = [md_table([title] + [_ckpt_col_label(k, version) for k in cols], rows)]

    # what each column's figure is
    fastest = get(peers, "dcp_async_save_fastest_config", "variant")
    method = peers.get("memcpy_method")
    floor_n = get(figs.get(("floor", "durable")), "n")
    lines = [
        "Seconds, median (min–max) of the samples; **bold**: ours. "
        "Stall: the training loop's wait for `save()` to return (dlrover-core and DLRover: a save to memory; "
        "torch.save and DCP save: to disk, with fsync; DCP async_save: until its call returns / staging is done). "
        "Cold restore: a worker SIGKILLed and restarted, its first load into a live model "
        "(dlrover-core and DLRover: from the agent's memory; torch: `torch.load(mmap=True)` in a fresh interpreter, "
        "page cache warm); warm: the same process loading again. Blank: not measured for that side.",
    ]
    if dl.get("fsyncs_data") is False:
        lines.append("¹ DLRover: disk save → tracker written; its data file is *not* fsynced.")
    if fastest:
        lines.append(f"DCP async_save, fastest staging: `{fastest}` (of the staging options tried); default: "
                     "`async_save()` as documented.")
    floor_text = "Floor: a copy of the same bytes into a pre-touched buffer"
    floor_text += f" ({method})" if method else ""
    floor_text += "; durable: a raw write + fsync of the same bytes"
    floor_text += f", {floor_n} samples next to every side" if _is_num(floor_n) and floor_n > 1 else ""
    lines.append(floor_text + ".")
    lines += [f"[{n}] did not run: {reason}" for reason, n in notes.items()]
    parts.append("\n".join(f"{line}  " if i < len(lines) - 1 else line for i, line in enumerate(lines)))

    # growth with the state size, from the series: stall / durable / cold restore medians per side
    series = [r for r in _checkpoint_series(doc) if _is_num(r.get("size_mib"))]
    if series:
        by_size: dict[float, dict[str, dict]] = {}
        for r in series:
            by_size.setdefault(r["size_mib"], {})[r["side"]] = r
        sides = [k for k in cols if any(k in v for v in by_size.values())]
        sides += sorted({s for v in by_size.values() for s in v if s not in sides})

        def trio(r: dict | None) -> str:
            vals = [fixed(get(r, f"{m}_s"), 3) for m in ("stall", "durable", "restore_cold")]
            return DASH if all(v == DASH for v in vals) else " / ".join(vals)

        rows = [[size_label(mib)] + [trio(by_size[mib].get(k)) for k in sides] for mib in sorted(by_size)]
        parts.append("Per state size, seconds, medians — stall / save → fsynced / cold restore:\n\n"
                     + md_table(["state"] + [_ckpt_col_label(k, version) for k in sides], rows))

    ratios, goals = get(doc, "ratios", default={}) or {}, get(doc, "goals", default={}) or {}
    if ratios or goals:
        rsize = doc.get("ratios_size_mib", size)

        def ratio_row(key: str) -> list[str]:
            v, goal = ratios.get(key), goals.get(key)
            if goal is None:
                return [f"`{key}`", ratio2(v), DASH, DASH]
            if isinstance(goal, int) and not isinstance(goal, bool):
                goal_text, ok = str(goal), v == goal  # a count: exactly this many
            else:
                goal_text, ok = f"≤ {plain(goal)}", _is_num(v) and _is_num(goal) and v <= goal
            met = DASH if not _is_num(v) else ("met" if ok else "**missed**")
            text = ratio2(v)
            return [f"`{key}`", text if ok or not _is_num(v) else f"**{text}**", goal_text, met]

        keys = list(ratios) + [k for k in goals if k not in ratios]
        label = f"ratio of medians ({size_label(rsize)})" if rsize else "ratio of medians"
        parts.append(md_table([label, "value", "goal", "met"], [ratio_row(k) for k in keys]))
    return "\n\n".join(parts)


SAVE_OVERHEAD_KINDS = {"memory": "memory only", "persist": "due for persistence"}


@renderer("save_overhead", "save_overhead.json",
          pending="python benchmarks/save_overhead.py --json benchmarks/results/save_overhead.json")
def render_save_overhead(doc: dict) -> str:
    """``series``: one row per model size and kind of save, ``stall_ms`` / ``floor_ms`` as
    ``{"median", "min", "max"}`` (or a number; ``*_s`` in seconds also read)."""

    def ms(r: dict, name: str) -> dict:
        for key, scale in ((f"{name}_ms", 1.0), (f"{name}_s", 1e3)):
            v = r.get(key)
            if isinstance(v, dict) and _is_num(v.get("median")):
                return {k: v[k] * scale for k in ("median", "min", "max") if _is_num(v.get(k))}
            if _is_num(v):
                return {"median": v * scale}
        return {}

    def cell(f: dict) -> str:
        if "median" not in f:
            return DASH
        spread = f" ({fixed(f['min'], 2)}–{fixed(f['max'], 2)})" if "min" in f and "max" in f else ""
        return fixed(f["median"], 2) + spread

    def params(x: Any) -> str:
        if not _is_num(x):
            return DASH
        return f"{x / 1e6:.3g}M" if x >= 1e5 else short(x)

    rows = []
    for r in get(doc, "series", default=[]) or []:
        if not isinstance(r, dict):
            continue
        stall, floor = ms(r, "stall"), ms(r, "floor")
        fixed_cost = r.get("fixed_cost_ms")
        if not _is_num(fixed_cost) and "median" in stall and "median" in floor:
            fixed_cost = stall["median"] - floor["median"]
        ratio = r.get("stall_vs_copy_floor")
        if not _is_num(ratio) and "median" in stall and floor.get("median"):
            ratio = stall["median"] / floor["median"]
        state = r.get("state_bytes")
        kind = str(r.get("kind", DASH))
        rows.append([params(r.get("params")) if "params" in r else str(r.get("size", DASH)),
                     (f"{state / 2**20:,.0f} MiB" if state >= 2**30 else f"{state / 2**20:.3g} MiB") if _is_num(state) else DASH, short(r.get("tensors")),
                     SAVE_OVERHEAD_KINDS.get(kind, kind), short(r.get("n")), cell(stall), cell(floor),
                     fixed(fixed_cost, 2), ratio2(ratio)])
    parts = [md_table(["parameters", "state", "tensors", "save", "n", "stall ms, median (min–max)",
                       "copy floor ms", "fixed cost ms (stall − floor)", "stall / floor"], rows)]
    ratios, goals = get(doc, "ratios", default={}) or {}, get(doc, "goals", default={}) or {}
    if goals:
        out = []
        for key in list(ratios) + [k for k in goals if k not in ratios]:
            v, goal = ratios.get(key), goals.get(key)
            if not _is_num(goal):
                out.append([f"`{key}`", ratio2(v), DASH, DASH])
                continue
            ok = _is_num(v) and v <= goal
            out.append([f"`{key}`", ratio2(v) if ok or not _is_num(v) else f"**{ratio2(v)}**", f"≤ {plain(goal)}",
                        DASH if not _is_num(v) else ("met" if ok else "**missed**")])
        parts.append(md_table(["ratio of medians", "value", "goal", "met"], out))
    parts.append("Fixed cost: what a save's stall costs beyond copying the same tensors (a `copy_` into "
                 "pre-touched tensors, interleaved with the saves); persist: a save due for persistence.")
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


def render_file(path: Path, name: str | None = None) -> str | None:
    """The Markdown for any result file that has a renderer, or with renderer ``name``
    (None when it has none)."""
    r = REGISTRY.get(name) if name else renderer_for(path)
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


#: the checkpoint plot's panels: metric -> title
CHECKPOINT_PLOT = {
    "stall": "training stall of a save",
    "durable": "save → committed, fsynced",
    "restore_cold": "restore after a worker restart, cold",
}


@plot("checkpoint", "bench-checkpoint-sizes.png", "checkpoint.json", "checkpoint", "Flash Checkpoint vs state size")
def plot_checkpoint(doc: dict) -> list[Panel]:
    labels = {k: label.replace(" {v}", "") for k, label in CKPT_COLUMNS}
    data: dict[str, dict[str, list[tuple[float, float]]]] = {m: {} for m in CHECKPOINT_PLOT}
    for r in _checkpoint_series(doc):
        for metric in CHECKPOINT_PLOT:
            if _is_num(r.get("size_mib")) and _is_num(r.get(f"{metric}_s")):
                side = labels.get(r["side"], r["side"])
                data[metric].setdefault(side, []).append((float(r["size_mib"]), r[f"{metric}_s"]))
    return [Panel(CHECKPOINT_PLOT[m], "state size (MiB)", "seconds", sides) for m, sides in data.items() if sides]


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


@plot("save_overhead", "bench-save-overhead.png", "save_overhead.json", "save_overhead", "per-save training stall vs parameters")
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
    generated = f"<!-- generated by benchmarks/tables.py from {_shown(path, readme)}: edit the JSON, not this table -->"
    if not path.exists() and spec.pending:
        return f"{generated}\n\nNo results yet: `{_shown(path, readme)}` is written by `{spec.pending}`."
    doc = json.loads(path.read_text())
    command = doc.get("command") if isinstance(doc, dict) else None
    source = f"`{_shown(path, readme)}`, written by `{command}`" if command else f"`{_shown(path, readme)}` (command not recorded)"
    parts = [generated, spec.render(doc)]
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
        if not (results / spec.file).exists() and not spec.pending:
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
    p.add_argument("--as", dest="as_name", metavar="NAME", choices=sorted(REGISTRY),
                   help="with --print: render FILE as this region (a result file under another name)")
    a = p.parse_args(argv)
    if a.plots:
        return write_plots(a.results, a.docs)
    if a.show:
        out = render_file(a.show, a.as_name)
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
