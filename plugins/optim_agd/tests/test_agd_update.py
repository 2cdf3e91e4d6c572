"""AGD's update against the paper's equations, recomputed by hand in plain Python.

``hand_agd`` below is a scalar loop over coordinates written straight from the equations in
the AGD docstring (Yue et al., NeurIPS 2023, Algorithm 1, and the reference implementation's
options); it shares no code with the optimizer, which works on whole tensors through
``torch._foreach_*``. Both run in float64 on a small quadratic whose gradient depends on
the iterate, so weight decay and the three first steps all interact.
"""

from __future__ import annotations

import math

import pytest
import torch

from dlrover_plugin_optim_agd import AGD

X0 = [0.5, -1.5, 2.0, 1e-6, -3e-7]
CURV = [1.0, 0.3, 2.0, 0.5, 1.0]  # g_i = CURV_i * x_i + SHIFT_i
SHIFT = [0.1, -0.2, 0.0, 2e-7, -1e-6]


def grad_of(x: list[float]) -> list[float]:
    return [h * xi + c for h, xi, c in zip(CURV, x, SHIFT, strict=True)]


def hand_agd(steps: int, *, lr=1e-3, betas=(0.9, 0.999), delta=1e-5, weight_decay=0.0,
             weight_decouple=True, fixed_decay=False, amsgrad=False, clip=None, win=False) -> list[list[float]]:
    """Iterates x_1..x_steps of AGD, one coordinate at a time, from the paper's equations."""
    beta1, beta2 = betas
    n = len(X0)
    x, m, b, bmax, z = list(X0), [0.0] * n, [0.0] * n, [0.0] * n, list(X0)
    out = []
    for t in range(1, steps + 1):
        g = grad_of(x)  # gradient at x_t (before any decay)
        new_x = []
        for i in range(n):
            xi, gi = x[i], g[i]
            if not win and weight_decay:
                if weight_decouple:
                    xi = xi * (1 - (weight_decay if fixed_decay else lr * weight_decay))
                else:
                    gi = gi + weight_decay * xi
            m_prev = m[i]
            m[i] = beta1 * m_prev + (1 - beta1) * gi  # (A1)
            s = m[i] / (1 - beta1**t) - (m_prev / (1 - beta1 ** (t - 1)) if t > 1 else 0.0)  # (A2)
            b[i] = beta2 * b[i] + (1 - beta2) * s * s  # (A3)
            bmax[i] = max(bmax[i], b[i])
            root = math.sqrt(bmax[i] if amsgrad else b[i])
            denom = max(root, delta * math.sqrt(1 - beta2**t))  # (A4)
            u = m[i] / denom
            if clip is not None:
                u = min(max(u, -clip), clip)
            eta_t = lr * math.sqrt(1 - beta2**t) / (1 - beta1**t)
            if win:
                z[i] = (z[i] - eta_t * u) / (1 + weight_decay * eta_t)
                tau = 1 / (3 + 2 * eta_t * weight_decay)
                new_x.append(tau * (xi - 2 * eta_t * u) + 2 * tau * z[i])
            else:
                new_x.append(xi - eta_t * u)
        x = new_x
        out.append(list(x))
    return out


def run_agd(steps: int, *, foreach=None, **options) -> list[list[float]]:
    p = torch.tensor(X0, dtype=torch.float64, requires_grad=True)
    opt = AGD([p], foreach=foreach, **options)
    curv, shift = torch.tensor(CURV, dtype=torch.float64), torch.tensor(SHIFT, dtype=torch.float64)
    out = []
    for _ in range(steps):
        p.grad = curv * p.detach() + shift
        opt.step()
        out.append(p.detach().tolist())
    return out


#: name -> (options, the same without the option under test: must give other iterates)
CASES = {
    "defaults": ({}, None),
    "large delta": ({"delta": 0.05}, {}),
    "decoupled weight decay": ({"weight_decay": 0.1, "lr": 0.01}, {"lr": 0.01}),
    "coupled weight decay (L2)": ({"weight_decay": 0.1, "weight_decouple": False, "lr": 0.01}, {"weight_decay": 0.1, "lr": 0.01}),
    "fixed decay": ({"weight_decay": 0.01, "fixed_decay": True}, {"weight_decay": 0.01}),
    "amsgrad": ({"amsgrad": True, "lr": 0.05, "betas": (0.5, 0.6)}, {"lr": 0.05, "betas": (0.5, 0.6)}),
    "clip": ({"clip": 0.5, "delta": 0.05}, {"delta": 0.05}),
    "win": ({"win": True, "weight_decay": 0.1, "lr": 0.01}, {"weight_decay": 0.1, "lr": 0.01}),
}


