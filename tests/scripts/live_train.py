"""A small DDP job for the live-recovery tests: a linear model, an ElasticSampler, ``train.steps``.

Every applied step appends a JSON line to ``--out/steps_<pid>.jsonl``: the pid, the rank and
world size it held, the step, the sampler's position after it, this rank's sample ids and a
checksum of the parameters after the update. At the end each rank writes
``--out/final_<pid>.json`` with the final checksum. Args: --steps N, --samples N (dataset
size), --batch B (per rank at the start), --step-sleep S, --pace-file F (when F exists, its
number replaces --step-sleep: a test speeds up the steps it no longer watches; only the
sleep changes, never the steps, so ranks that read it at different steps stay in lockstep).
"""

import argparse
import atexit
import hashlib
import json
import os
import time
from pathlib import Path

import torch

from dlrover_core import train


def checksum(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def pace(path: str | None, default_s: float) -> float:
    try:
        return float(Path(path).read_text()) if path else default_s
    except (OSError, ValueError):  # not written yet (or being written)
        return default_s


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--samples", type=int, default=96)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--pace-file", default=None)
    p.add_argument("--abort-at-exit-once", default=None,
                   help="rank 0 aborts (SIGABRT) while exiting after its last step, unless this file exists "
                        "(it makes it): a native crash in interpreter teardown")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    info = train.init()
    torch.manual_seed(0)
    model, opt = train.prepare(torch.nn.Linear(8, 1), lr=0.01)
    sampler = train.ElasticSampler(a.samples, a.batch, seed=7)
    data = torch.randn(a.samples, 8, generator=torch.Generator().manual_seed(3))
    ckpt = train.Checkpointer()
    state = {"model": model, "optimizer": opt, "sampler": sampler}
    restored = ckpt.load(state)
    log = open(out / f"steps_{os.getpid()}.jsonl", "a", buffering=1)
    for step in train.steps(a.steps, state, start=restored.step + 1 if restored else 0):
        with step:
            ids = sampler.next_batch()
            if ids is None:
                ids = sampler.next_batch()
            opt.zero_grad(set_to_none=True)
            x = data[ids] if ids else torch.zeros(0, 8)
            # a global-batch mean, whatever this rank's share
            loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).sum() * step.world_size / sampler.global_batch_size
            loss.backward()
            time.sleep(pace(a.pace_file, a.step_sleep))
            opt.step()
            log.write(json.dumps({"pid": os.getpid(), "rank": step.rank, "world_size": step.world_size,
                                  "step": int(step), "epoch": sampler.epoch, "consumed": sampler.consumed,
                                  "ids": ids, "params": checksum(model), "t": time.time()}) + "\n")
            train.report(step, loss=loss.item())
            ckpt.save(step, state, force=step == a.steps - 1)
    (out / f"final_{os.getpid()}.json").write_text(json.dumps({"params": checksum(model), "rank": info.rank}))
    if a.abort_at_exit_once and info.rank == 0 and not os.path.exists(a.abort_at_exit_once):
        Path(a.abort_at_exit_once).touch()
        atexit.register(os.abort)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
