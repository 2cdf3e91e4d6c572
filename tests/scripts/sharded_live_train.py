"""A small FSDP2 job for the sharded live-recovery tests (``Job(parallel=Parallel("fsdp"))``):
``train.prepare`` shards a 3-layer MLP, every step's batch is seeded by the step and the
rank, ``train.steps`` loops, the Checkpointer snapshots every step to memory.

Every applied step appends a JSON line to ``--out/steps_<pid>.jsonl`` (pid, rank, world
size, step, this rank's shard checksum, the step's start and end times). At the end every rank writes
``--out/final_<pid>.json`` (rank, pid, the step it started the loop at) and rank 0 the
sha256 of the full (all-gathered) parameters and optimizer state to ``--out/final.json``.
Args: --steps N, --step-sleep S, --width W (the hidden layers' width: the state's size;
benchmarks/sharded_recovery.py scales it), --hold-file F (while F exists, each step waits at
its start: a test holds the job still, e.g. until a buddy's replica is current),
--prepare-parallel NAME (passed to ``train.prepare`` instead of the Job's strategies),
--die-before-last-replicate-all-reduce RANK:STEP (that rank SIGKILLs itself at that step
inside its backward, right before its last all-reduce over a replicate group (HSDP), after
its last reduce-scatter: the ranks that do not share its shard could finish the step).
"""

import argparse
import hashlib
import json
import os
import signal
import time
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from dlrover_core import train


def full_digest(tree) -> str:
    h = hashlib.sha256()

    def walk(node, path):
        if isinstance(node, dict):
            for k in sorted(node, key=str):
                walk(node[k], f"{path}/{k}")
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(v, f"{path}/{i}")
        elif isinstance(node, torch.Tensor):
            full = node.full_tensor() if isinstance(node, DTensor) else node
            h.update(path.encode())
            h.update(full.detach().contiguous().numpy().tobytes())

    walk(tree, "")
    return h.hexdigest()


def shard_digest(model) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        local = t.to_local() if isinstance(t, DTensor) else t
        h.update(name.encode())
        h.update(local.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def die_before_last_replicate_all_reduce(rank: int, step: int, current: list[int], out: Path) -> None:
    """Wrap ``torch.distributed.all_reduce`` (FSDP2 reduces HSDP gradients over the
    replicate group with it): on ``rank`` at ``step`` (``current[0]``), SIGKILL this process
    instead of the step's last such all-reduce (counted on the step before); once per job
    (a marker file in ``out``)."""
    import torch.distributed as dist

    real, calls = dist.all_reduce, {}

    def all_reduce(*args, **kwargs):
        if kwargs.get("group") is not None:  # a mesh dimension's group, not the world's
            now = current[0]
            calls[now] = calls.get(now, 0) + 1
            marker = out / f"died_{rank}_{step}"
            if dist.get_rank() == rank and now == step and calls[now] == calls.get(step - 1) and not marker.exists():
                marker.touch()
                os.kill(os.getpid(), signal.SIGKILL)
        return real(*args, **kwargs)

    dist.all_reduce = all_reduce


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--step-sleep", type=float, default=0.05)
    p.add_argument("--width", type=int, default=16)
    p.add_argument("--hold-file", default=None)
    p.add_argument("--prepare-parallel", default=None, help="strategy given to train.prepare (not the Job's)")
    p.add_argument("--die-before-last-replicate-all-reduce", default=None, metavar="RANK:STEP")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    current = [-1]
    if a.die_before_last_replicate_all_reduce:
        rank, at = (int(v) for v in a.die_before_last_replicate_all_reduce.split(":"))
        die_before_last_replicate_all_reduce(rank, at, current, out)
    info = train.init()
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, a.width), torch.nn.ReLU(), torch.nn.Linear(a.width, a.width),
                              torch.nn.ReLU(), torch.nn.Linear(a.width, 4))
    parallel = [a.prepare_parallel] if a.prepare_parallel else None
    model, opt = train.prepare(net, lr=0.01, parallel=parallel)
    state = train.ModelOptimizerState(model, opt)
    ckpt = train.Checkpointer()
    restored = ckpt.load({"train": state})
    start = restored.step + 1 if restored else 0
    log = open(out / f"steps_{os.getpid()}.jsonl", "a", buffering=1)
    for step in train.steps(a.steps, {"train": state}, start=start):
        current[0] = int(step)
        with step:
            while a.hold_file and os.path.exists(a.hold_file):
                time.sleep(0.02)
            t0 = time.time()
            gen = torch.Generator().manual_seed(1000 + 10 * int(step) + step.rank)
            x = torch.randn(4, 8, generator=gen)
            opt.zero_grad(set_to_none=True)
            loss = model(x).pow(2).mean()
            loss.backward()
            time.sleep(a.step_sleep)
            opt.step()
            log.write(json.dumps({"pid": os.getpid(), "rank": step.rank, "world_size": step.world_size,
                                  "step": int(step), "shard": shard_digest(model), "t0": t0, "t": time.time()}) + "\n")
            train.report(step, loss=loss.item())
            ckpt.save(step, {"train": state}, force=step == a.steps - 1)
    digest = full_digest(state.state_dict())  # (a collective: every rank)
    (out / f"final_{os.getpid()}.json").write_text(json.dumps({"rank": info.rank, "pid": os.getpid(),
                                                              "start": start}))
    if info.rank == 0:
        (out / "final.json").write_text(json.dumps({"digest": digest}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
