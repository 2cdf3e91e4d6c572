"""The worker of ../shared/repro/below-min: a data-parallel step (an all-reduce) every 0.1 s,
a checkpoint every step. With --no-collective it trains alone: nothing makes it notice that
the other ranks of its world are gone."""

import argparse
import time

import torch
import torch.distributed as dist

from dlrover_core import train

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=1000)
p.add_argument("--no-collective", action="store_true")
a = p.parse_args()

train.init()
model = torch.nn.Linear(4, 4)
ckpt = train.Checkpointer()
restored = ckpt.load({"model": model})
for step in range(restored.step + 1 if restored else 0, a.steps):
    if not a.no_collective:
        t = torch.ones(1)
        dist.all_reduce(t)  # a data-parallel step: every rank takes part
    train.report(step, loss=0.0)
    ckpt.save(step, {"model": model})
    time.sleep(0.1)
