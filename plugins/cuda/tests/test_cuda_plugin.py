"""The installed dlrover-plugin-cuda as the core sees it: registration, Job selection, workers,
the node check's refusal without a GPU, and the GPU check script's CPU-side behaviour."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dlrover_core import DeviceError, Job
from dlrover_core.accelerators import Accelerator
from dlrover_core.cli import main as cli
from dlrover_core.plugins import PluginHost, get_host, reset_host
from dlrover_plugin_cuda import CudaAccelerator, __version__

REPO = Path(__file__).resolve().parents[3]
CHECK_SCRIPT = REPO / "tests" / "gpu" / "check_cuda.py"
no_cuda_here = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a usable CUDA device")


@pytest.fixture(autouse=True)
def _no_gpu_tools(tmp_path, monkeypatch):
    """A fresh plugin host, no nvidia-smi on PATH and NVML not consulted: the machine has no GPU."""
    monkeypatch.delenv("DLROVER_PLUGINS", raising=False)
    monkeypatch.delenv("DLROVER_DISABLE_PLUGINS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    monkeypatch.setattr(CudaAccelerator, "use_nvml", False)
    reset_host()
    yield
    reset_host()


def test_declares_nvidia_names():
    """The accelerator names its torch device, backend, visibility variable and scheduler resources."""
    assert issubclass(CudaAccelerator, Accelerator)
    assert (CudaAccelerator.name, CudaAccelerator.priority) == ("cuda", 100)
    assert (CudaAccelerator.torch_device_type, CudaAccelerator.dist_backend) == ("cuda", "nccl")
    assert CudaAccelerator.visible_devices_env == "CUDA_VISIBLE_DEVICES"
    assert (CudaAccelerator.k8s_resource, CudaAccelerator.slurm_gres) == ("nvidia.com/gpu", "gpu")
    assert __version__ == "0.1.0"


def test_installed_plugin_is_registered():
    """After `pip install -e plugins/cuda` a fresh host lists accelerator "cuda", attributed to the package."""
    host = PluginHost()
    entry = host.registries.accelerator.entry("cuda")
    assert entry.obj is CudaAccelerator
    assert entry.distribution == "dlrover-plugin-cuda" and entry.plugin == "cuda"
    info = host.plugins["cuda"]
    assert info.hooks == ["dlrover_register_accelerators"] and info.errors == []
    assert info.backends == {"accelerator": ["cuda"]}


def test_plugins_list_shows_it():
    """`dlrover plugins list --json` shows the plugin with its version and backend."""
    result = CliRunner().invoke(cli, ["plugins", "list", "--json"])
    assert result.exit_code == 0, result.output
    (cuda,) = [p for p in json.loads(result.stdout) if p["name"] == "cuda"]
    assert cuda["distribution"] == "dlrover-plugin-cuda" and cuda["version"] == "0.1.0"
    assert cuda["backends"] == {"accelerator": ["cuda"]}


@no_cuda_here
def test_job_on_cuda_without_gpu_fails_clearly(tmp_path):
    """Job(accelerator="cuda") is a valid spec, but planning it here raises DeviceError saying why."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    job = Job(name="gpu-job", entrypoint="train.py", workdir=str(tmp_path), accelerator="cuda")
    with pytest.raises(DeviceError) as err:
        job.dryrun()
    message = str(err.value)
    assert "accelerator 'cuda' is not usable here" in message
    assert "nvidia-smi not on PATH" in message and "torch has no CUDA" in message


@no_cuda_here
def test_auto_skips_cuda_without_gpu():
    """accelerator="auto" tries cuda first (priority 100) and moves on when it is absent."""
    assert get_host().create_accelerator("auto").name != "cuda"


def test_workers_keep_node_visibility_and_pick_local_rank():
    """Like torchrun: no per-worker CUDA_VISIBLE_DEVICES; worker i uses cuda:i, even past the visible count."""
    acc = CudaAccelerator()
    assert acc.worker_env(0, 8) == {} and acc.worker_env(7, 8) == {}
    assert acc.device_for(3) == torch.device("cuda", 3)


def test_default_nproc_without_gpu_is_one():
    assert CudaAccelerator().default_nproc_per_node() == 1


@no_cuda_here
def test_node_check_without_gpu_raises_device_error():
    """The node check refuses to run on a machine with no CUDA device, saying what torch sees."""
    with pytest.raises(DeviceError, match="the cuda node check needs a CUDA device"):
        CudaAccelerator().node_check()


def test_gpu_check_script_help():
    """tests/gpu/check_cuda.py imports and explains itself without a GPU."""
    out = subprocess.run([sys.executable, str(CHECK_SCRIPT), "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "--json" in out.stdout and "Flash Checkpoint" in out.stdout


@no_cuda_here
def test_gpu_check_script_without_gpu_exits_clearly(tmp_path):
    """Run on a machine without a GPU, the script says there is none (and why) and exits 2."""
    result = tmp_path / "r.json"
    out = subprocess.run([sys.executable, str(CHECK_SCRIPT), "--no-nvml", "--json", str(result)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "no usable NVIDIA GPU: nvidia-smi not on PATH" in out.stderr
    data = json.loads(result.read_text())
    assert data["ok"] is False and data["probe"]["present"] is False
