r"""AGD, an auto-switchable optimizer, as a :class:`torch.optim.Optimizer`.

Source: Yun Yue, Zhiling Ye, Jiadi Jiang, Yongchao Liu, Ke Zhang, "AGD: an Auto-switchable
Optimizer using Stepwise Gradient Difference for Preconditioning Matrix", NeurIPS 2023,
https://arxiv.org/abs/2312.01658 (the update is the paper's Algorithm 1). Options beyond the
paper (``weight_decouple``, ``fixed_decay``, ``amsgrad``, ``win``, ``clip``) and their defaults
follow the authors' reference implementation, ``atorch/atorch/optimizers/agd.py`` in
https://github.com/intelligent-machine-learning/dlrover. This is an independent implementation
of those equations, vectorised over a parameter group.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from dlrover_core.backend import get_logger

__all__ = ["AGD"]

def _check_number(name: str, value: Any, *, low: float, low_inclusive: bool, high: float | None = None) -> float:
    """``float(value)`` if it is a finite real in the interval, else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"AGD: {name} must be a finite number, got {value!r}")
    ok_low = value >= low if low_inclusive else value > low
    ok_high = high is None or value < high
    if not (ok_low and ok_high):
        interval = f"{'[' if low_inclusive else '('}{low}, {high if high is not None else 'inf'})"
        raise ValueError(f"AGD: {name} must lie in {interval}, got {value!r}")
    return float(value)


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"AGD: {name} must be True or False, got {value!r}")
    return value


