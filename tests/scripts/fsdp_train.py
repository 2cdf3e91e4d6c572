"""FSDP2 (fully_shard, DTensor) on CPU/gloo: save a checkpoint, or load one and compare.

--mode save: train --steps steps, force a checkpoint at the last one, write the full
  (unsharded) model and optimizer tensors' sha256 to --out.
--mode load: build the same model at this world size, load, write the same digest to --out.
"""

import argparse
import hashlib
import json

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from dlrover_core import train


def digest(tree) -> dict:
    out = {}

    def walk(node, path):
        if isinstance(node, dict):
            for k in sorted(node, key=str):
                walk(node[k], f"{path}/{k}")
        elif isinstance(node, torch.Tensor):
            full = node.full_tensor() if isinstance(node, DTensor) else node
            out[path] = hashlib.sha256(full.detach().contiguous().numpy().tobytes()).hexdigest()

    walk(tree, "")
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["save", "load"], required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    info = train.init()
    mesh = init_device_mesh("cpu", (info.world_size,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 6))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = train.ModelOptimizerState(model, optimizer)
    ckpt = train.Checkpointer()
    if a.mode == "save":
        for step in range(a.steps):
            torch.manual_seed(100 + step)
            model(torch.randn(4, 8)).pow(2).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            ckpt.save(step, {"train": state}, force=step == a.steps - 1)
    else:
        restored = ckpt.load({"train": state})
        assert restored is not None, "nothing to load"
    result = {"digest": digest(state.state_dict()), "world_size": info.world_size}
    if a.mode == "load":
        result.update(step=restored.step, source=restored.source)
    if info.rank == 0:
        with open(a.out, "w") as f:
            json.dump(result, f)
    dist.barrier()


if __name__ == "__main__":
    main()
