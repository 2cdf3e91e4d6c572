"""Flash Checkpoint benchmark: dlrover-core side by side with its peers, in one run.

    python benchmarks/checkpoint.py [--quick] [--json PATH] [--sizes-mib 256,1024,4096] [--reps N]

For each state size (16 float32 tensors; by default 0.25, 1 and 4 GiB, to show how the
costs grow), one run measures, each side in its best documented configuration:

* dlrover-core — a real 1-node job (master, agent, worker) running ``_fcp_worker.py``: the
  training stall of a save to memory; save → committed and fsynced; a training step's
  slowdown while the agent persists (``step_slowdown_during_persist``: training on all
  cores but one, as when an accelerator computes; ``..._all_cores`` too); saves lost while a
  persist runs; then ``--cycles`` times: the worker is SIGKILLed, restarted by the agent,
  and its first ``load()`` from memory into a live model is timed (the **cold** restore,
  the headline); the last restarted worker also times ``--reps`` more loads (warm);
* DLRover 0.6.1's own Flash Checkpoint (``DdpCheckpointer``) in its own venv, the same way:
  saves, disk save → tracker written, and ``--cycles`` SIGKILL + restart cycles, each timing
  the fresh process's first ``load_checkpoint()`` + copy into a live model (cold), warm loads
  after the last;
* peers in this process: ``torch.save`` + fsync, ``torch.load`` (also its first load in a
  fresh interpreter, ``mmap=True``: cold), DCP ``save``, DCP ``async_save`` with its default
  staging and with its fastest (``checkpoint_peers.measure_dcp`` says which and why), and
  the copy floor (the fastest copy of the same bytes into a pre-touched buffer).

The disk floor is one per size: a raw write + fsync of the same bytes, sampled next to every
side (interleaved with our persists, with DLRover's disk saves, with ``torch.save`` + fsync
and with DCP ``save``; same disk, each side pre-warmed alike: ``_ckpt_common.DiskFloor``),
and pooled.
Memory is freed between sides; a side that cannot run (not enough memory, /dev/shm, or a
failure) is reported as ``{"available": false, "reason": ...}`` instead of ending the run.

It prints a table per size and writes JSON: ``ratios`` (of medians, at the largest size,
``ratios_size_mib``) against ``goals``; ``sizes`` (per size: every
side's measurements — ``*_s`` medians, ``*_samples``, ``*_stats`` = ``{"median", "min",
"max", "n"}`` —, ``figures`` (each headline figure's stats), ``disk_floor`` and ``ratios``);
``series`` (one row per size and side: ``size_mib``, ``side``, ``stall_s``, ``durable_s``,
``restore_cold_s``, ``restore_warm_s`` medians and ``<metric>_range`` ``[min, max]``, for
plotting; the floor's ``durable_s`` is the disk floor, its others the copy); and
``command``, the exact command line. Nothing here is a pass/fail test.
``--quick`` (CI-like): 256 MiB, 3 repetitions and restart cycles.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import checkpoint_peers  # noqa: E402
import dlrover_peer  # noqa: E402
from _ckpt_common import DiskFloor, add_stats, byte_views, prewarm_copies, summary  # noqa: E402
from _results import write_result  # noqa: E402  (benchmarks/ is the script's directory)

from dlrover_core import Checkpoint, Failure, Job, JobState  # noqa: E402

#: ratio key -> goal (lower is better; every ratio is of medians)
GOALS = {
    "stall_vs_memcpy_floor": 1.1,
    "stall_vs_dlrover_fcp": 1.0,
    "stall_vs_torch_save": 0.1,
    "stall_vs_dcp_async_save": 0.5,
    "stall_vs_dcp_async_save_fastest": 0.5,
    "durable_vs_disk_floor": 1.25,
    "durable_vs_disk_floor_same_run": 1.25,
    "step_slowdown_during_persist": 0.10,
    "dropped_saves": 0,
    "restore_cold_vs_dlrover_cold": 1.0,
    "restore_memory_vs_memcpy_floor": 1.2,
    "restore_memory_vs_torch_load": 0.25,
}

#: Memory each side needs, in copies of the state (RAM; /dev/shm), with some slack:
#: ours: two shm slots + the state (attempt 0) or a live model (restarts);
#: peers: the state + a copy + a live model or a staging buffer (DCP's in /dev/shm, its
#: daemon's copy too while it lives);
#: DLRover: its one shm buffer + the state + a live model.
NEEDS = {"dlrover-core": (3.3, 2.05), "peers": (3.3, 2.05), "DLRover 0.6.1": (3.3, 1.05)}

#: series / figures: (side key, label, where, stall, durable, restore cold, restore warm);
#: "where" is ours / peers / dlrover / floor, the others name figures (``<name>_samples``).
SIDES = [
    ("ours", "dlrover-core", "ours", "stall", "durable", "restore_cold", "restore_warm"),
    ("dlrover", "DLRover FCP", "dlrover", "save_memory_block", "commit", "restore_cold", "restore_warm"),
    ("torch", "torch.save / load", "peers", "save", "save", "load_cold", "load_mmap_into_model"),
    ("dcp_save", "DCP save", "peers", "dcp_save", "dcp_save", None, None),
    ("dcp_async_default", "DCP async_save", "peers", "dcp_async_save_block",
     "dcp_async_save_total", None, None),
    ("dcp_async_fastest", "DCP async_save (fastest staging)", "peers", "dcp_async_save_fastest_block",
     "dcp_async_save_fastest_total", None, None),
    ("floor", "floor", "floor", "memcpy", "write_fsync", "memcpy", "memcpy"),
]


# ---------------------------------------------------------------- sides


def run_ours(size_bytes: int, reps: int, cycles: int, workdir: Path) -> dict:
    """Our Checkpointer inside a real local job; returns the worker's measurements."""
    out = workdir / "ours.json"
    job = Job(
        name="fcp-bench", entrypoint=str(HERE / "_fcp_worker.py"),
        args=["--size-bytes", str(size_bytes), "--reps", str(reps), "--cycles", str(cycles), "--out", str(out)],
        nodes=1, accelerator="cpu",
        # keep_last=2, like the write + fsync floor, which keeps its last two files
        checkpoint=Checkpoint(dir=str(workdir / "ours-ckpt"), persist_every_steps=0, keep_last=2),
        # every restart cycle is a worker failure of the one node: none may exclude it
        failure=Failure(max_restarts=cycles, max_node_failures=cycles + 2), log_dir=str(workdir / "runs"),
    )
    try:
        result = job.run(progress=False)
        if result.state != JobState.SUCCEEDED:
            raise RuntimeError(f"benchmark job failed: {result.reason}; logs in {result.log_dir}")
        return json.loads(out.read_text())
    finally:
        shutil.rmtree(workdir / "ours-ckpt", ignore_errors=True)


