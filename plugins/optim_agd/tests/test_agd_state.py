"""AGD's state dict: the reference's names, a float32 step tensor, and bit-exact save/restore
through torch.save and through dlrover's own checkpoint format (what Flash Checkpoint writes)."""

from __future__ import annotations

import io

import pytest
import torch

from dlrover_core.checkpoint.layout import decode, encode
from dlrover_plugin_optim_agd import AGD

OPTIONS = [
    {},
    {"amsgrad": True, "weight_decay": 0.01, "clip": 5.0},
    {"win": True, "weight_decay": 0.05},
]


def make(seed: int = 0, **options) -> tuple[torch.nn.Module, AGD, torch.Generator]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    return model, AGD(model.parameters(), lr=1e-2, **options), torch.Generator().manual_seed(seed + 1)


def train(model: torch.nn.Module, opt: AGD, gen: torch.Generator, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(16, 6, generator=gen)
        y = torch.randint(0, 3, (16,), generator=gen)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


def assert_same_bits(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
            assert torch.equal(a[k], b[k]), k
        elif isinstance(a[k], dict):
            assert_same_bits(a[k], b[k])
        else:
            assert a[k] == b[k], k


def test_agd_state_has_the_reference_names_and_a_float32_step_tensor():
    """Each parameter's state is step (0-d float32 CPU tensor), exp_avg, exp_avg_sq, plus
    max_exp_avg_sq with amsgrad and z with win, shaped and typed like the parameter."""
    model, opt, gen = make(amsgrad=True, win=True)
    train(model, opt, gen, 2)
    for p in model.parameters():
        state = opt.state[p]
        assert sorted(state) == ["exp_avg", "exp_avg_sq", "max_exp_avg_sq", "step", "z"]
        assert state["step"].dtype == torch.float32 and state["step"].dim() == 0 and state["step"].item() == 2.0
        for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq", "z"):
            assert state[key].shape == p.shape and state[key].dtype == p.dtype
    group = opt.state_dict()["param_groups"][0]
    assert {k: group[k] for k in ("lr", "betas", "delta", "weight_decay", "weight_decouple", "fixed_decay",
                                  "amsgrad", "win", "clip")} == {
        "lr": 1e-2, "betas": (0.9, 0.999), "delta": 1e-5, "weight_decay": 0.0, "weight_decouple": True,
        "fixed_decay": False, "amsgrad": True, "win": True, "clip": None}


@pytest.mark.parametrize("options", OPTIONS, ids=["defaults", "amsgrad+decay+clip", "win"])
@pytest.mark.parametrize("via", ["torch.save", "dlrover format"])
def test_agd_resume_from_a_checkpoint_continues_bit_exactly(options, via):
    """Saving model + optimizer after 5 steps, restoring into fresh objects and training 5 more
    gives bit-for-bit the parameters and optimizer state of an uninterrupted 10-step run."""
    model, opt, gen = make(**options)
    train(model, opt, gen, 10)
    uninterrupted = (model.state_dict(), opt.state_dict())

    model, opt, gen = make(**options)
    train(model, opt, gen, 5)
    state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "data": gen.get_state()}
    if via == "torch.save":
        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        restored = torch.load(buf, weights_only=True)
    else:  # the safetensors-based file Flash Checkpoint persists: tensors as raw bytes, the rest as JSON
        restored, _ = decode(encode(state, step=5))

    model, opt, gen = make(seed=123, **options)  # other initial weights: everything must come from the file
    model.load_state_dict(restored["model"])
    opt.load_state_dict(restored["optimizer"])
    gen.set_state(restored["data"])
    for p in model.parameters():
        assert opt.state[p]["step"].dtype == torch.float32 and opt.state[p]["step"].device.type == "cpu"
    train(model, opt, gen, 5)
    assert_same_bits(model.state_dict(), uninterrupted[0])
    assert_same_bits(opt.state_dict(), uninterrupted[1])


def test_agd_state_loaded_without_amsgrad_state_gains_it_when_enabled():
    """Loading a state saved without amsgrad into an optimizer with amsgrad starts max_exp_avg_sq
    at the loaded exp_avg_sq instead of failing."""
    model, opt, gen = make()
    train(model, opt, gen, 3)
    saved = opt.state_dict()
    model2, opt2, _ = make(amsgrad=True)
    model2.load_state_dict(model.state_dict())
    saved["param_groups"][0]["amsgrad"] = True
    opt2.load_state_dict(saved)
    train(model2, opt2, gen, 1)
    p = next(model2.parameters())
    assert opt2.state[p]["step"].item() == 4.0 and "max_exp_avg_sq" in opt2.state[p]
