"""Sharded (FSDP2) recovery benchmark: dlrover-core live, dlrover-core restart-all and
torchrun side by side, in one run.

    python benchmarks/sharded_recovery.py [--quick] [--json PATH] [--runs N]

Every side trains the same FSDP2 model (``fully_shard`` of a 5-layer MLP, width ``--width``,
AdamW) with 2 workers on one node, the same per-step seeded batches and steps, a 0.1 s
step (``--step-sleep``: the compute of a real model), a checkpoint persisted every K steps,
and gets the same SIGKILL: rank 1, once rank 0 has completed step ``--kill-step``.

* **dlrover-core (live)**: ``tests/scripts/sharded_live_train.py`` in
  ``Job(parallel=Parallel(["fsdp"]), Checkpoint(persist_every_steps=K))`` with the defaults
  (warm standbys, live recovery, a memory snapshot every step): the survivor keeps its
  process and its FSDP state; the replacement takes rank 1's place and loads its shard from
  the node's memory (docs/design.md §5a).
* **dlrover-core (restart-all)**: the same job with ``Failure(live_recovery=False)``: every
  worker restarts (warm standbys) and restores from memory — what a sharded job did before.
* **torchrun**: ``torchrun --standalone --nproc-per-node 2 --max-restarts 3`` running
  ``_sharded_torchrun_train.py`` (the same model and steps, a per-attempt ``PrefixStore``
  against the gloo restart trap, ``torch.distributed.checkpoint`` save every K steps and load
  on start, as torch's DCP tutorial shows): every worker restarts cold and loads the newest
  checkpoint. One torchrun agent for both workers is its fastest restart.

Measured from each side's step records (seconds from the SIGKILL): *next step* — the end of
the first step rank 0 began after the kill (a step in flight may still complete after it;
dlrover-core live: the surviving process); *full world* — the same for the replaced rank 1;
*recomputed steps* — steps
trained again (the newest step completed before the kill minus the step resumed after);
*time to finish* — launch to the job's end. Medians over ``--runs`` runs per side.
Ratios: ``next_step_vs_torchrun``, ``next_step_vs_restart_all``, ``time_to_finish_vs_torchrun``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from _results import write_result  # noqa: E402

SCRIPT = ROOT / "tests" / "scripts" / "sharded_live_train.py"
PEER = ROOT / "benchmarks" / "_sharded_torchrun_train.py"


def records(out: Path) -> list[dict[str, Any]]:
    rows = []
    for path in out.glob("steps_*.jsonl"):
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:  # a line cut by the kill
                pass
    return sorted(rows, key=lambda r: r["t"])


def kill_rank1_at(out: Path, kill_step: int, timeout_s: float = 300.0) -> float:
    """SIGKILL the newest rank-1 process once rank 0 completed ``kill_step``; the kill time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rows = records(out)
        if any(r["rank"] == 0 and r["step"] >= kill_step for r in rows):
            victim = max((r for r in rows if r["rank"] == 1), key=lambda r: r["t"])["pid"]
            t = time.time()
            os.kill(victim, signal.SIGKILL)
            return t
        time.sleep(0.01)
    raise TimeoutError(f"rank 0 did not reach step {kill_step} within {timeout_s:g} s")


def measure(out: Path, killed_at: float, started: float, ended: float) -> dict[str, Any]:
    rows = records(out)
    before = [r for r in rows if r["t"] < killed_at]
    after = [r for r in rows if r["t"] >= killed_at]
    last_before = max(r["step"] for r in before if r["rank"] == 0)
    # the first steps *begun* after the kill (a step in flight may still complete after it)
    first0 = min((r for r in after if r["rank"] == 0 and r["t0"] >= killed_at), key=lambda r: r["t"])
    first1 = min((r for r in after if r["rank"] == 1 and r["t0"] >= killed_at), key=lambda r: r["t"])
    return {"next_step_s": round(first0["t"] - killed_at, 3), "full_world_s": round(first1["t"] - killed_at, 3),
            "recomputed_steps": last_before - (first0["step"] - 1), "time_to_finish_s": round(ended - started, 3),
            "killed_after_step": last_before}


