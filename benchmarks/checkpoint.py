"""Flash Checkpoint benchmark: dlrover-core side by side with its peers, in one run.

    python benchmarks/checkpoint.py [--quick] [--json PATH] [--sizes-mib 256,1024] [--reps N]

For each state size (16 float32 tensors), one run measures:

* dlrover-core — a real 1-node job (master, agent, worker) running ``_fcp_worker.py``: the
  training stall of a save to memory; save → committed and fsynced; a training step's
  slowdown while the agent persists (``step_slowdown_during_persist``: training on all
  cores but one, as when an accelerator computes; ``..._all_cores`` too); saves lost while a
  persist runs; and, after the worker is SIGKILLed and restarted, the restore from memory
  into a live model;
* peers in this process: ``torch.save`` + fsync (and ``torch.load``), DCP ``save``, DCP
  ``async_save`` (its blocking part), and the floors — the fastest copy of the same bytes
  into a pre-touched buffer (all cores) and a raw write + fsync;
* DLRover 0.6.1's own Flash Checkpoint (``DdpCheckpointer``) in its own venv.

It prints a table per size and writes JSON with a ``ratios`` object (the largest size; every
size's are under ``sizes``). Timings are medians; nothing here is a pass/fail test.
``--quick``: 256 MiB, 3 repetitions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import checkpoint_peers  # noqa: E402
import dlrover_peer  # noqa: E402

from dlrover_core import Checkpoint, Failure, Job, JobState  # noqa: E402

#: ratio key -> (goal, higher is worse)
GOALS = {
    "stall_vs_memcpy_floor": 1.1,
    "stall_vs_dlrover_fcp": 1.0,
    "stall_vs_torch_save": 0.1,
    "stall_vs_dcp_async_save": 0.5,
    "durable_vs_disk_floor": 1.25,
    "step_slowdown_during_persist": 0.10,
    "dropped_saves": 0,
    "restore_memory_vs_memcpy_floor": 1.2,
    "restore_memory_vs_torch_load": 0.25,
}


def run_ours(size_bytes: int, reps: int, workdir: Path) -> dict:
    """Our Checkpointer inside a real local job; returns the worker's measurements."""
    out = workdir / "ours.json"
    job = Job(
        name="fcp-bench", entrypoint=str(HERE / "_fcp_worker.py"),
        args=["--size-bytes", str(size_bytes), "--reps", str(reps), "--out", str(out)],
        nodes=1, accelerator="cpu",
        # keep_last=2, like the write + fsync floor, which keeps its last two files
        checkpoint=Checkpoint(dir=str(workdir / "ours-ckpt"), persist_every_steps=0, keep_last=2),
        failure=Failure(max_restarts=1), log_dir=str(workdir / "runs"),
    )
    result = job.run(progress=False)
    if result.state != JobState.SUCCEEDED:
        raise RuntimeError(f"benchmark job failed: {result.reason}; logs in {result.log_dir}")
    data = json.loads(out.read_text())
    shutil.rmtree(workdir / "ours-ckpt", ignore_errors=True)
    return data