def run_peers(size_bytes: int, reps: int, workdir: Path) -> dict:
    """The in-process peers and the copy floor; each durable peer save is interleaved with
    a disk floor sample (``disk_floor_samples``). A peer that fails is reported under
    ``unavailable`` and the others still run."""
    out: dict = {}
    unavailable: dict[str, str] = {}
    state = checkpoint_peers.make_state(size_bytes)
    arrays = byte_views(state)
    floor = DiskFloor(workdir / "peers-floor")
    try:
        floor.prewarm(arrays, prewarm_copies(size_bytes, reps))
        sample = lambda: floor.sample(arrays)  # noqa: E731
        for name, measure in (("floors", lambda: checkpoint_peers.measure_floors(state, reps)),
                              ("torch_save", lambda: checkpoint_peers.measure_torch_save(state, workdir, reps, sample)),
                              ("dcp", lambda: checkpoint_peers.measure_dcp(state, workdir, reps, sample))):
            try:
                out.update(measure())
            except Exception as exc:  # noqa: BLE001 - one peer failing (e.g. memory at 4 GiB) must not end the run
                unavailable[name] = f"{type(exc).__name__}: {exc}"[:2000]
            gc.collect()
    finally:
        floor.clear()
        shutil.rmtree(floor.directory, ignore_errors=True)
    out["disk_floor_samples"] = floor.samples
    out["write_fsync_samples"] = floor.samples
    if floor.samples:
        out["write_fsync_s"] = summary(floor.samples)["median"]
    out["unavailable"] = unavailable
    return out


def _meminfo() -> tuple[int, int]:
    """(RAM available, /dev/shm free), bytes."""
    avail = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    st = os.statvfs("/dev/shm")
    return avail, st.f_bavail * st.f_frsize


