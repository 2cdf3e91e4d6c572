"""Part ``optim``: AGD against fused AdamW — the optimizer step's time on the same model.

    python benchmarks/gpu/optim_step.py --out optim.json [--device cuda|cpu] [--tiny]

The model is ``examples/charlm``'s byte-level GPT, widened (default ``d_model`` 1024, 8
layers, 16 heads, about 100M parameters; ``--tiny``: 64 wide, 2 layers), on ``cuda:0``,
float32. Each optimizer is built the way ``train.prepare`` builds it, from dlrover's
optimizer registry: ``adamw`` with ``fused=True`` (torch's single-kernel AdamW),
``adamw`` with ``foreach=True`` (torch's default on CUDA) and ``agd`` (dlrover-plugin-optim-agd,
its ``torch._foreach_*`` path). The same parameters (reset between optimizers) and the same
real gradients (one backward pass) for all three.

* ``step_ms``: ``optimizer.step()`` alone, device synchronised, median of ``--reps``
  (default 50) after 5 warm-ups (the first allocates the state);
* ``train_step_ms``: zero_grad + forward + backward + step on a fixed batch (median of 20);
* ``state_bytes``: the optimizer state's tensor bytes.

``figures``: ``params``, ``agd_step_ms``, ``adamw_fused_step_ms``, ``adamw_foreach_step_ms``,
``agd_vs_adamw_fused`` and ``agd_vs_adamw_foreach`` (step time ratios; ``benchmarks/optim.py``'s
goal for AGD is <= 1.15 against AdamW), ``agd_train_step_ms``, ``adamw_fused_train_step_ms``,
``train_step_agd_vs_adamw_fused``.
"""

from __future__ import annotations

import sys
from typing import Any

import _common as c

CONFIGS = {
    "adamw_fused": ("adamw", {"lr": 1e-3, "weight_decay": 0.01, "fused": True}),
    "adamw_foreach": ("adamw", {"lr": 1e-3, "weight_decay": 0.01, "foreach": True}),
    "agd": ("agd", {"lr": 1e-4, "weight_decay": 0.01}),
}


def body(args: Any, result: dict[str, Any], deadline: c.Deadline) -> None:
    import torch  # heavy: torch

    from dlrover_core.plugins import get_host

    sys.path.insert(0, str(c.REPO / "examples" / "charlm"))
    from model import CharLM, loss_fn

    device = args.device
    if device == "cuda":
        torch.cuda.set_device(0)
    shape = (dict(block_size=32, d_model=64, n_layer=2, n_head=2) if args.tiny
             else dict(block_size=256, d_model=1024, n_layer=8, n_head=16))
    batch = 4 if args.tiny else 16
    reps = args.reps or (3 if args.tiny else 50)
    train_reps = 2 if args.tiny else 20
    torch.manual_seed(0)
    model = CharLM(dropout=0.0, **shape).to(device)
    params = sum(p.numel() for p in model.parameters())
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randint(0, 256, (batch, shape["block_size"]), device=device)
    y = torch.randint(0, 256, (batch, shape["block_size"]), device=device)
    registry = get_host().registries.optimizer
    result.update(model={**shape, "batch": batch, "params": params, "dtype": "float32"}, reps=reps, optimizers={})
    for name, (registered, options) in CONFIGS.items():
        try:
            factory = registry.get(registered)
        except Exception as exc:
            raise RuntimeError(f"optimizer {registered!r} is not registered ({exc}); "
                               "pip install -e plugins/optim_agd") from exc
        model.load_state_dict(initial)
        model.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt = factory(model.parameters(), **options)
        steps = c.timed(opt.step, reps=reps, warmup=5 if not args.tiny else 1, device=device)

        def train_step(opt: Any = opt) -> None:
            opt.zero_grad(set_to_none=True)
            loss_fn(model(x), y).backward()
            opt.step()

        train = c.timed(train_step, reps=train_reps, warmup=3 if not args.tiny else 1, device=device)
        state_bytes = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values()
                          if isinstance(v, torch.Tensor))
        result["optimizers"][name] = {
            "registered": registered, "options": options, "class": type(opt).__name__,
            "step_ms": c.r(c.med(steps) * 1e3, 4), "step_samples_ms": [c.r(s * 1e3, 4) for s in steps],
            "train_step_ms": c.r(c.med(train) * 1e3, 4), "state_bytes": state_bytes}
        del opt
        if not torch.isfinite(torch.stack([p.detach().float().abs().max() for p in model.parameters()])).all():
            raise RuntimeError(f"{name}: parameters are not finite after its steps")
    o = result["optimizers"]
    result["figures"].update(
        params=params, agd_step_ms=o["agd"]["step_ms"], adamw_fused_step_ms=o["adamw_fused"]["step_ms"],
        adamw_foreach_step_ms=o["adamw_foreach"]["step_ms"],
        agd_vs_adamw_fused=c.ratio(o["agd"]["step_ms"], o["adamw_fused"]["step_ms"]),
        agd_vs_adamw_foreach=c.ratio(o["agd"]["step_ms"], o["adamw_foreach"]["step_ms"]),
        agd_train_step_ms=o["agd"]["train_step_ms"], adamw_fused_train_step_ms=o["adamw_fused"]["train_step_ms"],
        train_step_agd_vs_adamw_fused=c.ratio(o["agd"]["train_step_ms"], o["adamw_fused"]["train_step_ms"]))
    f = result["figures"]
    print(f"optim: {params / 1e6:.1f}M params; step AGD {f['agd_step_ms']} ms, AdamW fused {f['adamw_fused_step_ms']} "
          f"ms, foreach {f['adamw_foreach_step_ms']} ms (AGD/fused {f['agd_vs_adamw_fused']})", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = c.parser(__doc__)
    p.add_argument("--reps", type=int, default=None, help="timed optimizer steps (default 50; tiny 3)")
    return c.run("optim", p.parse_args(argv), body)


if __name__ == "__main__":
    sys.exit(main())