def run_dlrover(tmp: Path, a: argparse.Namespace, *, live: bool) -> dict[str, Any]:
    from dlrover_core import Checkpoint, Failure, Job, JobState, Nodes, Parallel

    name = "live" if live else "restart-all"
    out = tmp / name
    job = Job(name=f"sharded-{name}", entrypoint=str(SCRIPT),
              args=["--steps", str(a.steps), "--step-sleep", str(a.step_sleep), "--width", str(a.width),
                    "--out", str(out)],
              nodes=Nodes(min=1, max=1, nproc_per_node=2), accelerator="cpu", parallel=Parallel(["fsdp"]),
              checkpoint=Checkpoint(dir=str(tmp / f"{name}-ck"), persist_every_steps=a.ckpt_every),
              failure=Failure(max_restarts=3, live_recovery=live), log_dir=str(tmp / "runs"))
    started = time.time()
    run = job.submit()
    killed_at = kill_rank1_at(out, a.kill_step)
    result = run.wait(progress=False, timeout_s=600)
    ended = time.time()
    if result.state != JobState.SUCCEEDED:
        raise RuntimeError(f"{name}: {result.state} {result.reason}")
    m = measure(out, killed_at, started, ended)
    m["recovery"] = [f.recovery for f in result.failures]
    # whether the replacement(s) started from a warm standby (torch imported) or cold
    text = (Path(result.log_dir) / "node_0.log").read_text().splitlines()
    launches = [line for line in text if "workers_started" in line or "worker_replaced" in line][1:]
    m["replacement_warm"] = all("warm=True" in line or "warm=[True" in line for line in launches) if launches else None
    return m


def run_torchrun(tmp: Path, a: argparse.Namespace) -> dict[str, Any]:
    out = tmp / "torchrun"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node", "2",
         "--max-restarts", "3", str(PEER), "--steps", str(a.steps), "--step-sleep", str(a.step_sleep),
         "--width", str(a.width), "--ckpt-every", str(a.ckpt_every), "--ckpt-dir", str(tmp / "torchrun-ck"),
         "--out", str(out)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    killed_at = kill_rank1_at(out, a.kill_step)
    rc = proc.wait(timeout=300)
    ended = time.time()
    if rc != 0:
        raise RuntimeError(f"torchrun exited {rc}")
    return measure(out, killed_at, started, ended)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one run per side, fewer steps")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--kill-step", type=int, default=50, help="(after the node's standbys are up, as in a long job)")
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--step-sleep", type=float, default=0.1)
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--json", default=str(ROOT / "benchmarks" / "results" / "sharded_recovery.json"))
    a = p.parse_args()
    if a.quick:
        a.runs, a.steps, a.kill_step = 1, 40, 15
    sides: dict[str, list[dict[str, Any]]] = {"dlrover-core": [], "dlrover-core-restart-all": [], "torchrun": []}
    for i in range(a.runs):
        with tempfile.TemporaryDirectory(prefix="dlrover-bench-sharded-") as tmp:
            t = Path(tmp)
            sides["dlrover-core"].append(run_dlrover(t, a, live=True))
            sides["dlrover-core-restart-all"].append(run_dlrover(t, a, live=False))
            sides["torchrun"].append(run_torchrun(t, a))
        print(f"run {i + 1}/{a.runs}: " + "; ".join(f"{s}: next {r[-1]['next_step_s']} s" for s, r in sides.items()),
              flush=True)
    medians = {s: {k: statistics.median(r[k] for r in runs) for k in
                   ("next_step_s", "full_world_s", "recomputed_steps", "time_to_finish_s")}
               for s, runs in sides.items()}
    ours, again, peer = medians["dlrover-core"], medians["dlrover-core-restart-all"], medians["torchrun"]
    ratios = {"next_step_vs_torchrun": round(ours["next_step_s"] / peer["next_step_s"], 3),
              "next_step_vs_restart_all": round(ours["next_step_s"] / again["next_step_s"], 3),
              "full_world_vs_torchrun": round(ours["full_world_s"] / peer["full_world_s"], 3),
              "time_to_finish_vs_torchrun": round(ours["time_to_finish_s"] / peer["time_to_finish_s"], 3)}
    state_mb = (8 * a.width + a.width * a.width + 4 * a.width + 2 * a.width + 4) * 4 * 3 / 2**20
    doc = {"benchmark": "sharded_recovery", "config": {**vars(a), "state_mb_total": round(state_mb, 1),
                                                      "workers": 2, "cpus": os.cpu_count()},
           "medians": medians, "ratios": ratios, "runs": sides}
    write_result(a.json, doc)
    print(json.dumps({"medians": medians, "ratios": ratios}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
