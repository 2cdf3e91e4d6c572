"""The installed plugin as the core sees it: entry point, registry, ``create_accelerator`` and
``Job(accelerator="ascend")``."""

from __future__ import annotations

import importlib.metadata

import pytest

from dlrover_core import Job
from dlrover_core.errors import DeviceError
from dlrover_core.plugins import PluginHost, reset_host
from dlrover_plugin_ascend import AscendAccelerator, __version__


@pytest.fixture(autouse=True)
def _fresh_host():
    reset_host()
    yield
    reset_host()


def test_the_installed_distribution_registers_ascend_through_its_entry_point():
    host = PluginHost()
    entry = host.registries.accelerator.entry("ascend")
    assert entry.obj is AscendAccelerator
    assert entry.distribution == "dlrover-plugin-ascend"
    info = host.plugins["ascend"]
    assert info.errors == []
    assert info.hooks == ["dlrover_register_accelerators"]
    assert info.backends == {"accelerator": ["ascend"]}
    assert info.version == __version__ == importlib.metadata.version("dlrover-plugin-ascend")


def test_the_plugin_can_be_blocked_like_any_other():
    host = PluginHost(environ={"DLROVER_DISABLE_PLUGINS": "dlrover-plugin-ascend"})
    assert "ascend" not in host.registries.accelerator


def test_importing_the_plugin_does_not_import_torch_npu():
    """The hook spec's rule: vendor stacks are imported by probe(), never at plugin import."""
    import subprocess
    import sys

    code = "import sys, dlrover_plugin_ascend; print('torch_npu' in sys.modules, 'torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split()[0] == "False"


def test_create_accelerator_on_a_machine_without_ascend_raises_a_device_error_naming_why(no_npu_smi, no_torch_npu):
    with pytest.raises(DeviceError, match=r"accelerator 'ascend' is not usable here: npu-smi not on PATH; "
                                          r"torch_npu is not installed either"):
        PluginHost().create_accelerator("ascend")


def test_job_with_accelerator_ascend_fails_its_dry_run_with_the_reason(no_npu_smi, no_torch_npu, tmp_path):
    """Job(accelerator="ascend") is a valid spec once the plugin is installed; planning it on a
    machine without NPUs raises a DeviceError that says what is missing."""
    (tmp_path / "train.py").write_text("print('hello')\n")
    job = Job(name="npu-job", entrypoint="train.py", workdir=str(tmp_path), log_dir=str(tmp_path / "runs"),
              accelerator="ascend")
    with pytest.raises(DeviceError, match="'ascend' is not usable here: npu-smi not on PATH"):
        job.dryrun()


def test_create_accelerator_returns_the_ascend_accelerator_where_the_stack_answers(fake_npu_smi, fake_torch_npu):
    fake_npu_smi()
    fake_torch_npu(8)
    acc = PluginHost().create_accelerator("ascend")
    assert isinstance(acc, AscendAccelerator)
    assert acc.default_nproc_per_node() == 8
