"""CPU cost of a small job whose nodes share one host: dlrover-core and torchrun side by side.

    python benchmarks/job_cpu.py [--repeat N] [--nodes N] [--steps N] [--json PATH]

The same torchrun-style DDP script (gloo, a 256x256 linear model, ``--steps`` AdamW steps) runs
as a job of ``--nodes`` nodes with one worker each, every node on this machine:

* **torchrun**: one ``torchrun --nnodes N --nproc-per-node 1 --rdzv-backend c10d`` per node
  (its documented multi-node launch; the rendezvous on a free local port), each starting
  its worker as a fresh process.
* **dlrover_shared**: ``Job(nodes=N, accelerator="cpu").run()`` on the local scheduler: a
  job master, an agent per node, the nodes' warm standbys forked from one shared process
  (``dlrover_core/agent/zygote.py``), workers forked from the standbys.
* **dlrover_per_node**: the same with ``DLROVER_SHARED_STANDBY=0``: a standby process per
  node, each importing torch itself (dlrover-core before this version).

The figure is the CPU time (user + system) of every process of the run, the launcher's
included: this process makes itself a child subreaper (``PR_SET_CHILD_SUBREAPER``,
``prctl(2)``), so processes that leave their parent's tree come back to it, and it reads
``getrusage(RUSAGE_CHILDREN)`` before and after each run, once every descendant has been
reaped. Sides alternate run by run, after one discarded warm-up run each; reported are
median, min and max over ``--repeat`` runs, and ``ratios`` of medians. Wall time from the
start to the end of each run is reported too.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import platform
import resource
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _results import summary, write_result  # noqa: E402  (benchmarks/ is the script's directory)

SCRIPT = """
import os, torch, torch.distributed as dist
dist.init_process_group("gloo")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(256, 256))
opt = torch.optim.AdamW(model.parameters())
for step in range(int(os.environ.get("BENCH_STEPS", "20"))):
    opt.zero_grad()
    model(torch.randn(32, 256)).pow(2).mean().backward()
    opt.step()
dist.destroy_process_group()
"""

DLROVER_RUNNER = """
import sys
from dlrover_core import Failure, Job, JobState, Nodes
script, nodes, log_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
result = Job(name="jobcpu", entrypoint=script, nodes=Nodes(min=nodes, max=nodes, nproc_per_node=1),
             accelerator="cpu", failure=Failure(max_restarts=0), log_dir=log_dir).run(progress=False)
sys.exit(0 if result.state == JobState.SUCCEEDED else 1)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _reap_all(timeout_s: float = 60.0) -> None:
    """Wait for every descendant (orphans come back to this subreaper) to exit and be reaped."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            time.sleep(0.02)
    raise RuntimeError("descendants still running after the run")


def one_run(side: str, work: Path, nodes: int, steps: int) -> tuple[float, float]:
    env = {**os.environ, "BENCH_STEPS": str(steps), "OMP_NUM_THREADS": "1"}
    script = str(work / "train.py")
    before = _children_cpu_s()
    start = time.monotonic()
    if side == "torchrun":
        port = _free_port()
        torchrun = str(Path(sys.executable).with_name("torchrun"))
        procs = [subprocess.Popen([torchrun, "--nnodes", str(nodes), "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                                   "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "jobcpu", script],
                                  env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for _ in range(nodes)]
    else:
        if side == "dlrover_per_node":
            env["DLROVER_SHARED_STANDBY"] = "0"
        procs = [subprocess.Popen([sys.executable, "-c", DLROVER_RUNNER, script, str(nodes), str(work / "runs")],
                                  env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    codes = [p.wait(timeout=600) for p in procs]
    wall = time.monotonic() - start
    _reap_all()
    if any(codes):
        raise RuntimeError(f"{side}: exit codes {codes}")
    return _children_cpu_s() - before, wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="runs per side (after one warm-up run each)")
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", default=None, help="write the result here")
    args = parser.parse_args()
    if sys.platform != "linux":
        print("needs Linux (PR_SET_CHILD_SUBREAPER)", file=sys.stderr)
        return 2
    if ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) != 0:  # PR_SET_CHILD_SUBREAPER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    sides = ("torchrun", "dlrover_shared", "dlrover_per_node")
    cpu: dict[str, list[float]] = {s: [] for s in sides}
    wall: dict[str, list[float]] = {s: [] for s in sides}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="dlrover-jobcpu-") as tmp:
        work = Path(tmp)
        (work / "train.py").write_text(SCRIPT)
        for i in range(args.repeat + 1):
            for side in sides:
                cpu_s, wall_s = one_run(side, work, args.nodes, args.steps)
                if i == 0:
                    continue  # warm-up of the page cache
                cpu[side].append(cpu_s)
                wall[side].append(wall_s)
                print(f"run {i}: {side:17s} CPU {cpu_s:6.2f} s  wall {wall_s:6.2f} s", flush=True)
    result = {
        "benchmark": "job_cpu",
        "command": f"python benchmarks/job_cpu.py --repeat {args.repeat} --nodes {args.nodes} --steps {args.steps}",
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)]},
        "nodes": args.nodes, "steps": args.steps,
        "cpu": {k: summary(v) for k, v in cpu.items()},
        "wall": {k: summary(v) for k, v in wall.items()},
    }
    med = {k: result["cpu"][k]["median_s"] for k in sides}
    result["ratios"] = {
        "cpu_shared_over_per_node": round(med["dlrover_shared"] / med["dlrover_per_node"], 3),
        "cpu_shared_over_torchrun": round(med["dlrover_shared"] / med["torchrun"], 3),
        "cpu_per_node_over_torchrun": round(med["dlrover_per_node"] / med["torchrun"], 3),
    }
    print(json.dumps(result["ratios"], indent=2))
    if args.json:
        write_result(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
