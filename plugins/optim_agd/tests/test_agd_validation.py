"""Invalid AGD hyperparameters raise ValueError naming the parameter."""

from __future__ import annotations

import math

import pytest
import torch

from dlrover_plugin_optim_agd import AGD


def params():
    return [torch.zeros(2, requires_grad=True)]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"lr": 0.0}, r"lr must lie in \(0.0, inf\), got 0.0"),
        ({"lr": -1e-3}, r"lr must lie in"),
        ({"lr": math.nan}, r"lr must be a finite number, got nan"),
        ({"lr": "0.1"}, r"lr must be a finite number, got '0.1'"),
        ({"betas": (1.0, 0.999)}, r"betas\[0\] must lie in \[0.0, 1.0\), got 1.0"),
        ({"betas": (0.9, -0.1)}, r"betas\[1\] must lie in \[0.0, 1.0\), got -0.1"),
        ({"betas": 0.9}, r"betas must be a pair"),
        ({"betas": (0.9, 0.99, 0.9)}, r"betas must be a pair"),
        ({"delta": 0.0}, r"delta must lie in \(0.0, inf\), got 0.0"),
        ({"delta": -1e-5}, r"delta must lie in"),
        ({"weight_decay": -0.1}, r"weight_decay must lie in \[0.0, inf\), got -0.1"),
        ({"clip": 0}, r"clip must lie in \(0.0, inf\), got 0"),
        ({"clip": math.inf}, r"clip must be a finite number"),
        ({"amsgrad": 1}, r"amsgrad must be True or False, got 1"),
        ({"weight_decouple": "yes"}, r"weight_decouple must be True or False"),
        ({"fixed_decay": None}, r"fixed_decay must be True or False"),
        ({"win": 0}, r"win must be True or False"),
        ({"foreach": "auto"}, r"foreach must be True or False"),
    ],
)
def test_agd_invalid_hyperparameter_raises_value_error_naming_it(options, message):
    """Each out-of-range option raises ValueError with the option's name, the rule and the value."""
    with pytest.raises(ValueError, match=r"^AGD: " + message):
        AGD(params(), **options)


def test_agd_invalid_option_in_a_parameter_group_is_rejected():
    """Options given per parameter group are checked like the defaults."""
    with pytest.raises(ValueError, match="AGD: lr must lie in"):
        AGD([{"params": params(), "lr": -1.0}], lr=1e-3)


def test_agd_defaults_are_the_reference_implementations():
    """Defaults: lr 1e-3, betas (0.9, 0.999), delta 1e-5, no weight decay (decoupled when set,
    not fixed), no amsgrad, no win, no clip."""
    assert AGD(params()).defaults == {
        "lr": 1e-3, "betas": (0.9, 0.999), "delta": 1e-5, "weight_decay": 0.0, "weight_decouple": True,
        "fixed_decay": False, "amsgrad": False, "win": False, "clip": None, "foreach": None,
    }


def test_agd_accepts_betas_as_a_json_list():
    """A Job's options cross process boundaries as JSON, where betas arrive as a list."""
    assert AGD(params(), betas=[0.8, 0.99]).defaults["betas"] == (0.8, 0.99)
