"""Soak the Flash Checkpoint kill tests: ``python tests/soak_checkpoint.py --runs 100``.

Half the runs SIGKILL a random worker (ten kills per job), half SIGKILL a node's agent (one
job each); every run checks that storage holds a whole, bit-exact committed step and that
restores are bit-exact. Prints one line per job and a summary; exits 1 on the first failure.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from kill_harness import agent_kill, worker_kills  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=100, help="seeded runs in total (kills)")
    p.add_argument("--first-seed", type=int, default=1000)
    a = p.parse_args()
    worker_runs = a.runs // 2
    agent_runs = a.runs - worker_runs
    sources: Counter[str] = Counter()
    t0 = time.monotonic()
    seed = a.first_seed
    done = 0
    while done < worker_runs:
        kills = min(10, worker_runs - done)
        with tempfile.TemporaryDirectory() as tmp:
            report = worker_kills(Path(tmp), seed=seed, kills=kills)
        sources.update(d["source"] for d in report["decisions"])
        print(f"worker-kill seed {seed}: {kills} kills, restores {[d['source'][0] + str(d['step']) for d in report['decisions']]}",
              flush=True)
        done += kills
        seed += 1
    for _ in range(agent_runs):
        with tempfile.TemporaryDirectory() as tmp:
            report = agent_kill(Path(tmp), seed=seed)
        print(f"agent-kill seed {seed}: node {report['node']}, committed {report['committed_before']} -> {report['committed']}",
              flush=True)
        seed += 1
    print(f"{a.runs} runs passed in {time.monotonic() - t0:.0f} s; worker-kill restores: {dict(sources)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
