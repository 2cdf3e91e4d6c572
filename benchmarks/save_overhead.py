"""Per-save fixed cost of Flash Checkpoint: the training stall of ``Checkpointer.save``
against the copy it cannot avoid.

    python benchmarks/save_overhead.py [--quick] [--json PATH] [--sizes 1m,10m,100m] [--reps N]

For each model size (the byte-level GPT of ``examples/charlm`` at about 1M, 10M and 100M
parameters, with its AdamW state and an LR scheduler), one real 1-node job (master, agent,
worker running ``_save_overhead_worker.py``) times, after a warm-up:

* the stall of a memory-only ``save(step, state)``;
* the stall of a save due for persistence (``force=True``; the worker waits, untimed, for
  each to be committed before the next, so none meets backpressure);
* side by side, interleaved with the saves in the same process: the floor, a ``copy_`` of
  the same tensors into tensors allocated and written before (pre-touched), one call per
  tensor (the faster of torch's intra-op threads as the job sets them and one thread).

``fixed cost = median stall - median floor``: what a save costs beyond its copy (walking
the state, planning the layout, the header, slot handshakes, records). It prints a table
and, with ``--json``, writes the samples, a ``series`` list for plotting and a ``ratios`` object
(``stall_vs_copy_floor_<size>``: memory-only saves; ``persist_stall_vs_copy_floor_<size>``).
Timings are medians with min-max; nothing here is a pass/fail test. Saves per point: 60 at
1M, 40 at 10M, 20 at 100M parameters (``--reps`` sets all). ``--quick``: 1M and 10M only.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _results import write_result  # noqa: E402  (benchmarks/ is the script's directory)
from rich.console import Console
from rich.table import Table

from dlrover_core import Checkpoint, Failure, Job, JobState

HERE = Path(__file__).resolve().parent

SIZES = ("1m", "10m", "100m")
#: timed saves per kind at each size (after the warm-up): more where a save is short
REPS = {"1m": 60, "10m": 40, "100m": 20}
KINDS = {"memory": "memory only", "persist": "due for persistence"}


def run_size(size: str, reps: int, workdir: Path) -> dict:
    """One 1-node job measuring ``size``; returns the worker's samples."""
    out = workdir / f"{size}.json"
    ckpt_dir = workdir / f"ckpt-{size}"
    job = Job(
        name=f"save-overhead-{size}", entrypoint=str(HERE / "_save_overhead_worker.py"),
        args=["--size", size, "--reps", str(reps), "--out", str(out)],
        nodes=1, accelerator="cpu",
        # only forced saves persist; every save goes to memory
        checkpoint=Checkpoint(dir=str(ckpt_dir), persist_every_steps=0, keep_last=2),
        failure=Failure(max_restarts=0), log_dir=str(workdir / "runs"),
    )
    result = job.run(progress=False)
    if result.state != JobState.SUCCEEDED:
        raise RuntimeError(f"benchmark job failed: {result.reason}; logs in {result.log_dir}")
    shutil.rmtree(ckpt_dir, ignore_errors=True)
    return json.loads(out.read_text())


def summary(samples: list[float]) -> dict:
    """Median, min and max of ``samples`` (seconds), in milliseconds."""
    return {"median": round(statistics.median(samples) * 1e3, 4), "min": round(min(samples) * 1e3, 4),
            "max": round(max(samples) * 1e3, 4)}


def series_of(results: dict[str, dict]) -> list[dict]:
    """One row per (size, kind): stall, floor, fixed cost, ratio."""
    rows = []
    for size, data in results.items():
        for kind in KINDS:
            stall, floor = summary(data[kind]["stall_s"]), summary(data[kind]["floor_s"])
            rows.append({
                "size": size, "params": data["params"], "tensors": data["tensors"], "state_bytes": data["bytes"],
                "kind": kind, "n": len(data[kind]["stall_s"]), "stall_ms": stall, "floor_ms": floor,
                "fixed_cost_ms": round(stall["median"] - floor["median"], 4),
                "stall_vs_copy_floor": round(stall["median"] / floor["median"], 3),
            })
    return rows


def ratios_of(series: list[dict]) -> tuple[dict, dict]:
    """``(ratios, fixed costs in ms)`` keyed ``[persist_]..._<size>``."""
    ratios, fixed = {}, {}
    for row in series:
        prefix = "" if row["kind"] == "memory" else "persist_"
        ratios[f"{prefix}stall_vs_copy_floor_{row['size']}"] = row["stall_vs_copy_floor"]
        fixed[f"{prefix}fixed_cost_ms_{row['size']}"] = row["fixed_cost_ms"]
    return ratios, fixed


def _range(s: dict) -> str:
    return f"{s['median']:.2f} ({s['min']:.1f}–{s['max']:.0f})"


def table(series: list[dict]) -> Table:
    t = Table(title=f"Checkpointer.save: training stall vs the copy floor, ms, median (min–max) of n saves, "
                    f"{os.cpu_count()} cores", title_justify="left")
    for name in ("params", "state", "tensors", "save", "n", "stall", "floor", "fixed", "ratio"):
        t.add_column(name, justify="left" if name == "save" else "right")
    for row in series:
        t.add_row(f"{row['params'] / 1e6:.0f}M", f"{row['state_bytes'] / 2**20:.0f} MiB", str(row["tensors"]),
                  "memory" if row["kind"] == "memory" else "persist", str(row["n"]), _range(row["stall_ms"]),
                  _range(row["floor_ms"]), f"{row['fixed_cost_ms']:.2f}", f"{row['stall_vs_copy_floor']:.2f}")
    t.caption = ("persist: due for persistence; floor: copy_ of the same tensors into pre-touched ones; "
                 "fixed = stall - floor (medians); ratio = stall / floor")
    return t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="1M and 10M parameters only")
    p.add_argument("--sizes", default=",".join(SIZES), help=f"comma-separated model sizes, of {', '.join(SIZES)}")
    p.add_argument("--reps", type=int, default=None,
                   help="timed saves per size and kind, after the warm-up (default: 60, 40, 20 by size)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--workdir", default=None, help="scratch directory (default: a temporary one)")
    a = p.parse_args(argv)
    sizes = ["1m", "10m"] if a.quick else [s.strip() for s in a.sizes.split(",") if s.strip()]
    unknown = sorted(set(sizes) - set(SIZES))
    if unknown:
        p.error(f"unknown size(s) {', '.join(unknown)}; known: {', '.join(SIZES)}")
    console = Console() if sys.stdout.isatty() else Console(width=120)  # a log keeps the table whole
    scratch = Path(tempfile.mkdtemp(prefix="save-overhead-", dir=a.workdir))
    results: dict[str, dict] = {}
    t0 = time.monotonic()
    try:
        for size in sizes:
            reps = a.reps or REPS[size]
            console.print(f"[{size}] a 1-node job: {reps} memory-only saves, {reps} saves due for persistence ...")
            results[size] = run_size(size, reps, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    series = series_of(results)
    ratios, fixed = ratios_of(series)
    console.print(table(series))
    args = argv if argv is not None else sys.argv[1:]
    doc = {
        "command": shlex.join(["python", "benchmarks/" + Path(__file__).name, *args]),
        "machine": {"cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "reps": {size: a.reps or REPS[size] for size in sizes}, "wall_s": round(time.monotonic() - t0, 1),
        "ratios": ratios, "fixed_cost_ms": fixed, "series": series, "samples": results,
    }
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        write_result(a.json, doc)
    console.print(f"done in {doc['wall_s']} s" + (f"; JSON in {a.json}" if a.json else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
