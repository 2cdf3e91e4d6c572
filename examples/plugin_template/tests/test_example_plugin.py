"""Tests of the plugin against the installed dlrover-core (`pip install -e .` then `pytest`).

The fixtures ``dlrover_host``, ``make_job`` and ``log_events`` come from dlrover-core's
pytest plugin (``dlrover_core.testing.pytest_plugin``), loaded automatically.
"""

from __future__ import annotations

import pytest
import torch

import dlrover_plugin_example.hooks
from dlrover_core import JobSpecError, Optimizer
from dlrover_core.backend import PluginHost
from dlrover_core.testing import RecordingScheduler, register_plugin
from dlrover_plugin_example import SignSGD


def test_installed_distribution_is_found_through_its_entry_point(log_events):
    """pip-installed, the `dlrover` entry point loads without errors and registers signsgd."""
    host = PluginHost(environ={"DLROVER_PLUGINS": "dlrover-plugin-example"})  # only this plugin, besides built-ins
    (info,) = [i for i in host.plugins.values() if i.distribution == "dlrover-plugin-example"]
    assert host.registries.optimizer.get("signsgd") is SignSGD
    assert info.distribution == "dlrover-plugin-example"
    assert info.backends == {"optimizer": ["signsgd"]} and info.errors == []
    assert [e for e in log_events if e["log_level"] in ("warning", "error")] == []


def test_a_job_selects_the_optimizer_by_name(dlrover_host, make_job):
    """With the plugin registered a Job may name it; the plan carries its options."""
    with register_plugin(dlrover_plugin_example.hooks):
        job = make_job(scheduler="recording", optimizer=Optimizer("signsgd", lr=0.01, momentum=0.9))
        result = job.run(progress=False)
    assert result.state.value == "SUCCEEDED"
    (plan,) = RecordingScheduler.submitted
    assert plan.job.optimizer == Optimizer("signsgd", lr=0.01, momentum=0.9)


def test_without_the_plugin_the_job_names_the_field(dlrover_host, make_job):
    with pytest.raises(JobSpecError, match="optimizer.name"):
        make_job(optimizer=Optimizer("signsgd"))


def test_the_registered_factory_builds_it_and_it_trains(dlrover_host):
    """What train.prepare() does in a worker: factory(params, **options) from the registry."""
    torch.manual_seed(0)
    x = torch.randn(64, 4)
    y = x @ torch.tensor([[1.0], [-2.0], [0.5], [3.0]])
    model = torch.nn.Linear(4, 1)
    with register_plugin(dlrover_plugin_example.hooks):
        factory = dlrover_host.registries.optimizer.get("signsgd")
    opt = factory(model.parameters(), **Optimizer("signsgd", lr=0.05, momentum=0.5).options)
    assert isinstance(opt, SignSGD)
    losses = []
    for _ in range(60):
        loss = ((model(x) - y) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.1 * losses[0]


@pytest.mark.parametrize("options", [{"lr": 0}, {"lr": 0.1, "momentum": 1.0}, {"lr": 0.1, "weight_decay": -1}])
def test_bad_options_are_refused(options):
    with pytest.raises(ValueError, match="signsgd"):
        SignSGD(torch.nn.Linear(2, 1).parameters(), **options)
