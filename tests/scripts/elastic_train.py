"""Elastic DDP job that logs which samples each rank trained on, per step.

Every rank appends {"kind": "step", round, step, rank, world, epoch, ids} to
OUT_DIR/rank<R>_round<N>.jsonl after each step, and {"kind": "restored", round, step} after
loading a checkpoint, so a test can rebuild the lineage of the final model and check that
every sample of an epoch was used exactly once across world-size changes.
"""

import argparse
import json
import os
import time

import torch

from dlrover_core import train


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out_dir")
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--dataset", type=int, default=300)
    p.add_argument("--batch", type=int, default=3)
    p.add_argument("--step-sleep", type=float, default=0.05)
    a = p.parse_args()
    info = train.init()
    torch.manual_seed(0)
    model, optimizer = train.prepare(torch.nn.Linear(1, 1), lr=0.01)
    sampler = train.ElasticSampler(a.dataset, a.batch, seed=0)
    ckpt = train.Checkpointer()
    restored = ckpt.load({"model": model, "optimizer": optimizer, "sampler": sampler})
    path = os.path.join(a.out_dir, f"rank{info.rank}_round{info.round}.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps({"kind": "restored", "round": info.round, "rank": info.rank, "world": info.world_size,
                            "step": restored.step if restored else -1,
                            "source": restored.source if restored else None}) + "\n")
        step = restored.step + 1 if restored else 0
        while step < a.steps:
            ids = sampler.next_batch()
            if ids is None:
                sampler.set_epoch(sampler.epoch + 1)
                ids = sampler.next_batch()
            epoch = sampler.epoch
            x = torch.tensor(ids, dtype=torch.float32).reshape(-1, 1) / a.dataset
            loss = model(x).pow(2).mean() if ids else sum(p.sum() * 0 for p in model.parameters())
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            f.write(json.dumps({"kind": "step", "round": info.round, "step": step, "rank": info.rank,
                                "world": info.world_size, "epoch": epoch, "ids": ids}) + "\n")
            f.flush()
            train.report(step, loss=float(loss))
            ckpt.save(step, {"model": model, "optimizer": optimizer, "sampler": sampler})
            step += 1
            time.sleep(a.step_sleep)


if __name__ == "__main__":
    main()
