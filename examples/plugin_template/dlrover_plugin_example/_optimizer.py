"""SignSGD (Bernstein et al., 2018): step each parameter by the sign of its (momentum) gradient."""

from __future__ import annotations

import torch

__all__ = ["SignSGD"]


class SignSGD(torch.optim.Optimizer):
    """``p -= lr * sign(m)`` with ``m = momentum * m + (1 - momentum) * grad`` (``m = grad``
    when ``momentum`` is 0) and decoupled ``weight_decay``.

    Built by dlrover as ``SignSGD(params, **options)`` from ``Optimizer("signsgd", **options)``.
    """

    def __init__(self, params, lr: float = 1e-3, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        if not lr > 0:
            raise ValueError(f"signsgd: lr must be > 0, got {lr!r}")
        if not 0 <= momentum < 1:
            raise ValueError(f"signsgd: momentum must be in [0, 1), got {momentum!r}")
        if not weight_decay >= 0:
            raise ValueError(f"signsgd: weight_decay must be >= 0, got {weight_decay!r}")
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, momentum, decay = group["lr"], group["momentum"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                direction = p.grad
                if momentum:
                    buf = self.state[p].setdefault("momentum_buffer", torch.zeros_like(p))
                    buf.mul_(momentum).add_(p.grad, alpha=1 - momentum)
                    direction = buf
                if decay:
                    p.mul_(1 - lr * decay)
                p.add_(torch.sign(direction), alpha=-lr)
        return loss
