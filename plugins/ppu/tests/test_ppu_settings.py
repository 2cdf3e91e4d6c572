"""Values public documentation does not settle are settings: argument > environment > default."""

from __future__ import annotations

from structlog.testing import capture_logs

from dlrover_plugin_ppu import PpuAccelerator


def test_defaults_come_from_the_public_sources():
    acc = PpuAccelerator()
    assert (acc.name, acc.priority, acc.torch_device_type) == ("ppu", 110, "cuda")
    assert acc.dist_backend == "nccl"
    assert acc.visible_devices_env == "CUDA_VISIBLE_DEVICES"
    assert acc.k8s_resource == "alibabacloud.com/ppu"
    assert acc.slurm_gres == "ppu"
    assert (acc.smi, acc.smi_timeout_s) == ("ppu-smi", 5.0)


def test_ppu_outranks_cuda_for_auto():
    """On a PPU machine torch.cuda answers too; "auto" must prefer ppu over cuda (100)."""
    assert PpuAccelerator.priority > 100


def test_environment_variables_change_the_class_and_its_instances(monkeypatch):
    """A scheduler plugin may read the class without making an instance: it sees the site's values."""
    monkeypatch.setenv("DLROVER_PPU_BACKEND", "pccl")
    monkeypatch.setenv("DLROVER_PPU_VISIBLE_DEVICES_ENV", "PPU_VISIBLE_DEVICES")
    monkeypatch.setenv("DLROVER_PPU_K8S_RESOURCE", "example.com/ppu")
    monkeypatch.setenv("DLROVER_PPU_SLURM_GRES", "zw810e")
    for acc in (PpuAccelerator, PpuAccelerator()):
        assert acc.dist_backend == "pccl"
        assert acc.visible_devices_env == "PPU_VISIBLE_DEVICES"
        assert acc.k8s_resource == "example.com/ppu"
        assert acc.slurm_gres == "zw810e"


def test_constructor_arguments_win_over_the_environment(monkeypatch):
    monkeypatch.setenv("DLROVER_PPU_K8S_RESOURCE", "example.com/ppu")
    acc = PpuAccelerator(k8s_resource="alibabacloud.com/ppu-4u.1g12gb", dist_backend="gloo", smi_timeout_s=1.5)
    assert acc.k8s_resource == "alibabacloud.com/ppu-4u.1g12gb"
    assert acc.dist_backend == "gloo"
    assert acc.smi_timeout_s == 1.5
    assert PpuAccelerator.k8s_resource == "example.com/ppu"  # the class is not changed


def test_an_empty_variable_counts_as_unset(monkeypatch):
    monkeypatch.setenv("DLROVER_PPU_BACKEND", "  ")
    assert PpuAccelerator().dist_backend == "nccl"


def test_an_invalid_timeout_is_logged_and_the_default_used(monkeypatch):
    monkeypatch.setenv("DLROVER_PPU_SMI_TIMEOUT_S", "-3")
    with capture_logs() as logs:
        assert PpuAccelerator().smi_timeout_s == 5.0
    assert logs[0]["event"] == "ppu_setting_invalid"
    assert logs[0]["variable"] == "DLROVER_PPU_SMI_TIMEOUT_S"
