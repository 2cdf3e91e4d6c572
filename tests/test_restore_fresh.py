"""A fresh process's load of a ``ModelOptimizerState`` (a replacement, a restarted worker)
skips torch's optimizer-state initialization (one optimizer step with zero gradients) and
ends with the same parameters, optimizer state and trajectory, bit for bit, as torch's
``set_state_dict`` way: on a real 2-rank gloo world with FSDP2 (DTensor shards) and two
parameter groups (tests/scripts/fresh_optimizer_load.py); and on a plain model, where a
state that does not fit takes torch's way."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dlrover_core.checkpoint.state_format import flatten
from dlrover_core.train import ModelOptimizerState
from dlrover_core.train import restore as restore_mod
from tests.helpers import ROOT, SCRIPTS, communicate_all


@pytest.mark.timeout(120)
def test_a_fresh_fsdp2_optimizer_loads_without_its_zero_step_and_trains_bit_identically(tmp_path):
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DLROVER_", "TORCHELASTIC_"))}
    procs = [subprocess.Popen(
        [sys.executable, str(SCRIPTS / "fresh_optimizer_load.py"), str(tmp_path)],
        env={**env, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
             "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
             "TORCHELASTIC_USE_AGENT_STORE": "True"},  # (the store is hosted here, as an agent would)
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(2)]
    communicate_all(procs, 100)
    for rank in range(2):
        r = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert r["fast_path"], r
        assert r["loaded_equal"] and r["trained_equal_fast"] and r["trained_equal_ref"], r
        assert r["types_fast"] == r["types_ref"] and "exp_avg:DTensor" in r["types_fast"], r
        assert r["groups_fast"] == r["groups_ref"], r


def _plain():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    return net, torch.optim.AdamW(net.parameters(), lr=0.1)


def _step(net, opt, seed):
    opt.zero_grad()
    net(torch.randn(3, 4, generator=torch.Generator().manual_seed(seed))).sum().backward()
    opt.step()


def _snapshot(net, opt):
    tree, tensors = flatten({"state": {"train": ModelOptimizerState(net, opt).state_dict()}})
    return tree, {k: v.clone() for k, v in tensors.items()}


def test_a_plain_fresh_optimizer_takes_the_fast_path_and_nothing_aliases_the_snapshot():
    net, opt = _plain()
    _step(net, opt, 1)
    tree, tensors = _snapshot(net, opt)
    fresh_net, fresh_opt = _plain()
    out = restore_mod.restore_tree(tree, tensors, {"train": ModelOptimizerState(fresh_net, fresh_opt)}, copy=True)
    assert set(out["state"]["train"]) == {"model", "optimizer"}
    for v in tensors.values():
        v.fill_(3.0)  # the snapshot's memory is written again by later saves
    _step(net, opt, 2)
    _step(fresh_net, fresh_opt, 2)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), fresh_net.parameters(), strict=True))


def test_an_optimizer_with_state_or_another_model_takes_torchs_way():
    net, opt = _plain()
    _step(net, opt, 1)
    tree, tensors = _snapshot(net, opt)
    value = restore_mod.unflatten(tree, tensors)["state"]["train"]
    stepped_net, stepped_opt = _plain()
    _step(stepped_net, stepped_opt, 5)  # state allocated: torch's load replaces it
    assert restore_mod._load_fresh_optimizer(ModelOptimizerState(stepped_net, stepped_opt), value) is None
    other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 3))  # another shape
    assert restore_mod._load_fresh_optimizer(
        ModelOptimizerState(other, torch.optim.AdamW(other.parameters())), value) is None
    # nothing was loaded into the model that did not fit
    assert other[1].weight.shape == (3, 8)
    # and the full load of the stepped optimizer still gives the saved state
    restore_mod.restore_tree(tree, tensors, {"train": ModelOptimizerState(stepped_net, stepped_opt)}, copy=True)
    _step(net, opt, 2)
    _step(stepped_net, stepped_opt, 2)
    assert all(torch.equal(a, b) for a, b in zip(net.parameters(), stepped_net.parameters(), strict=True))