class AGD(torch.optim.Optimizer):
    r"""AGD (Yue et al., NeurIPS 2023): momentum whose per-coordinate preconditioner is built
    from the *stepwise difference* of bias-corrected momenta, and switches each coordinate
    between an SGD-like and an adaptive step.

    For a parameter tensor :math:`x` with gradient :math:`g_t` at step :math:`t = 1, 2, \dots`
    (all operations elementwise; :math:`m_0 = b_0 = 0`), Algorithm 1 of the paper:

    .. math::

        m_t &= \beta_1 m_{t-1} + (1 - \beta_1)\, g_t                                   && \text{(A1) momentum}\\
        s_t &= \frac{m_t}{1 - \beta_1^t} - \frac{m_{t-1}}{1 - \beta_1^{t-1}}
               \quad (s_1 = m_1 / (1 - \beta_1) = g_1)                                  && \text{(A2) stepwise difference}\\
        b_t &= \beta_2 b_{t-1} + (1 - \beta_2)\, s_t^2                                  && \text{(A3) its second moment}\\
        x_{t+1} &= x_t - \eta\, \frac{\sqrt{1 - \beta_2^t}}{1 - \beta_1^t}\,
               \frac{m_t}{\max\!\big(\sqrt{b_t},\ \delta \sqrt{1 - \beta_2^t}\big)}      && \text{(A4) auto-switching step}

    (A4) equals :math:`x_t - \eta\, \hat m_t / \max(\sqrt{\hat b_t}, \delta)` with the
    bias-corrected :math:`\hat m_t = m_t / (1-\beta_1^t)`, :math:`\hat b_t = b_t / (1-\beta_2^t)`:
    where :math:`\sqrt{\hat b_t} \le \delta` the coordinate takes the SGD-with-momentum step
    :math:`\eta \hat m_t / \delta`; elsewhere the adaptive step :math:`\eta \hat m_t / \sqrt{\hat b_t}`.
    :math:`s_t` approximates the Hessian's row times the last parameter change (the paper's
    motivation), so flat directions take SGD steps and curved ones adaptive steps.

    Computed here as :math:`s_t = a_t m_{t-1} + c_t g_t` with :math:`a_t = \beta_1/(1-\beta_1^t)
    - 1/(1-\beta_1^{t-1})` (0 at :math:`t=1`) and :math:`c_t = (1-\beta_1)/(1-\beta_1^t)`, which
    is (A2) rewritten through (A1): no copy of :math:`m_{t-1}` and no cancellation between two
    large momenta.

    Options (the reference implementation's):

    * ``weight_decay`` :math:`\lambda` with ``weight_decouple=True`` (default), before (A1):
      :math:`x_t \leftarrow (1 - \eta\lambda)\, x_t` (AdamW style), or with ``fixed_decay=True``
      :math:`x_t \leftarrow (1 - \lambda)\, x_t`; with ``weight_decouple=False``, L2:
      :math:`g_t \leftarrow g_t + \lambda x_t` (``p.grad`` itself is left unchanged).
    * ``amsgrad``: :math:`b^{\max}_t = \max(b^{\max}_{t-1}, b_t)` replaces :math:`b_t` in (A4).
    * ``clip`` :math:`c`: the ratio :math:`u_t = m_t / \max(\sqrt{b_t}, \delta\sqrt{1-\beta_2^t})`
      is clamped to :math:`[-c, c]` before (A4) scales it by :math:`\eta_t = \eta \sqrt{1-\beta_2^t}/(1-\beta_1^t)`.
    * ``win`` (Zhou et al., "Win: Weight-Decay-Integrated Nesterov Acceleration for Adaptive
      Gradient Algorithms", ICLR 2023): instead of (A4) and the decays above, with a second
      sequence :math:`z` (:math:`z_0 = x_0`, state ``z``),
      :math:`z_{t+1} = (z_t - \eta_t u_t)/(1 + \lambda\eta_t)`,
      :math:`\tau = 1/(3 + 2\eta_t\lambda)`,
      :math:`x_{t+1} = \tau\,(x_t - 2\eta_t u_t) + 2\tau\, z_{t+1}`.
      (The reference's latest version starts :math:`z` at zero, which pulls the first step
      towards the origin; its earlier version, and Win, start it at :math:`x_0`, as here.)

    State per parameter (the reference's names): ``step`` (float32 0-d CPU tensor, the
    number of steps taken), ``exp_avg`` :math:`m`, ``exp_avg_sq`` :math:`b`,
    ``max_exp_avg_sq`` (with ``amsgrad``), ``z`` (with ``win``); each shaped and typed like
    the parameter. ``state_dict()`` holds only tensors and plain numbers, so Flash Checkpoint
    saves and restores it bit-exactly.

    Args:
        params: parameters or parameter groups, as for every torch optimizer.
        lr: :math:`\eta` > 0. The authors advise about a tenth of AdamW's.
        betas: :math:`(\beta_1, \beta_2)`, each in [0, 1).
        delta: :math:`\delta` > 0, the switch threshold on :math:`\sqrt{\hat b_t}` (1e-5;
            the authors suggest 1e-14 for transformers). The reference accepts 0, which
            turns a coordinate whose gradient stays 0 into 0/0 = NaN; here it is an error.
        weight_decay: :math:`\lambda \ge 0`.
        weight_decouple, fixed_decay, amsgrad, win: as above.
        clip: ``None`` (default) or :math:`c > 0`; the authors suggest 5 against instability.
        foreach: use ``torch._foreach_*`` kernels (one launch per op for the whole group);
            ``None`` (default) uses them where torch has them, ``False`` loops per tensor.
            Both give the same numbers.

    Raises:
        ValueError: an option is out of range; the message names it.
        RuntimeError: a gradient is sparse.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        delta: float = 1e-5,
        weight_decay: float = 0.0,
        weight_decouple: bool = True,
        fixed_decay: bool = False,
        amsgrad: bool = False,
        win: bool = False,
        clip: float | None = None,
        *,
        foreach: bool | None = None,
    ) -> None:
        defaults = self._validate(
            dict(lr=lr, betas=betas, delta=delta, weight_decay=weight_decay, weight_decouple=weight_decouple,
                 fixed_decay=fixed_decay, amsgrad=amsgrad, win=win, clip=clip, foreach=foreach)
        )
        super().__init__(params, defaults)
        for group in self.param_groups:  # options given per group are checked too
            self._validate(group)

    @staticmethod
    def _validate(opts: dict[str, Any]) -> dict[str, Any]:
        """Check and normalise the options in ``opts`` (in place); ValueError names the bad one."""
        opts["lr"] = _check_number("lr", opts["lr"], low=0.0, low_inclusive=False)
        betas = opts["betas"]
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"AGD: betas must be a pair (beta1, beta2), got {betas!r}")
        opts["betas"] = (
            _check_number("betas[0]", betas[0], low=0.0, low_inclusive=True, high=1.0),
            _check_number("betas[1]", betas[1], low=0.0, low_inclusive=True, high=1.0),
        )
        opts["delta"] = _check_number("delta", opts["delta"], low=0.0, low_inclusive=False)
        opts["weight_decay"] = _check_number("weight_decay", opts["weight_decay"], low=0.0, low_inclusive=True)
        for name in ("weight_decouple", "fixed_decay", "amsgrad", "win"):
            opts[name] = _check_bool(name, opts[name])
        if opts["clip"] is not None:
            opts["clip"] = _check_number("clip", opts["clip"], low=0.0, low_inclusive=False)
        if opts["foreach"] is not None:
            _check_bool("foreach", opts["foreach"])
        return opts

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        for group in self.param_groups:  # groups pickled by an older version lack newer options
            group.setdefault("weight_decouple", True)
            group.setdefault("fixed_decay", False)
            group.setdefault("amsgrad", False)
            group.setdefault("win", False)
            group.setdefault("clip", None)
            group.setdefault("foreach", None)

    # ----- state -----------------------------------------------------------------------------

    def _state_for(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = self.state[p]
        if "step" not in state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        # created when first needed, also for a state loaded from a run without the option
        if group["amsgrad"] and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = state["exp_avg_sq"].clone(memory_format=torch.preserve_format)
        if group["win"] and "z" not in state:
            state["z"] = p.detach().clone(memory_format=torch.preserve_format)
        return state

    # ----- the step ----------------------------------------------------------------------------

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Take one AGD step for every parameter that has a gradient.

        Args:
            closure: re-evaluates the model and returns the loss (optional).

        Returns:
            The closure's loss, or None.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            # tensors that share device, dtype and step count share one vectorised update
            buckets: dict[tuple[Any, ...], list[tuple[torch.Tensor, dict[str, Any]]]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("AGD does not support sparse gradients")
                state = self._state_for(p, group)
                state["step"] += 1
                key = (p.device, p.dtype, float(state["step"]))
                buckets.setdefault(key, []).append((p, state))
            for (_, _, t), members in buckets.items():
                _update(group, t, members, _Ops(group["foreach"]))
        return loss


class _Ops:
    """The list operations AGD needs, ``ops.NAME(xs, ...)``: ``torch._foreach_NAME`` where torch
    has the op and it runs for these tensors, otherwise the same ``torch.Tensor`` method per
    tensor (same arithmetic, same bits). Arguments that are lists (or tuples) are indexed per tensor."""

    _logged: set[str] = set()

    def __init__(self, foreach: bool | None) -> None:
        self.foreach = foreach is not False

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            fn = getattr(torch, f"_foreach_{name}", None) if self.foreach else None
            if fn is not None:
                try:
                    return fn(*args, **kwargs)
                except NotImplementedError:  # e.g. a dtype or device without a foreach kernel
                    if name not in self._logged:
                        self._logged.add(name)
                        get_logger().debug("agd_foreach_unavailable", op=name)
            return [_per_tensor(name, i, args, kwargs) for i in range(len(args[0]))]

        return run


def _per_tensor(name: str, i: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, *rest = (a[i] if isinstance(a, (list, tuple)) else a for a in args)
    if name == "maximum_":  # no Tensor.maximum_
        return torch.maximum(x, rest[0], out=x)
    return getattr(x, name)(*rest, **kwargs)


def _update(group: dict[str, Any], t: float, members: list[tuple[torch.Tensor, dict[str, Any]]], ops: _Ops) -> None:
    """One AGD step, equations (A1)-(A4) of :class:`AGD`, for tensors of one device, dtype and
    step count ``t`` (already incremented)."""
    beta1, beta2 = group["betas"]
    lr, wd, delta, clip, win = group["lr"], group["weight_decay"], group["delta"], group["clip"], group["win"]
    params = [p for p, _ in members]
    grads = [p.grad for p in params]
    exp_avgs = [s["exp_avg"] for _, s in members]
    exp_avg_sqs = [s["exp_avg_sq"] for _, s in members]

    if wd != 0 and not win:
        if group["weight_decouple"]:
            ops.mul_(params, 1.0 - (wd if group["fixed_decay"] else lr * wd))
        else:
            grads = ops.add(grads, params, alpha=wd)  # a new list: p.grad stays as autograd left it

    bias1 = 1.0 - beta1**t
    bias1_prev = 1.0 - beta1 ** (t - 1)
    bias2 = 1.0 - beta2**t
    # (A2) through (A1): s_t = a m_{t-1} + c g_t
    a = beta1 / bias1 - 1.0 / bias1_prev if t > 1 else 0.0
    c = (1.0 - beta1) / bias1
    diffs = ops.mul(exp_avgs, a)
    ops.add_(diffs, grads, alpha=c)
    ops.lerp_(exp_avgs, grads, 1.0 - beta1)  # (A1)
    ops.mul_(exp_avg_sqs, beta2)  # (A3)
    ops.addcmul_(exp_avg_sqs, diffs, diffs, value=1.0 - beta2)
    del diffs

    if group["amsgrad"]:
        max_sqs = [s["max_exp_avg_sq"] for _, s in members]
        ops.maximum_(max_sqs, exp_avg_sqs)
        denoms = ops.sqrt(max_sqs)
    else:
        denoms = ops.sqrt(exp_avg_sqs)
    ops.clamp_min_(denoms, delta * math.sqrt(bias2))  # (A4): the switch
    step_size = lr * math.sqrt(bias2) / bias1

    if clip is None and not win:
        ops.addcdiv_(params, exp_avgs, denoms, value=-step_size)
        return
    updates = ops.div(exp_avgs, denoms)
    if clip is not None:
        ops.clamp_min_(updates, -clip)
        ops.clamp_max_(updates, clip)
    if not win:
        ops.add_(params, updates, alpha=-step_size)
        return
    zs = [s["z"] for _, s in members]
    ops.add_(zs, updates, alpha=-step_size)
    ops.mul_(zs, 1.0 / (1.0 + wd * step_size))
    tau = 1.0 / (3.0 + 2.0 * step_size * wd)
    ops.mul_(params, tau)
    ops.add_(params, updates, alpha=-2.0 * tau * step_size)
    ops.add_(params, zs, alpha=2.0 * tau)