def _room(name: str, size_bytes: int) -> str | None:
    """Why ``name`` cannot run at this size now (memory), or None."""
    ram_copies, shm_copies = NEEDS[name]
    avail, shm = _meminfo()
    need, need_shm = int(ram_copies * size_bytes + 2**30), int(shm_copies * size_bytes)
    if avail < need:
        return f"needs about {need / 2**30:.1f} GiB of memory, {avail / 2**30:.1f} GiB available"
    if shm < need_shm:
        return f"needs {need_shm / 2**30:.1f} GiB of /dev/shm, {shm / 2**30:.1f} GiB free"
    return None


def side(console: Console, label: str, name: str, size_bytes: int, fn: Callable[[], dict]) -> dict:
    """Run one side, or say why it could not run."""
    why = _room(name, size_bytes)
    if why is not None:
        console.print(f"{label}: [yellow]skipped[/yellow]: {why}")
        return {"available": False, "reason": why}
    console.print(f"{label} ...")
    t0 = time.monotonic()
    load_before = os.getloadavg()[0]  # other work on the machine skews timings: say how much there was
    try:
        data = fn()
    except Exception as exc:  # noqa: BLE001 - a side failing (e.g. out of memory at 4 GiB) is a result
        console.print(f"{label}: [red]failed[/red]: {type(exc).__name__}: {exc}")
        data = {"available": False, "reason": f"{type(exc).__name__}: {exc}"[:3000]}
    finally:
        gc.collect()
    data.setdefault("available", True)
    data["side_wall_s"] = round(time.monotonic() - t0, 1)
    data["loadavg_1min_before_after"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    return add_stats(data)


# ---------------------------------------------------------------- figures


def _samples(d: dict, name: str | None) -> list[float] | None:
    if name is None or not d.get("available", True):
        return None
    if isinstance(d.get(f"{name}_samples"), list):
        return d[f"{name}_samples"]
    v = d.get(f"{name}_s")
    return [v] if isinstance(v, (int, float)) else None


def figures(ours: dict, peers: dict, dl: dict, floor: dict) -> dict:
    """``<side>.<stall|durable|restore_cold|restore_warm>`` -> stats (medians, min, max, n)."""
    where = {"ours": ours, "peers": peers, "dlrover": dl}
    out = {}
    for key, _label, src, *names in SIDES:
        for metric, name in zip(("stall", "durable", "restore_cold", "restore_warm"), names, strict=True):
            if src == "floor":
                s = floor.get("samples") if metric == "durable" else _samples(peers, name)
            else:
                s = _samples(where[src], name)
            if s:
                out[f"{key}.{metric}"] = summary(s)
    return out


def series_rows(size_mib: int, figs: dict, dl: dict) -> list[dict]:
    rows = []
    for key, label, *_ in SIDES:
        row: dict = {"size_mib": size_mib, "side": label}
        for metric in ("stall", "durable", "restore_cold", "restore_warm"):
            f = figs.get(f"{key}.{metric}")
            row[f"{metric}_s"] = f["median"] if f else None
            row[f"{metric}_range"] = [f["min"], f["max"]] if f else None
        if key == "dlrover":
            row["available"] = dl.get("available", False)
            row["durable_fsynced"] = bool(dl.get("fsyncs_data"))  # DLRover 0.6.1: its data file is not fsynced
        rows.append(row)
    return rows


def ratios(ours: dict, peers: dict, dl: dict, floor: dict) -> dict:
    def div(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else a / b

    o = ours if ours.get("available", True) else {}
    d = dl if dl.get("available", True) else {}
    return {
        "stall_vs_memcpy_floor": div(o.get("stall_s"), peers.get("memcpy_s")),
        "stall_vs_dlrover_fcp": div(o.get("stall_s"), d.get("save_memory_block_s")),
        "stall_vs_torch_save": div(o.get("stall_s"), peers.get("save_s")),
        "stall_vs_dcp_async_save": div(o.get("stall_s"), peers.get("dcp_async_save_block_s")),
        "stall_vs_dcp_async_save_fastest": div(o.get("stall_s"), peers.get("dcp_async_save_fastest_block_s")),
        "durable_vs_disk_floor": div(o.get("durable_s"), o.get("write_fsync_s")),
        "durable_vs_disk_floor_same_run": div(o.get("durable_s"), floor.get("median")),
        "step_slowdown_during_persist": o.get("step_slowdown_during_persist"),
        "step_slowdown_during_persist_all_cores": o.get("step_slowdown_during_persist_all_cores"),
        "dropped_saves": o.get("dropped_saves"),
        "restore_cold_vs_dlrover_cold": div(o.get("restore_cold_s"), d.get("restore_cold_s")),
        # the headline restore is the cold one (first load after a restart), on every side
        "restore_memory_vs_memcpy_floor": div(o.get("restore_cold_s"), peers.get("memcpy_s")),
        "restore_memory_vs_torch_load": div(o.get("restore_cold_s"), peers.get("load_cold_s")),
        "restore_warm_vs_memcpy_floor": div(o.get("restore_warm_s"), peers.get("memcpy_s")),
        "restore_warm_vs_dlrover_warm": div(o.get("restore_warm_s"), d.get("restore_warm_s")),
    }


# ---------------------------------------------------------------- output


def _s(v: float | None) -> str:
    return "—" if v is None else f"{v:.3f}"


def table(size_mib: int, reps: int, entry: dict) -> Table:
    ours, peers, dl, figs, r = entry["ours"], entry["peers"], entry["dlrover"], entry["figures"], entry["ratios"]
    t = Table(title=f"Flash Checkpoint, {size_mib} MiB state (16 float32 tensors), {reps} repetitions, "
                    f"{os.cpu_count()} cores; seconds", title_justify="left")
    for col, justify in (("what", "left"), ("median", "right"), ("min–max", "right"), ("n", "right")):
        t.add_column(col, justify=justify)

    def row(name: str, fig: str | None) -> None:
        f = figs.get(fig) if fig else None
        if f is None:
            t.add_row(name, "—", "", "")
        else:
            t.add_row(name, _s(f["median"]), f"{_s(f['min'])}–{_s(f['max'])}", str(f["n"]))

    def head(name: str) -> None:
        t.add_row(f"[b]{name}[/b]", "", "", "")

    head("training stall of a save")
    row("  dlrover-core, save to memory", "ours.stall")
    row("  DLRover 0.6.1 FCP, save to memory", "dlrover.stall")
    row("  torch.save + fsync", "torch.stall")
    row("  DCP save", "dcp_save.stall")
    row("  DCP async_save, default staging, blocking part", "dcp_async_default.stall")
    fastest = (peers.get("dcp_async_save_fastest_config") or {}).get("variant", "")
    row(f"  DCP async_save, fastest staging ({fastest.replace('_', ', ')}), until staged", "dcp_async_fastest.stall")
    f = peers.get("dcp_async_save_fastest_call_stats")
    if f:
        t.add_row("    (its call returns after)", _s(f["median"]), f"{_s(f['min'])}–{_s(f['max'])}", str(f["n"]))
    row(f"  floor: copy into a pre-touched buffer ({peers.get('memcpy_method', 'best')})", "floor.stall")
    head("save → committed and fsynced")
    row("  dlrover-core (background persist + commit)", "ours.durable")
    row("  DLRover 0.6.1 FCP, disk save → tracker written (data not fsynced)", "dlrover.durable")
    row("  DCP async_save, default staging, until done", "dcp_async_default.durable")
    row("  DCP async_save, fastest staging, until done", "dcp_async_fastest.durable")
    row("  floor: raw write + fsync, this run (next to every side)", "floor.durable")
    head("restore after a worker restart (cold: the fresh process's first load), into a live model")
    row("  dlrover-core, from memory", "ours.restore_cold")
    row("  DLRover 0.6.1 FCP, from memory", "dlrover.restore_cold")
    row("  torch.load(mmap=True), page cache warm", "torch.restore_cold")
    row("  floor: copy", "floor.restore_cold")
    head("restore, warm (the same process again)")
    row("  dlrover-core", "ours.restore_warm")
    row("  DLRover 0.6.1 FCP", "dlrover.restore_warm")
    row("  torch.load(mmap=True)", "torch.restore_warm")
    head("a training step while the agent persists (slowdown, fraction)")
    if ours.get("available", True):
        t.add_row(f"  training on {ours['step_threads']} of {os.cpu_count()} cores",
                  _s(ours["step_slowdown_during_persist"]), "", "")
        t.add_row(f"  training on all {os.cpu_count()} cores", _s(ours["step_slowdown_during_persist_all_cores"]), "", "")
    t.add_section()
    t.add_row("[b]ratio (of medians)[/b]", "[b]value[/b]", "[b]goal[/b]", "")
    for key, goal in GOALS.items():
        v = r[key]
        ok = v is not None and v <= goal
        mark = "[green]met[/green]" if ok else ("[red]missed[/red]" if v is not None else "n/a")
        t.add_row(f"  {key}", f"{_s(v) if key != 'dropped_saves' else v}", f"≤ {goal} {mark}", "")
    t.add_row("  dropped saves, DLRover 0.6.1", str(dl.get("dropped_saves", "—")), "", "")
    for name, d in (("dlrover-core", ours), ("DLRover 0.6.1", dl)):
        if not d.get("available", True):
            t.add_row(f"  [yellow]{name} did not run:[/yellow] {_first_line(d.get('reason', ''))}", "", "", "")
        elif set(d.get("restore_cold_sources") or ["memory"]) != {"memory"}:
            t.add_row(f"  [yellow]{name}: not every cold restore came from memory[/yellow]",
                      ", ".join(d["restore_cold_sources"]), "", "")
    for name, why in peers.get("unavailable", {}).items():
        t.add_row(f"  [yellow]{name} did not run:[/yellow] {_first_line(why)}", "", "", "")
    return t


def _first_line(text: str, n: int = 110) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= n else line[: n - 1] + "…"


def _leftover_shm() -> list[str]:
    """Segments of this benchmark's jobs still in /dev/shm (ours, DLRover's, the peers')."""
    try:
        return sorted(n for n in os.listdir("/dev/shm") if n.startswith(("dlrover-fcp-bench-", "fcppeer", "ckpt-peers-")))
    except OSError:
        return []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="CI-like: 256 MiB, 3 repetitions and restart cycles")
    p.add_argument("--sizes-mib", default="256,1024,4096", help="comma-separated state sizes in MiB")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions of every figure (default 5)")
    p.add_argument("--cycles", type=int, default=None,
                   help="worker restarts, each timing one cold restore, per side (default: --reps)")
    p.add_argument("--ratios-size-mib", type=int, default=None,
                   help="the size whose ratios are the top-level ones (default: the largest)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--no-dlrover", action="store_true", help="skip DLRover's own FCP (needs its venv)")
    p.add_argument("--workdir", default=None, help="scratch directory on a real disk (default: a temporary one)")
    p.add_argument("--merge-into", default=None, metavar="RESULT_JSON",
                   help="after the run, add its sizes to this earlier result file (a size measured again "
                        "replaces the old one): one file, whose sizes were measured by separate runs, each named "
                        "with its command")
    args = sys.argv[1:] if argv is None else argv
    a = p.parse_args(args)
    sizes = [256] if a.quick else [int(s) for s in a.sizes_mib.split(",")]
    reps = 3 if a.quick else a.reps
    cycles = 3 if a.quick and a.cycles is None else (a.cycles or reps)
    if reps < 1 or cycles < 1:
        p.error("--reps and --cycles must be at least 1")
    console = Console(width=None if sys.stdout.isatty() else 150)
    scratch = Path(tempfile.mkdtemp(prefix="fcp-bench-", dir=a.workdir))
    results: dict[str, dict] = {}
    series: list[dict] = []
    t0 = time.monotonic()
    try:
        for size_mib in sizes:
            size = size_mib * 2**20
            work = scratch / f"{size_mib}MiB"
            work.mkdir()
            tag = f"[{size_mib} MiB]"
            ours = side(console, f"{tag} dlrover-core (a 1-node job)", "dlrover-core", size,
                        functools.partial(run_ours, size, reps, cycles, work))
            peers = side(console, f"{tag} peers and floors", "peers", size, functools.partial(run_peers, size, reps, work))
            if a.no_dlrover:
                dl = {"available": False, "reason": "--no-dlrover"}
            else:
                dl = side(console, f"{tag} DLRover 0.6.1 Flash Checkpoint", "DLRover 0.6.1", size,
                          functools.partial(_dlrover, size, reps, cycles, work))
            by_side = {"dlrover-core": ours.get("write_fsync_samples") or [],
                       "DLRover 0.6.1": dl.get("disk_floor_samples") or [],
                       "peers": peers.get("disk_floor_samples") or []}
            pooled = [x for xs in by_side.values() for x in xs]
            floor = {**(summary(pooled) or {}), "samples": pooled,
                     "by_side": {k: summary(v) for k, v in by_side.items()},
                     "what": "raw os.write + fsync (file and directory) of the same bytes to a new file, last 2 "
                             "kept; sampled next to every side's saves, after the same pre-warming"}
            figs = figures(ours, peers, dl, floor)
            entry = {"ours": ours, "peers": peers, "dlrover": dl, "disk_floor": floor, "figures": figs,
                     "ratios": ratios(ours, peers, dl, floor)}
            results[str(size_mib)] = entry
            series += series_rows(size_mib, figs, dl)
            console.print(table(size_mib, reps, entry))
            shutil.rmtree(work, ignore_errors=True)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    ratio_size = a.ratios_size_mib if a.ratios_size_mib in sizes else sizes[-1]
    leftovers = _leftover_shm()
    doc = {
        "command": shlex.join(["python", f"benchmarks/{Path(__file__).name}", *args]),
        "machine": {"cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)},
        "reps": reps, "restart_cycles": cycles, "sizes_mib": sizes, "wall_s": round(time.monotonic() - t0, 1),
        "ratios_size_mib": ratio_size, "ratios": results[str(ratio_size)]["ratios"], "goals": GOALS,
        "series": series, "sizes": results, "shm_left_behind": leftovers,
    }
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        write_result(a.json, doc)
    if a.merge_into:
        write_result(a.merge_into, merge(json.loads(Path(a.merge_into).read_text()), doc))
        console.print(f"sizes {sizes} merged into {a.merge_into}")
    if leftovers:
        console.print(f"[red]/dev/shm segments left behind: {leftovers}[/red]")
    console.print(f"done in {doc['wall_s']} s" + (f"; JSON in {a.json}" if a.json else ""))
    return 0 if all(r["ours"].get("available", True) for r in results.values()) else 1


def merge(old: dict, new: dict) -> dict:
    """``old`` (a result file) with ``new``'s sizes added (a size in both: ``new``'s): every size
    entry records the run that measured it (``run``: command, reps, restart cycles, wall
    seconds); ``runs`` lists the runs; the top-level ratios are the largest size's."""
    def run_of(doc: dict) -> dict:
        return {k: doc.get(k) for k in ("command", "reps", "restart_cycles", "wall_s", "sizes_mib")}

    runs = old.get("runs") or [run_of(old)]
    sizes = {k: {"run": v.get("run") or run_of(old), **v} for k, v in old["sizes"].items()}
    for key, entry in new["sizes"].items():
        sizes[key] = {**entry, "run": run_of(new)}
    runs = [r for r in runs if any(s["run"]["command"] == r["command"] for s in sizes.values())] + [run_of(new)]
    order = sorted(sizes, key=int)
    top = str(max(int(k) for k in order))
    series = [r for r in old.get("series", []) if str(r.get("size_mib")) not in new["sizes"]] + new.get("series", [])
    return {
        **old,
        "command": " ; ".join(r["command"] for r in runs),
        "runs": runs, "sizes_mib": [int(k) for k in order], "reps": new["reps"], "restart_cycles": new["restart_cycles"],
        "wall_s": round(sum(r["wall_s"] or 0 for r in runs), 1), "ratios_size_mib": int(top),
        "ratios": sizes[top]["ratios"], "goals": new["goals"],
        "series": sorted(series, key=lambda r: r.get("size_mib") or 0),
        "sizes": {k: sizes[k] for k in order},
        "shm_left_behind": sorted(set(old.get("shm_left_behind") or []) | set(new.get("shm_left_behind") or [])),
    }


def _dlrover(size: int, reps: int, cycles: int, work: Path) -> dict:
    dl = dlrover_peer.measure_dlrover_fcp(size, reps, work, cycles=cycles)
    if not dl.get("available", True):
        raise RuntimeError(dl.get("reason", "DLRover unavailable"))
    return dl


if __name__ == "__main__":
    sys.exit(main())
