"""Every built-in parallel strategy on a real gloo world: losses, mesh groups, errors.

Run as each rank of a world (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set; the store is
hosted by the caller). For each case it builds the same small model (seed 0), applies the
case's strategies with ``train.prepare(parallel=...)`` (a strategy named ``tag`` comes from a plugin the caller
installed), trains STEPS steps on a fixed global
batch split evenly across the data-parallel ranks and records the global mean loss per step.
Rank 0 also trains the plain model on the whole batch in one process ("single"). Each rank
writes OUT_DIR/rank<R>.json: {case: {"losses": [...], "applied": [...], ...}}.
"""

import json
import sys
import traceback

import torch
import torch.distributed as dist
import torch.nn.functional as F

from dlrover_core import Optimizer, train
from dlrover_core.errors import JobSpecError
from dlrover_core.parallel import context as parallel_context
from dlrover_core.parallel import current_mesh

STEPS = 6
GLOBAL_BATCH = 8


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(d)
        self.fc1 = torch.nn.Linear(d, 4 * d)
        self.fc2 = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(torch.nn.Module):
    def __init__(self, d: int = 16, n: int = 2) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(8, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(n))
        self.head = torch.nn.Linear(d, 1)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def batch(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(GLOBAL_BATCH, 8, generator=g)
    return x, torch.sin(x).sum(1, keepdim=True)


def run_single() -> list[float]:
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def run_case(strategies, info) -> dict:
    torch.manual_seed(0)
    model, opt = train.prepare(Net(), parallel=strategies, optimizer=Optimizer("adamw", lr=1e-2))
    ctx = parallel_context._last
    dp = ctx.data_parallel_size
    dp_rank = ctx.mesh["data"].get_local_rank() if ctx.mesh is not None and dp > 1 else (info.rank if dp > 1 else 0)
    per = GLOBAL_BATCH // dp
    inner_dtypes, calls = set(), []

    def seen(module, args, out):
        inner_dtypes.add(str(out.dtype))
        calls.append(1)

    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    hook = inner.get_submodule("blocks.0.fc1").register_forward_hook(seen)
    losses = []
    for step in range(STEPS):
        x, y = batch(step)
        x, y = x[dp_rank * per:(dp_rank + 1) * per], y[dp_rank * per:(dp_rank + 1) * per]
        out = model(x)
        loss = F.mse_loss(out, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / info.world_size)
    hook.remove()
    result = {"losses": losses, "applied": ctx.applied, "inner_dtypes": sorted(inner_dtypes),
              "output_dtype": str(out.dtype), "sharded": ctx.sharded,
              "fc1_calls_per_step": len(calls) / STEPS,
              "param_types": sorted({type(p.data).__name__ for p in model.parameters()})}
    scale = getattr(opt, "_dlrover_loss_scale", None)
    if scale is not None:
        result["scaler"] = type(scale.scaler).__name__
        result["scale"] = scale.scaler.get_scale()
    mesh = current_mesh()
    if mesh is not None and mesh.mesh_dim_names:
        result["mesh"] = {n: dist.get_process_group_ranks(mesh.get_group(n)) for n in mesh.mesh_dim_names}
    result["model_tag"] = getattr(model, "tag", None)
    result["model_type"] = type(model).__name__
    result["optimizer_tag"] = opt.param_groups[0].get("tag")
    return result


CASES = {
    "ddp": ["ddp"],
    "fsdp": [("fsdp", {"wrap_class": "Block"})],
    "mesh_fsdp": [("mesh", [("data", 2), ("tensor", 1)]), ("fsdp", {"wrap_class": "Block"})],
    "mesh_tensor": [("mesh", [("data", 1), ("tensor", 2)]), "ddp"],
    "ckpt_ddp": [("checkpoint", {"wrap_class": "Block"}), "ddp"],
    "ckpt_fsdp": [("checkpoint", {"wrap_class": "Block"}), ("fsdp", {"wrap_class": "Block"})],
    "amp_bf16": ["ddp", ("amp", {"dtype": "bfloat16"})],
    "amp_fp16": ["ddp", ("amp", {"dtype": "float16", "init_scale": 256})],
    "amp_fp16_skips": ["ddp", ("amp", {"dtype": "float16"})],
    "amp_fp16_fsdp": [("fsdp", {"wrap_class": "Block"}), ("amp", {"dtype": "float16", "init_scale": 256})],
    "auto_roomy": [("auto", {"device_mb": 100000})],
    "auto_tight": [("auto", {"device_mb": 0.02})],
    "plugin": ["ddp", ("tag", {"value": "hello"})],
    "mesh_bad": [("mesh", [("data", 3)]), "ddp"],
    "ckpt_missing": [("checkpoint", {"wrap_class": "Attention"}), "ddp"],
}


def main() -> int:
    out_dir = sys.argv[1]
    only = sys.argv[2].split(",") if len(sys.argv) > 2 else list(CASES)
    info = train.init()
    results: dict = {}
    if info.rank == 0:
        results["single"] = {"losses": run_single()}
    for name in only:
        try:
            results[name] = run_case(CASES[name], info)
        except JobSpecError as exc:
            results[name] = {"error": str(exc), "field": exc.field}
        except Exception:
            results[name] = {"crash": traceback.format_exc()}
    with open(f"{out_dir}/rank{info.rank}.json", "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
