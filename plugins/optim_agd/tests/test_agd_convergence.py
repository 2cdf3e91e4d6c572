"""AGD converges on small convex problems: an ill-conditioned quadratic and logistic regression."""

from __future__ import annotations

import torch

from dlrover_plugin_optim_agd import AGD


def test_agd_minimises_an_ill_conditioned_quadratic():
    """On f(x) = 1/2 x^T A x - b^T x with condition number 1e3, 2000 full-batch AGD steps shrink
    the gap f(x) - f* to under a millionth of its starting value (about 100)."""
    gen = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(20, 20, generator=gen, dtype=torch.float64))
    a = q @ torch.diag(torch.logspace(0, 3, 20, dtype=torch.float64)) @ q.T / 100
    b = torch.randn(20, generator=gen, dtype=torch.float64)
    x_star = torch.linalg.solve(a, b)

    def f(x):
        return 0.5 * x @ a @ x - b @ x

    x = torch.zeros(20, dtype=torch.float64, requires_grad=True)
    opt = AGD([x], lr=0.05)
    gap0 = (f(x) - f(x_star)).item()
    for _ in range(2000):
        opt.zero_grad()
        f(x).backward()
        opt.step()
    assert gap0 > 10.0
    assert (f(x) - f(x_star)).item() < 1e-6 * gap0


def test_agd_trains_logistic_regression_to_the_accuracy_of_the_true_model():
    """Mini-batch AGD on separable-ish synthetic data reaches the generating model's accuracy
    and a loss well below chance (ln 2)."""
    gen = torch.Generator().manual_seed(1)
    n, d = 2000, 10
    w_true = torch.randn(d, generator=gen)
    x = torch.randn(n, d, generator=gen)
    y = (x @ w_true + 0.5 * torch.randn(n, generator=gen) > 0).float()
    model = torch.nn.Linear(d, 1)
    opt = AGD(model.parameters(), lr=1e-2, weight_decay=1e-4)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    for _ in range(300):
        idx = torch.randint(0, n, (64,), generator=gen)
        opt.zero_grad()
        loss_fn(model(x[idx]).squeeze(1), y[idx]).backward()
        opt.step()
    with torch.no_grad():
        loss = loss_fn(model(x).squeeze(1), y).item()
        acc = ((model(x).squeeze(1) > 0).float() == y).float().mean().item()
        true_acc = (((x @ w_true) > 0).float() == y).float().mean().item()
    assert loss < 0.3
    assert acc >= true_acc - 0.02