def ratios(ours: dict, peers: dict, dl: dict) -> dict:
    def div(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else a / b

    return {
        "stall_vs_memcpy_floor": div(ours["stall_s"], peers["memcpy_s"]),
        "stall_vs_dlrover_fcp": div(ours["stall_s"], dl.get("save_memory_block_s")),
        "stall_vs_torch_save": div(ours["stall_s"], peers["save_s"]),
        "stall_vs_dcp_async_save": div(ours["stall_s"], peers["dcp_async_save_block_s"]),
        "durable_vs_disk_floor": div(ours["durable_s"], ours["write_fsync_s"]),
        "step_slowdown_during_persist": ours["step_slowdown_during_persist"],
        "step_slowdown_during_persist_all_cores": ours["step_slowdown_during_persist_all_cores"],
        "dropped_saves": ours["dropped_saves"],
        "restore_memory_vs_memcpy_floor": div(ours["restore_s"], peers["memcpy_s"]),
        "restore_memory_vs_torch_load": div(ours["restore_s"], peers["load_s"]),
    }


def _s(v: float | None) -> str:
    return "—" if v is None else f"{v:.3f}"


def table(size_mib: int, reps: int, ours: dict, peers: dict, dl: dict, r: dict) -> Table:
    t = Table(title=f"Flash Checkpoint, {size_mib} MiB state (16 float32 tensors), medians of {reps}, "
                    f"{os.cpu_count()} cores", title_justify="left")
    t.add_column("what")
    t.add_column("seconds", justify="right")
    dl_ok = dl.get("available", True)
    rows = [
        ("[b]training stall of a save[/b]", None),
        ("  dlrover-core, save to memory", ours["stall_s"]),
        ("  DLRover 0.6.1 FCP, save to memory", dl.get("save_memory_block_s") if dl_ok else None),
        ("  torch.save + fsync", peers["save_s"]),
        ("  DCP save", peers["dcp_save_s"]),
        ("  DCP async_save, blocking part", peers["dcp_async_save_block_s"]),
        (f"  floor: copy into a pre-touched buffer ({peers.get('memcpy_method', 'best')})", peers["memcpy_s"]),
        ("[b]save → committed and fsynced[/b]", None),
        ("  dlrover-core (background persist + commit)", ours["durable_s"]),
        ("  DLRover 0.6.1 FCP, disk save → tracker written (data not fsynced)", dl.get("commit_s") if dl_ok else None),
        ("  DCP async_save, until done", peers["dcp_async_save_total_s"]),
        ("  floor: raw write + fsync of the same bytes, interleaved with ours", ours["write_fsync_s"]),
        ("  floor: raw write + fsync, measured with the peers", peers["write_fsync_s"]),
        ("[b]restore after a worker restart, into a live model[/b]", None),
        ("  dlrover-core, from memory", ours["restore_s"]),
        ("  DLRover 0.6.1 FCP, from memory", dl.get("restore_memory_s") if dl_ok else None),
        ("  torch.load (warm page cache)", peers["load_s"]),
        ("  floor: copy", peers["memcpy_s"]),
        ("[b]a training step while the agent persists (slowdown, fraction)[/b]", None),
        (f"  training on {ours['step_threads']} of {os.cpu_count()} cores", ours["step_slowdown_during_persist"]),
        (f"  training on all {os.cpu_count()} cores", ours["step_slowdown_during_persist_all_cores"]),
    ]
    for name, value in rows:
        t.add_row(name, "" if value is None and name.startswith("[b]") else _s(value))
    t.add_section()
    t.add_row("[b]ratio[/b]", "[b]value (goal)[/b]")
    for key, goal in GOALS.items():
        v = r[key]
        ok = v is not None and v <= goal
        mark = "[green]met[/green]" if ok else ("[red]missed[/red]" if v is not None else "n/a")
        t.add_row(f"  {key}", f"{_s(v) if key != 'dropped_saves' else v} (≤ {goal}) {mark}")
    t.add_row("  dropped saves, DLRover 0.6.1", str(dl.get("dropped_saves", "—")))
    return t


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="256 MiB, 3 repetitions (under 3 minutes)")
    p.add_argument("--sizes-mib", default="256,1024", help="comma-separated state sizes in MiB")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--no-dlrover", action="store_true", help="skip DLRover's own FCP (needs its venv)")
    p.add_argument("--workdir", default=None, help="scratch directory (default: a temporary one)")
    a = p.parse_args(argv)
    sizes = [256] if a.quick else [int(s) for s in a.sizes_mib.split(",")]
    reps = 3 if a.quick else a.reps
    console = Console()
    scratch = Path(tempfile.mkdtemp(prefix="fcp-bench-", dir=a.workdir))
    results: dict[str, dict] = {}
    t0 = time.monotonic()
    try:
        for size_mib in sizes:
            size = size_mib * 2**20
            work = scratch / f"{size_mib}MiB"
            work.mkdir()
            console.print(f"[{size_mib} MiB] dlrover-core (a 1-node job) ...")
            ours = run_ours(size, reps, work)
            console.print(f"[{size_mib} MiB] peers and floors ...")
            state = checkpoint_peers.make_state(size)
            peers = {**checkpoint_peers.measure_floors(state, work, reps),
                     **checkpoint_peers.measure_torch_save(state, work, reps),
                     **checkpoint_peers.measure_dcp(state, work, reps)}
            del state
            if a.no_dlrover:
                dl = {"available": False, "reason": "--no-dlrover"}
            else:
                console.print(f"[{size_mib} MiB] DLRover 0.6.1 Flash Checkpoint ...")
                dl = dlrover_peer.measure_dlrover_fcp(size, reps, work)
            r = ratios(ours, peers, dl)
            results[str(size_mib)] = {"ours": ours, "peers": peers, "dlrover": dl, "ratios": r}
            console.print(table(size_mib, reps, ours, peers, dl, r))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    largest = results[str(sizes[-1])]
    doc = {
        "command": "python benchmarks/" + " ".join([Path(__file__).name, *(argv if argv is not None else sys.argv[1:])]),
        "machine": {"cores": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "reps": reps, "wall_s": round(time.monotonic() - t0, 1),
        "ratios": largest["ratios"], "goals": GOALS, "sizes": results,
    }
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(doc, indent=2))
    console.print(f"done in {doc['wall_s']} s" + (f"; JSON in {a.json}" if a.json else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
