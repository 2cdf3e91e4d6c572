"""The installed dlrover-plugin-optim-agd as the core sees it: the optimizer "agd" in the
registry, a Job that names it, and train.prepare() building it in a worker."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from dlrover_core import Job, Optimizer
from dlrover_core.plugins import PluginHost, get_host, reset_host
from dlrover_plugin_optim_agd import AGD, __version__, agd


@pytest.fixture(autouse=True)
def _fresh_host(monkeypatch):
    monkeypatch.delenv("DLROVER_PLUGINS", raising=False)
    monkeypatch.delenv("DLROVER_DISABLE_PLUGINS", raising=False)
    reset_host()
    yield
    reset_host()


def test_agd_is_registered_by_the_installed_plugin():
    """After `pip install -e plugins/optim_agd` a fresh host lists optimizer "agd", attributed to the package."""
    host = PluginHost()
    entry = host.registries.optimizer.entry("agd")
    assert entry.obj is agd
    assert entry.distribution == "dlrover-plugin-optim-agd" and entry.plugin == "optim_agd"
    info = host.plugins["optim_agd"]
    assert info.hooks == ["dlrover_register_optimizers"] and info.errors == []
    assert info.backends == {"optimizer": ["agd"]}
    assert __version__ == "0.1.0"


def test_agd_factory_builds_the_optimizer_with_the_job_options():
    """The registered factory turns params and a Job's options into an AGD."""
    factory = get_host().registries.optimizer.get("agd")
    opt = factory([torch.zeros(3, requires_grad=True)], lr=3e-4, betas=[0.9, 0.99], weight_decay=0.1)
    assert isinstance(opt, AGD)
    assert (opt.defaults["lr"], opt.defaults["betas"], opt.defaults["weight_decay"]) == (3e-4, (0.9, 0.99), 0.1)


def test_agd_plugin_loads_without_importing_torch():
    """Loading plugins (`dlrover plugins list`) does not import torch through this plugin."""
    code = ("import sys; import dlrover_plugin_optim_agd; from dlrover_core.plugins import get_host; "
            "get_host().registries.optimizer.get('agd'); print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_agd_job_resolves_and_prepare_builds_it(tmp_path):
    """Job(optimizer=Optimizer("agd", lr=3e-4)) validates, and train.prepare() in the job's worker
    returns an AGD with lr 3e-4 over the model's parameters."""
    (tmp_path / "train.py").write_text("")
    job = Job(name="agd", entrypoint="train.py", workdir=str(tmp_path), optimizer=Optimizer("agd", lr=3e-4))
    assert job.optimizer.name == "agd"
    worker = (
        "import torch\n"
        "from dlrover_core import train\n"
        "train.init()\n"
        "model, opt = train.prepare(torch.nn.Linear(4, 2))\n"
        "print(type(opt).__module__, type(opt).__name__, opt.defaults['lr'], len(opt.param_groups[0]['params']))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["DLROVER_JOB_SPEC"] = json.dumps(job.to_dict())
    env["DLROVER_ACCELERATOR"] = "cpu"
    out = subprocess.run([sys.executable, "-c", worker], capture_output=True, text=True, timeout=120, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["dlrover_plugin_optim_agd._agd", "AGD", "0.0003", "2"]