@pytest.mark.parametrize("foreach", [None, False], ids=["foreach", "per-tensor"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_agd_first_three_steps_match_the_equations(case, foreach):
    """For every option, AGD's first three iterates equal a scalar recomputation of the paper's equations."""
    options, baseline = CASES[case]
    expected = hand_agd(3, **options)
    got = run_agd(3, foreach=foreach, **options)
    if baseline is not None:  # the option changes the iterates, so the comparison does test it
        assert hand_agd(3, **baseline)[-1] != pytest.approx(expected[-1], rel=1e-9, abs=0)
    for t, (want, have) in enumerate(zip(expected, got, strict=True), start=1):
        assert have == pytest.approx(want, rel=1e-12, abs=1e-15), f"step {t}"


def test_agd_first_step_is_a_sign_step_or_an_sgd_step():
    """Step 1 moves each coordinate by lr * g / max(|g|, delta): lr * sign(g) where |g| > delta,
    lr * g / delta (SGD) where the gradient is below delta (numbers worked out by hand)."""
    p = torch.tensor([0.5, -2.0, 0.0, 0.0], dtype=torch.float64, requires_grad=True)
    opt = AGD([p], lr=0.1, delta=1e-3)
    p.grad = torch.tensor([4.0, -0.25, 5e-4, -2e-4], dtype=torch.float64)
    opt.step()
    # 0.5 - 0.1; -2.0 + 0.1; 0 - 0.1 * 5e-4 / 1e-3; 0 + 0.1 * 2e-4 / 1e-3
    assert p.detach().tolist() == pytest.approx([0.4, -1.9, -0.05, 0.02], rel=1e-12)


def test_agd_switches_per_coordinate_between_sgd_and_adaptive_steps():
    """With a steady gradient, a coordinate whose sqrt(b_hat) stays below delta takes the SGD step
    lr * m_hat / delta (linear in the gradient), while one above delta takes the adaptive step
    lr * m_hat / sqrt(b_hat) (invariant to the gradient's scale)."""
    lr, delta, beta1, beta2 = 0.01, 1e-3, 0.9, 0.999

    def three_steps(scale: float) -> tuple[torch.Tensor, AGD, torch.Tensor]:
        p = torch.zeros(2, dtype=torch.float64, requires_grad=True)
        opt = AGD([p], lr=lr, delta=delta)
        g = torch.tensor([1e-4, 1.0], dtype=torch.float64) * scale  # coordinate 0 tiny, 1 large
        moves = []
        for _ in range(3):
            before = p.detach().clone()
            p.grad = g.clone()
            opt.step()
            moves.append(before - p.detach())
        return torch.stack(moves), opt, p

    moves, opt, p = three_steps(1.0)
    state, t = opt.state[p], 3
    b_hat_root = (state["exp_avg_sq"] / (1 - beta2**t)).sqrt()
    m_hat = state["exp_avg"] / (1 - beta1**t)
    assert b_hat_root[0] < delta < b_hat_root[1]  # the max() picks delta for 0 and sqrt(b_hat) for 1
    assert moves[2, 0].item() == pytest.approx(lr * m_hat[0].item() / delta, rel=1e-12)  # SGD form
    assert moves[2, 1].item() == pytest.approx(lr * m_hat[1].item() / b_hat_root[1].item(), rel=1e-12)  # adaptive

    doubled, _, _ = three_steps(2.0)
    assert torch.allclose(doubled[:, 0], 2 * moves[:, 0], rtol=1e-12)  # SGD: twice the gradient, twice the step
    assert torch.allclose(doubled[:, 1], moves[:, 1], rtol=1e-12)  # adaptive: same step


def test_agd_coupled_weight_decay_leaves_the_gradient_untouched():
    """weight_decouple=False adds lambda * x to the gradient it uses, not to p.grad."""
    p = torch.ones(3, requires_grad=True)
    opt = AGD([p], weight_decay=0.5, weight_decouple=False)
    p.grad = torch.full((3,), 0.25)
    opt.step()
    assert torch.equal(p.grad, torch.full((3,), 0.25))


def test_agd_foreach_and_per_tensor_updates_are_bit_identical():
    """The vectorised update and the per-tensor fallback produce the same bits over many tensors and steps."""
    torch.manual_seed(0)
    shapes = [(7, 3), (3,), (2, 2, 2), (1,)]
    results = []
    for foreach in (True, False):
        gen = torch.Generator().manual_seed(1)
        params = [torch.randn(s, generator=gen).requires_grad_() for s in shapes]
        opt = AGD(params, lr=3e-3, weight_decay=0.01, amsgrad=True, clip=2.0, foreach=foreach)
        for _ in range(5):
            for q in params:
                q.grad = torch.randn(q.shape, generator=gen)
            opt.step()
        results.append([q.detach().clone() for q in params])
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))


def test_agd_falls_back_per_tensor_when_a_foreach_op_is_missing(monkeypatch):
    """If torch lacks a foreach op, AGD loops over tensors for it and gets the same result."""
    expected = run_agd(3, weight_decay=0.1, lr=0.01)
    monkeypatch.delattr(torch, "_foreach_lerp_")
    monkeypatch.delattr(torch, "_foreach_addcdiv_")
    assert run_agd(3, weight_decay=0.1, lr=0.01) == expected


def test_agd_skips_parameters_without_gradients_and_counts_steps_per_parameter():
    """A parameter without a gradient is not touched and its step count does not advance."""
    a, b = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    opt = AGD([a, b])
    a.grad = torch.ones(2)
    opt.step()
    opt.step()
    assert torch.equal(b, torch.ones(2)) and b not in opt.state
    assert opt.state[a]["step"].item() == 2.0
    b.grad = torch.ones(2)
    opt.step()
    assert (opt.state[a]["step"].item(), opt.state[b]["step"].item()) == (3.0, 1.0)


def test_agd_closure_loss_is_returned():
    """step(closure) evaluates the closure with gradients enabled and returns its loss."""
    p = torch.tensor([1.0, 2.0], requires_grad=True)
    opt = AGD([p])

    def closure():
        opt.zero_grad()
        loss = (p**2).sum()
        loss.backward()
        return loss

    assert opt.step(closure).item() == pytest.approx(5.0)


def test_agd_rejects_sparse_gradients():
    """A sparse gradient raises RuntimeError, as in the reference implementation."""
    emb = torch.nn.Embedding(4, 2, sparse=True)
    opt = AGD(emb.parameters())
    emb(torch.tensor([1])).sum().backward()
    with pytest.raises(RuntimeError, match="sparse"):
        opt.step()
