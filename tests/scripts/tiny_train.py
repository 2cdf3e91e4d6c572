"""A tiny DDP job for the end-to-end tests: a linear model on synthetic data.

Args: --steps N, --fail-at STEP (exit --exit-code at the first step >= STEP, on the first attempt of rank
--fail-rank), --fail-always (fail at --fail-at on every attempt), --out PATH (rank 0 writes the
final parameters' sha256), --step-sleep S (slow steps down), --spawn-grandchild (start a
`sleep` that outlives nobody), --sigterm-file PATH (on SIGTERM, write PATH and exit 0).
"""

import argparse
import hashlib
import os
import signal
import subprocess
import sys
import time

import torch

from dlrover_core import train


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--fail-at", type=int, default=-1)
    p.add_argument("--fail-rank", type=int, default=0)
    p.add_argument("--fail-always", action="store_true")
    p.add_argument("--exit-code", type=int, default=3)
    p.add_argument("--out", default="")
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--spawn-grandchild", action="store_true")
    p.add_argument("--sigterm-file", default="")
    p.add_argument("--extra-mb", type=float, default=0.0, help="checkpoint this many MiB more (a buffer)")
    p.add_argument("--fail-node", type=int, default=-1, help="the node with this id exits at --fail-at, always")
    p.add_argument("--raise-at", type=int, default=-1, help="every rank raises the same ValueError at this step")
    a = p.parse_args()
    if a.sigterm_file:
        def on_term(signum, frame):
            with open(f"{a.sigterm_file}.{os.environ['RANK']}", "w") as f:
                f.write("SIGTERM")
            os._exit(0)

        signal.signal(signal.SIGTERM, on_term)
    if a.spawn_grandchild:
        subprocess.Popen(["sleep", "600"])
    info = train.init()
    torch.manual_seed(0)
    model, opt = train.prepare(torch.nn.Linear(8, 1), lr=0.01)
    ckpt = train.Checkpointer()
    extra = torch.zeros(int(a.extra_mb * 2**20) // 4)
    restored = ckpt.load({"model": model, "optimizer": opt, "extra": extra})
    start = restored.step + 1 if restored else 0
    g = torch.Generator().manual_seed(1234 + info.rank)
    for step in range(start, a.steps):
        if step == a.raise_at:  # a bug in the forward pass: before the step is saved
            raise ValueError(f"bad batch at step {step}: shape mismatch")
        g.manual_seed(1234 + info.rank * 100_000 + step)
        x = torch.randn(16, 8, generator=g)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        train.report(step, loss=loss.item())
        if a.step_sleep:
            time.sleep(a.step_sleep)
        extra.fill_(step)
        ckpt.save(step, {"model": model, "optimizer": opt, "extra": extra})
        if a.fail_node >= 0 and step >= a.fail_at and os.environ.get("DLROVER_NODE_ID") == str(a.fail_node):
            print(f"node {a.fail_node} fails again at step {step}", flush=True)
            os._exit(a.exit_code)
        first = info.restart_count == 0
        if step >= a.fail_at >= 0 and info.rank == a.fail_rank and (first or a.fail_always):
            print(f"failing on purpose at step {step}", flush=True)
            sys.stdout.flush()
            os._exit(a.exit_code)
    if info.rank == 0 and a.out:
        h = hashlib.sha256()
        for t in model.state_dict().values():
            h.update(t.detach().cpu().numpy().tobytes())
        with open(a.out, "w") as f:
            f.write(h.hexdigest())
    return 0


if __name__ == "__main__":
    sys.exit(main())
