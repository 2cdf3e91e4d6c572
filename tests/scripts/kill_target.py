"""A job whose checkpoints are easy to verify: w = base + step, saved every step.

Ranks move in lock-step like DDP (an all-reduce before each save stands for the gradient
all-reduce), so no rank is more than one save ahead of another.

Every load checks bit-exactness (w == base + step, and the saved step agrees) and appends
{"attempt", "source", "step", "ok"} to --verify-file.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from dlrover_core import train


def expected(base: torch.Tensor, step: int) -> torch.Tensor:
    return base + float(step)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=100000)
    p.add_argument("--size-mb", type=float, default=32)
    p.add_argument("--step-sleep", type=float, default=0.01)
    p.add_argument("--verify-file", required=True)
    a = p.parse_args()
    info = train.init()
    base = torch.randn(int(a.size_mb * 2**20) // 4, generator=torch.Generator().manual_seed(1000 + info.rank))
    w = torch.empty_like(base)
    ckpt = train.Checkpointer()
    restored = ckpt.load()
    start = 0
    if restored is not None:
        step = restored.step
        ok = bool(torch.equal(restored.state["w"], expected(base, step)) and restored.state["meta"]["step"] == step)
        with open(a.verify_file, "a") as f:
            f.write(json.dumps({"rank": info.rank, "attempt": info.restart_count, "source": restored.source,
                                "step": step, "ok": ok, "pid": os.getpid()}) + "\n")
        start = step + 1
    for step in range(start, a.steps):
        torch.add(base, float(step), out=w)
        dist.all_reduce(torch.zeros(1))
        ckpt.save(step, {"w": w, "meta": {"step": step}})
        train.report(step)
        time.sleep(a.step_sleep)


if __name__ == "__main__":
    main()
