"""The checkpoint file format: tensors in safetensors, the rest as JSON, no pickle."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors import safe_open

from dlrover_core import CheckpointError
from dlrover_core.checkpoint.layout import decode, encode


def test_round_trip_keeps_types_and_values():
    """Int keys, tuples, None, numpy arrays, optimizer state and RNG tuples come back equal."""
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    state = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "extra": {1: (2, "x", None), "f": 1.5, "nested": [True, {"a": np.arange(3)}]},
    }
    back, meta = decode(encode(state, step=7))
    assert meta["step"] == "7"
    assert back["extra"] == {1: (2, "x", None), "f": 1.5, "nested": [True, {"a": back["extra"]["nested"][1]["a"]}]}
    np.testing.assert_array_equal(back["extra"]["nested"][1]["a"], np.arange(3))
    for k, v in model.state_dict().items():
        assert torch.equal(back["model"][k], v)
    opt2 = torch.optim.AdamW(torch.nn.Linear(3, 2).parameters())
    opt2.load_state_dict(back["optimizer"])
    assert list(back["optimizer"]["state"]) == [0, 1]  # int keys survive


def test_shared_tensors_are_saved():
    """Tied weights (two keys, one storage) are stored as independent copies."""
    w = torch.randn(4, 4)
    back, _ = decode(encode({"a": w, "b": w, "view": w[1]}))
    assert torch.equal(back["a"], w) and torch.equal(back["b"], w) and torch.equal(back["view"], w[1])


def test_file_opens_with_plain_safetensors(tmp_path):
    """Anyone can read the tensors with safetensors alone."""
    path = tmp_path / "rank_00000.safetensors"
    path.write_bytes(encode({"model": {"w": torch.ones(2), "b": torch.zeros(3, dtype=torch.float64)}}))
    with safe_open(str(path), "pt") as f:
        assert sorted(f.keys()) == ["model/b", "model/w"]
        assert torch.equal(f.get_tensor("model/w"), torch.ones(2))
        assert f.metadata()["format"] == "dlrover-state/1"


def test_unsupported_type_names_its_path():
    with pytest.raises(CheckpointError, match=r"extra/fn.*function"):
        encode({"extra": {"fn": lambda: 0}})


@pytest.mark.parametrize("cut", [4, 100, -10])
def test_torn_file_is_rejected(cut):
    """A truncated file never decodes into a state."""
    data = encode({"w": torch.randn(64)})
    with pytest.raises(CheckpointError):
        decode(data[:cut])
