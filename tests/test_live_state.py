"""What the live world sends a replacement (``dlrover_core.train.live``): the training state
must survive ``pickle``; a value that cannot is refused on every member at once, with the
state entry named, instead of killing the sender and leaving the receivers waiting."""

from __future__ import annotations

import copy
import json
import os
import pickle
import subprocess
import sys

import pytest
from helpers import ROOT, SCRIPTS

from dlrover_core.train.live import Step, _skeleton, _unsendable


class _Loop:  # what a Step refers to: in a job, the live world with the model and the group
    def __init__(self) -> None:
        self.unpicklable = lambda: None


def test_a_step_kept_in_the_state_pickles_and_copies_as_a_plain_int():
    """A script that keeps the step it is in (``self.step = step``) sends an int, not the
    loop behind it (which reaches the DDP wrapper: the repro live-grow-state)."""
    step = Step(56, _Loop())  # type: ignore[arg-type]
    for value in (pickle.loads(pickle.dumps({"step": step})), copy.deepcopy({"step": step})):
        assert value == {"step": 56} and type(value["step"]) is int
    assert _unsendable(_skeleton({"probe": _Probe(step)}, [])) is None


class _Probe:
    def __init__(self, value) -> None:
        self.value = value

    def state_dict(self):
        return {"nested": [1, {"value": self.value}]}


def test_a_value_that_cannot_be_sent_is_named_by_its_path_in_the_state():
    import torch

    state = {"model": torch.nn.Linear(2, 2), "probe": _Probe(lambda: 0)}
    tensors: list = []
    why = _unsendable(_skeleton(state, tensors))
    assert why is not None
    assert why.startswith("state['probe'].state_dict()['nested'][1]['value'] is a builtins.function"), why
    assert "Failure(live_recovery=False)" in why
    assert len(tensors) == 2  # the model's tensors are sent apart, never pickled
    assert _unsendable(_skeleton({"model": state["model"]}, [])) is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", ["ok", "unsendable"])
def test_a_refused_state_fails_every_member_at_once_instead_of_leaving_them_waiting(tmp_path, case):
    """Two real gloo ranks: rank 0 sends its state to rank 1. When a value cannot be
    pickled, both raise the same error naming it, in well under the group's 20 s timeout."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("DLROVER_", "TORCHELASTIC_"))},
           "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(SCRIPTS / "broadcast_state.py"), str(store.port), str(rank), case,
                               str(tmp_path)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in (0, 1)]
    outputs = [p.communicate(timeout=50)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    if case == "ok":
        assert results[1]["received"] and results[1]["sum"] == 32.0 and results[1]["step"] == 7
    else:
        for r in results:
            assert r["error"].startswith("state['probe'].state_dict()['hook'] is a builtins.function"), r
            assert r["took_s"] < 5.0, r


def test_the_loop_follows_the_optimizer_inside_a_model_optimizer_state():
    """Which step a worker applied (what the live world resumes after) comes from a post hook
    on each optimizer of the state: one given directly, and the one inside a
    ``ModelOptimizerState`` (missed before: every sharded survivor then counted as having
    applied nothing and went back to its snapshot at each failure)."""
    import torch

    from dlrover_core.train.live import _Loop as Loop
    from dlrover_core.train.live import _optimizers
    from dlrover_core.train.state import ModelOptimizerState

    model, other = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    opt, opt2 = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(other.parameters(), lr=0.1)
    state = {"train": ModelOptimizerState(model, opt), "opt2": opt2, "again": opt, "model": model}
    assert [id(o) for o in _optimizers(state)] == [id(opt), id(opt2)]
    loop = Loop(3, state, 0)
    try:
        loop._in_flight = 0
        model(torch.ones(1, 2)).sum().backward()
        opt.step()
        assert loop.applied == 0
    finally:
        for hook in loop._hooks:
            hook.remove()
