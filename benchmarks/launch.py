"""Launch overhead: ``dlrover run`` and ``torchrun`` side by side, from the command to the
script's first line.

    python benchmarks/launch.py [--repeat N] [--nproc N] [--json PATH] [--quick]

Both launchers start the same script, whose first line prints ``time.time()`` before any
import; the figure per run is that time minus the wall time just before the launcher's
process was started (``subprocess.Popen``), i.e. what a user waits before their script runs.
The two sides alternate run by run (torchrun, dlrover, torchrun, ...) so that any drift in
the machine's load hits both; each run is cold for the launcher (a new process) and warm
for the page cache (the first run of each side is discarded as the warm-up of the cache).

* **torchrun**: ``torchrun --standalone --nproc-per-node N script`` (its c10d store on a
  free port, one agent: its fastest documented single-host start).
* **dlrover run**: ``dlrover run --nproc-per-node N --accelerator cpu script`` (the job master
  on a free local port, one agent; the same as ``--standalone``). ``--accelerator cpu`` is
  what torchrun does (it does not probe devices when given a number); with the default
  ``auto`` ours probes the accelerator plugins too.

A second script measures what a training script meets next: after its first line it imports
torch, joins the process group (``env://``: the launcher's store) and all-reduces once; the
figure is the time until every rank finished that all-reduce. dlrover's launcher does not
import torch before starting the worker (its job master imports it meanwhile, for the
store), so the first line comes sooner than torchrun's, and this second figure shows what is
left of the lead once the script needs torch and the store.

A third script goes on to the first training step: a small model's forward and backward,
the gradients all-reduced, one ``torch.optim.AdamW`` step (whose first call imports
``torch._dynamo``, as every training script's first optimizer step does); the figure is the
time until every rank finished that step: the start as a user meets it (issue 29: no slower
than torchrun's). Under ``dlrover run`` workers are forked by the node's warm standby
(``dlrover_core/agent/standby.py``), which has done these imports before it forks them.

Reported: per side the median, min and max over ``--repeat`` runs; ``ratios`` holds
``dlrover_minus_torchrun_s`` (median difference to the first line; goal ≤ 0.5 s, issue 14),
``dlrover_over_torchrun`` (ratio of medians) and the same two for the first all-reduce and
the first step (goal: ours ≤ torchrun's, ``first_step_met``). Both
sides are also timed to their exit (the first script exits at once), which shows the cost of
shutting down.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import summary, write_result  # noqa: E402  (benchmarks/ is the script's directory)

FIRST_LINE = "import time; print('FIRST_LINE', repr(time.time()), flush=True)\n"
#: The second script: the first line, then what a training script does first: import torch,
#: join the process group (env://, the launcher's store) and all-reduce once.
FIRST_COLLECTIVE = FIRST_LINE + (
    "import torch, torch.distributed as dist\n"
    "dist.init_process_group('gloo')\n"
    "t = torch.ones(1); dist.all_reduce(t)\n"
    "print('FIRST_COLLECTIVE', repr(time.time()), flush=True)\n"
    "dist.destroy_process_group()\n"
)
#: The third script: on to the first training step (forward, backward, gradients all-reduced,
#: an AdamW step: its first call imports ``torch._dynamo``, as in any training script).
FIRST_STEP = FIRST_LINE + (
    "import torch, torch.distributed as dist\n"
    "dist.init_process_group('gloo')\n"
    "model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))\n"
    "optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)\n"
    "model(torch.randn(32, 256)).pow(2).mean().backward()\n"
    "for p in model.parameters():\n"
    "    dist.all_reduce(p.grad)\n"
    "optimizer.step()\n"
    "print('FIRST_STEP', repr(time.time()), flush=True)\n"
    "dist.destroy_process_group()\n"
)


def _bin(name: str) -> str:
    return str(Path(sys.executable).with_name(name))


def one_run(argv: list[str], cwd: Path, marker: str = "FIRST_LINE") -> tuple[float, float]:
    """(seconds to the script's ``marker`` line (every rank's: the latest), or its first
    line for ``FIRST_LINE`` (the earliest rank's), seconds to the launcher's exit)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    start = time.time()
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    end = time.time()
    if proc.returncode != 0:
        raise RuntimeError(f"{argv[0]} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    times = [float(line.split(marker, 1)[1].split()[0]) for line in proc.stdout.splitlines() if marker in line]
    if not times:
        raise RuntimeError(f"{argv[0]}: the script did not print {marker}:\n{proc.stdout[-2000:]}")
    return (min(times) if marker == "FIRST_LINE" else max(times)) - start, end - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=10, help="runs per side (after one warm-up run each)")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="3 runs per side (CI)")
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args()
    repeat = 3 if args.quick else args.repeat
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="dlrover-launch-") as tmp:
        work = Path(tmp)
        (work / "first.py").write_text(FIRST_LINE)
        (work / "collective.py").write_text(FIRST_COLLECTIVE)
        (work / "step.py").write_text(FIRST_STEP)
        sides = {
            "torchrun": [_bin("torchrun"), "--standalone", "--nproc-per-node", str(args.nproc)],
            "dlrover_run": [_bin("dlrover"), "run", "--nproc-per-node", str(args.nproc), "--accelerator", "cpu",
                            "--log-dir", str(work / "runs")],
        }
        first: dict[str, list[float]] = {k: [] for k in sides}
        collective: dict[str, list[float]] = {k: [] for k in sides}
        step: dict[str, list[float]] = {k: [] for k in sides}
        done: dict[str, list[float]] = {k: [] for k in sides}
        for i in range(repeat + 1):
            for name, argv in sides.items():
                to_first, to_exit = one_run([*argv, "first.py"], work)
                to_collective, _ = one_run([*argv, "collective.py"], work, marker="FIRST_COLLECTIVE")
                to_step, _ = one_run([*argv, "step.py"], work, marker="FIRST_STEP")
                if i == 0:
                    continue  # warm-up of the page cache
                first[name].append(to_first)
                collective[name].append(to_collective)
                step[name].append(to_step)
                done[name].append(to_exit)
                print(f"run {i}: {name:12s} first line {to_first:.3f} s, first all-reduce {to_collective:.3f} s, "
                      f"first step {to_step:.3f} s, exit {to_exit:.3f} s", flush=True)
    result = {
        "benchmark": "launch",
        "command": "python benchmarks/launch.py" + (" --quick" if args.quick else f" --repeat {repeat}")
                   + (f" --nproc {args.nproc}" if args.nproc != 1 else ""),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)]},
        "nproc_per_node": args.nproc,
        "to_first_line": {k: summary(v) for k, v in first.items()},
        "to_first_all_reduce": {k: summary(v) for k, v in collective.items()},
        "to_first_step": {k: summary(v) for k, v in step.items()},
        "to_exit": {k: summary(v) for k, v in done.items()},
    }
    ours, peer = result["to_first_line"]["dlrover_run"]["median_s"], result["to_first_line"]["torchrun"]["median_s"]
    ours_c = result["to_first_all_reduce"]["dlrover_run"]["median_s"]
    peer_c = result["to_first_all_reduce"]["torchrun"]["median_s"]
    ours_s, peer_s = result["to_first_step"]["dlrover_run"]["median_s"], result["to_first_step"]["torchrun"]["median_s"]
    result["ratios"] = {
        "dlrover_minus_torchrun_s": round(ours - peer, 3),
        "dlrover_over_torchrun": round(ours / peer, 3),
        "first_all_reduce_dlrover_minus_torchrun_s": round(ours_c - peer_c, 3),
        "first_all_reduce_dlrover_over_torchrun": round(ours_c / peer_c, 3),
        "first_step_dlrover_minus_torchrun_s": round(ours_s - peer_s, 3),
        "first_step_dlrover_over_torchrun": round(ours_s / peer_s, 3),
        "goal_minus_s": 0.5,
        "met": ours - peer <= 0.5,
        "first_step_met": ours_s <= peer_s,
    }
    print(json.dumps(result["ratios"], indent=2))
    if args.json:
        write_result(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
