"""The worker Checkpointer in one process: schedule, commit, retention, RNG, restore into objects."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from dlrover_core import CheckpointError
from dlrover_core.checkpoint.saver import step_dir
from dlrover_core.train import Checkpointer


class Position:
    def __init__(self) -> None:
        self.index = 0

    def state_dict(self):
        return {"index": self.index}

    def load_state_dict(self, d):
        self.index = d["index"]


def test_fresh_start_returns_none(tmp_path):
    assert Checkpointer(str(tmp_path)).load() is None


def test_save_follows_schedule_and_commits(tmp_path):
    ck = Checkpointer(str(tmp_path), persist_every_steps=5, keep_last=2)
    model = torch.nn.Linear(2, 2)
    saved = [s for s in range(12) if ck.save(s, {"model": model})]
    assert saved == [0, 5, 10]
    assert ck.storage.latest_step() == 10
    assert sorted({p.split("/")[0] for p in ck.storage.list() if p.startswith("step_")}) == [
        "step_0000000005", "step_0000000010"]
    assert ck.save(11, {"model": model}, force=True)


def test_restore_into_objects_and_rng(tmp_path):
    """load(state) restores model, optimizer and data position in place, and every RNG."""
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(2, 3)).sum().backward()
    opt.step()
    pos = Position()
    pos.index = 42
    ck = Checkpointer(str(tmp_path), persist_every_steps=1)
    torch.manual_seed(5)
    random.seed(6)
    np.random.seed(7)
    ck.save(3, {"model": model, "optimizer": opt, "data": pos})
    expected = (torch.rand(3), random.random(), np.random.rand())

    model2 = torch.nn.Linear(3, 3)
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.9)
    pos2 = Position()
    torch.manual_seed(99)
    loader = Checkpointer(str(tmp_path))
    restored = loader.load({"model": model2, "optimizer": opt2, "data": pos2})
    assert restored.step == 3 and restored.source == "storage"
    # every byte read from storage is counted: the marker, checkpoint.json and the shard file
    on_disk = sum(p.stat().st_size for p in (tmp_path / step_dir(3)).iterdir() if p.suffix in (".json", ".safetensors"))
    assert loader.storage_bytes_read >= on_disk > 0
    assert pos2.index == 42
    for a, b in zip(model.parameters(), model2.parameters(), strict=True):
        assert torch.equal(a, b)
    assert torch.equal(opt2.state_dict()["state"][0]["momentum_buffer"], opt.state_dict()["state"][0]["momentum_buffer"])
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1] and np.random.rand() == expected[2]


def test_torn_newer_step_is_invisible(tmp_path):
    """A step directory without a commit (a crash mid-save) is never loaded."""
    ck = Checkpointer(str(tmp_path), persist_every_steps=1)
    ck.save(1, {"w": torch.ones(2)})
    ck.storage.write_bytes("step_0000000002/rank_00000-round0.safetensors", b"torn")
    assert Checkpointer(str(tmp_path)).load().step == 1


def test_missing_key_is_a_clear_error(tmp_path):
    ck = Checkpointer(str(tmp_path), persist_every_steps=1)
    ck.save(1, {"model": torch.nn.Linear(1, 1)})
    with pytest.raises(CheckpointError, match="no entry 'optimizer'"):
        ck.load({"optimizer": torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=1)})
