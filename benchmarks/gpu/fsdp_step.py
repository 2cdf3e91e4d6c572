"""Part ``fsdp``: FSDP2 (``fully_shard``) on one GPU through ``train.prepare`` — step time and
peak memory of a small transformer, against the same model without FSDP.

    python benchmarks/gpu/fsdp_step.py --out fsdp.json [--device cuda|cpu] [--tiny] [--steps 10]

``train.init()`` makes a one-process group (NCCL on ``cuda:0``; the accelerator is given by
``DLROVER_ACCELERATOR``, as an agent would), then three variants of ``examples/charlm``'s
GPT (default 1024 wide, 12 layers, 16 heads, context 512, batch 8; ``--tiny``: 64 wide, 2
layers), same seed, same fixed batch, AdamW (lr 1e-3):

* ``plain``: the model on the device, no wrapper;
* ``fsdp``: ``train.prepare(model, parallel=[("fsdp", {"wrap_class": "Block"})])``: every
  ``Block`` and the root ``fully_shard``-ed on a one-rank mesh (float32);
* ``fsdp_bf16``: the same with ``param_dtype="bfloat16"``, ``reduce_dtype="float32"``.

Per variant: ``step_ms`` (median of ``--steps`` after 3 warm-ups; forward, backward,
optimizer step, device synchronised), ``tokens_per_s``, ``peak_mem_mib``
(``torch.cuda.max_memory_allocated``; null on cpu), ``first_loss`` / ``last_loss``.
Checks: FSDP's first loss equals the plain model's (one rank: same math; 1e-4), the loss
falls over the steps, everything is finite.

``figures``: ``params``, ``plain_step_ms``, ``fsdp_step_ms``, ``fsdp_bf16_step_ms``,
``fsdp_vs_plain`` (step time ratio), ``plain_peak_mem_mib``, ``fsdp_peak_mem_mib``,
``fsdp_bf16_peak_mem_mib``, ``fsdp_tokens_per_s``.
"""

from __future__ import annotations

import gc
import math
import os
import sys
from typing import Any

import _common as c

VARIANTS = {
    "plain": None,
    "fsdp": [("fsdp", {"wrap_class": "Block"})],
    "fsdp_bf16": [("fsdp", {"wrap_class": "Block", "param_dtype": "bfloat16", "reduce_dtype": "float32"})],
}


def body(args: Any, result: dict[str, Any], deadline: c.Deadline) -> None:
    os.environ["DLROVER_ACCELERATOR"] = args.device  # what the agent tells its workers
    import torch  # heavy: torch
    import torch.distributed as dist  # heavy: torch

    from dlrover_core import Optimizer, train

    sys.path.insert(0, str(c.REPO / "examples" / "charlm"))
    from model import CharLM, loss_fn

    shape = (dict(block_size=32, d_model=64, n_layer=2, n_head=2) if args.tiny
             else dict(block_size=512, d_model=1024, n_layer=12, n_head=16))
    batch = 4 if args.tiny else 8
    steps = args.steps or (3 if args.tiny else 10)
    warmup = 1 if args.tiny else 3
    info = train.init()
    device = info.device
    result.update(backend=dist.get_backend(), device_name=str(device), world_size=dist.get_world_size(),
                  model={**shape, "batch": batch}, steps=steps, variants={})
    try:
        gen = torch.Generator().manual_seed(1)
        x = torch.randint(0, 256, (batch, shape["block_size"]), generator=gen).to(device)
        y = torch.randint(0, 256, (batch, shape["block_size"]), generator=gen).to(device)
        for name, parallel in VARIANTS.items():
            torch.manual_seed(0)
            model = CharLM(dropout=0.0, **shape).to(device)
            params = sum(p.numel() for p in model.parameters())
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            if parallel is None:
                opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            else:
                model, opt = train.prepare(model, parallel=parallel, optimizer=Optimizer("adamw", lr=1e-3))
            losses: list[float] = []

            def step(model: Any = model, opt: Any = opt, losses: list[float] = losses) -> None:
                opt.zero_grad(set_to_none=True)
                loss = loss_fn(model(x), y)
                loss.backward()
                opt.step()
                losses.append(loss.detach())

            samples = c.timed(step, reps=steps, warmup=warmup, device=device.type)
            losses = [float(v) for v in losses]
            peak = torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda" else None
            step_s = c.med(samples)
            result["variants"][name] = {
                "parallel": parallel, "params": params, "step_ms": c.r(step_s * 1e3, 4),
                "samples_ms": [c.r(s * 1e3, 4) for s in samples],
                "tokens_per_s": c.r(batch * shape["block_size"] / step_s, 4),
                "peak_mem_mib": c.r(peak, 5), "first_loss": losses[0], "last_loss": losses[-1],
                "sharded": any(type(p).__name__ == "DTensor" for p in model.parameters()),
            }
            if not all(math.isfinite(v) for v in losses):
                raise RuntimeError(f"{name}: non-finite loss {losses}")
            del model, opt
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    v = result["variants"]
    result["figures"].update(
        params=v["plain"]["params"], plain_step_ms=v["plain"]["step_ms"], fsdp_step_ms=v["fsdp"]["step_ms"],
        fsdp_bf16_step_ms=v["fsdp_bf16"]["step_ms"], fsdp_vs_plain=c.ratio(v["fsdp"]["step_ms"], v["plain"]["step_ms"]),
        plain_peak_mem_mib=v["plain"]["peak_mem_mib"], fsdp_peak_mem_mib=v["fsdp"]["peak_mem_mib"],
        fsdp_bf16_peak_mem_mib=v["fsdp_bf16"]["peak_mem_mib"], fsdp_tokens_per_s=v["fsdp"]["tokens_per_s"])
    f = result["figures"]
    print(f"fsdp: {f['params'] / 1e6:.1f}M params; step plain {f['plain_step_ms']} ms, FSDP2 {f['fsdp_step_ms']} ms, "
          f"FSDP2 bf16 {f['fsdp_bf16_step_ms']} ms; peak {f['plain_peak_mem_mib']} / {f['fsdp_peak_mem_mib']} / "
          f"{f['fsdp_bf16_peak_mem_mib']} MiB", flush=True)
    problems = []
    if not (v["fsdp"]["sharded"] and v["fsdp_bf16"]["sharded"]):
        problems.append("train.prepare with fsdp left the parameters plain tensors (not fully_shard-ed)")
    if abs(v["fsdp"]["first_loss"] - v["plain"]["first_loss"]) > 1e-4:
        problems.append(f"FSDP's first loss {v['fsdp']['first_loss']} differs from the plain model's "
                        f"{v['plain']['first_loss']}")
    for name, row in v.items():
        if not row["last_loss"] < row["first_loss"]:
            problems.append(f"{name}: the loss did not fall ({row['first_loss']} -> {row['last_loss']})")
    if problems:
        raise RuntimeError("; ".join(problems))


def main(argv: list[str] | None = None) -> int:
    p = c.parser(__doc__)
    p.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 10; tiny 3)")
    return c.run("fsdp", p.parse_args(argv), body)


if __name__ == "__main__":
    sys.exit(main())
