"""The installed plugin: registered under the entry-point group, chosen by name or by "auto"."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from click.testing import CliRunner

from dlrover_core import hookimpl
from dlrover_core.accelerators import Accelerator, DeviceReport, NodeCheckResult
from dlrover_core.cli import main as cli
from dlrover_core.errors import DeviceError
from dlrover_core.plugins import PluginHost
from dlrover_plugin_ppu import PpuAccelerator


def test_the_installed_plugin_registers_ppu():
    host = PluginHost()
    assert "ppu" in host.registries.accelerator.names()
    entry = host.registries.accelerator.entry("ppu")
    assert (entry.obj, entry.plugin, entry.distribution) == (PpuAccelerator, "ppu", "dlrover-plugin-ppu")
    info = host.plugins["ppu"]
    assert info.errors == []
    assert info.hooks == ["dlrover_register_accelerators"]


def test_plugins_list_shows_ppu():
    result = CliRunner().invoke(cli, ["plugins", "list", "--json"])
    assert result.exit_code == 0, result.output
    (ppu,) = [p for p in json.loads(result.stdout) if p["name"] == "ppu"]
    assert ppu["distribution"] == "dlrover-plugin-ppu"
    assert ppu["backends"] == {"accelerator": ["ppu"]}


@pytest.mark.skipif(shutil.which("ppu-smi") is not None, reason="this machine has ppu-smi")
def test_asking_for_ppu_on_this_machine_is_a_clear_device_error():
    """This machine has no PPU: naming the accelerator fails with the probe's reason."""
    with pytest.raises(DeviceError) as info:
        PluginHost().create_accelerator("ppu")
    message = str(info.value)
    assert message.startswith("accelerator 'ppu' is not usable here: ppu-smi not on PATH")
    assert "dlrover doctor" in message


def test_asking_for_ppu_without_ppus_names_the_reason(no_smi, torch_cuda):
    torch_cuda(["NVIDIA H100 80GB HBM3"])
    with pytest.raises(DeviceError, match="torch.cuda devices are NVIDIA GPUs, not PPUs"):
        PluginHost().create_accelerator("ppu")


def _cuda_like_present() -> type[Accelerator]:
    class CudaLike(Accelerator):
        """Stands in for the cuda plugin on a machine where torch.cuda answers."""

        name = "cuda"
        priority = 100
        torch_device_type = "cuda"
        dist_backend = "nccl"

        def probe(self) -> DeviceReport:
            return DeviceReport(accelerator="cuda", present=True, count=2, healthy=(True, True))

        def node_check(self, *, group=None) -> NodeCheckResult:
            return NodeCheckResult(matmul_tflops=1.0, allreduce_gbps=None, elapsed_s=0.0)

    return CudaLike


def test_auto_picks_ppu_over_cuda_on_a_ppu_machine(fake_smi, torch_cuda):
    fake_smi.lists(fake_smi.TWO_PPUS).remapped("")
    torch_cuda(["PPU-ZW810E"] * 2)

    class Plugin:
        @hookimpl
        def dlrover_register_accelerators(self, register):
            register(_cuda_like_present())

    host = PluginHost(environ={"DLROVER_DISABLE_PLUGINS": "dlrover-plugin-cuda"})  # the cuda-like stands in for it
    host.register(Plugin(), name="cuda-like")
    assert host.create_accelerator("auto").name == "ppu"


def test_auto_leaves_nvidia_machines_to_cuda(no_smi, torch_cuda):
    torch_cuda(["NVIDIA H100 80GB HBM3"] * 2)

    class Plugin:
        @hookimpl
        def dlrover_register_accelerators(self, register):
            register(_cuda_like_present())

    host = PluginHost(environ={"DLROVER_DISABLE_PLUGINS": "dlrover-plugin-cuda"})  # the cuda-like stands in for it
    host.register(Plugin(), name="cuda-like")
    assert host.create_accelerator("auto").name == "cuda"


def test_loading_the_plugin_imports_no_torch():
    """Plugin discovery must stay cheap: the hook module imports neither torch nor PPU software."""
    code = "import sys, dlrover_plugin_ppu.hooks; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
