"""A DDP job for the checkpoint durability tests.

Args: --steps N; --step-sleep S; --force-last (the last save is forced); --save-rank0-only
(misuse: only rank 0 saves); --ignore-restore (misuse: the loop starts at 0 whatever
load() restored); --noise (after every restart, add noise seeded by the round to the
weights, the same on every rank: each incarnation's state differs, so a checkpoint mixing
incarnations is detectable); --raise-before-first-step (every rank raises the same error
before training).
"""

import argparse
import os
import time

import torch

from dlrover_core import train


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--step-sleep", type=float, default=0.0)
    p.add_argument("--force-last", action="store_true")
    p.add_argument("--save-rank0-only", action="store_true")
    p.add_argument("--ignore-restore", action="store_true")
    p.add_argument("--noise", action="store_true")
    a = p.parse_args()
    info = train.init()
    torch.manual_seed(0)
    model, opt = train.prepare(torch.nn.Linear(16, 16), lr=0.01)
    ckpt = train.Checkpointer()
    restored = ckpt.load({"model": model, "optimizer": opt})
    start = restored.step + 1 if restored and not a.ignore_restore else 0
    if a.noise and int(os.environ.get("DLROVER_ROUND", "0")) > 0:
        g = torch.Generator().manual_seed(int(os.environ["DLROVER_ROUND"]))
        with torch.no_grad():
            for param in model.parameters():
                param.add_(1e-3 * torch.randn(param.shape, generator=g))
    for step in range(start, a.steps):
        g = torch.Generator().manual_seed(1000 * info.rank + step)
        x = torch.randn(8, 16, generator=g)
        loss = ((model(x) - x) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        train.report(step, loss=loss.item())
        if a.step_sleep:
            time.sleep(a.step_sleep)
        if a.save_rank0_only and info.rank != 0:
            continue
        ckpt.save(step, {"model": model, "optimizer": opt}, force=a.force_last and step == a.steps - 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
