"""What workers get from the ``ascend`` accelerator: HCCL environment, their device, and the
scheduler-facing settings (Kubernetes resource, Slurm GRES)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from dlrover_core.errors import DeviceError
from dlrover_plugin_ascend import AscendAccelerator


def test_the_class_declares_npu_hccl_and_ascends_visible_devices_variable():
    assert AscendAccelerator.name == "ascend"
    assert AscendAccelerator.priority == 90
    assert AscendAccelerator.torch_device_type == "npu"
    assert AscendAccelerator.dist_backend == "hccl"
    assert AscendAccelerator.visible_devices_env == "ASCEND_RT_VISIBLE_DEVICES"


def test_workers_get_hccl_timeouts_and_base_port_defaults():
    """Defaults: connect 600 s, exec 1836 s (CANN's own default, pinned), base port 60000."""
    env = AscendAccelerator().worker_env(0, 8)
    assert env == {"HCCL_CONNECT_TIMEOUT": "600", "HCCL_EXEC_TIMEOUT": "1836", "HCCL_IF_BASE_PORT": "60000"}


def test_every_local_rank_gets_the_same_settings_and_visible_devices_is_not_narrowed(monkeypatch):
    """Device selection is torchrun's: npu:<local_rank>, all devices visible to every worker."""
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "0,1,2,3")
    acc = AscendAccelerator()
    envs = [acc.worker_env(rank, 4) for rank in range(4)]
    assert all(e == envs[0] for e in envs)
    assert "ASCEND_RT_VISIBLE_DEVICES" not in envs[0]


def test_a_value_the_user_already_set_is_never_overridden(monkeypatch):
    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "1200")
    monkeypatch.setenv("HCCL_IF_BASE_PORT", "50000")
    env = AscendAccelerator().worker_env(0, 1)
    assert env == {"HCCL_EXEC_TIMEOUT": "1836"}


def test_settings_come_from_dlrover_variables_or_constructor_arguments(monkeypatch):
    monkeypatch.setenv("DLROVER_ASCEND_HCCL_CONNECT_TIMEOUT_S", "300")
    monkeypatch.setenv("DLROVER_ASCEND_HCCL_EXEC_TIMEOUT_S", "544")
    monkeypatch.setenv("DLROVER_ASCEND_HCCL_IF_BASE_PORT", "61000")
    assert AscendAccelerator().worker_env(0, 1) == {
        "HCCL_CONNECT_TIMEOUT": "300", "HCCL_EXEC_TIMEOUT": "544", "HCCL_IF_BASE_PORT": "61000"}
    explicit = AscendAccelerator(hccl_connect_timeout_s=7200, hccl_exec_timeout_s=68, hccl_if_base_port=1024)
    assert explicit.worker_env(0, 1) == {
        "HCCL_CONNECT_TIMEOUT": "7200", "HCCL_EXEC_TIMEOUT": "68", "HCCL_IF_BASE_PORT": "1024"}


@pytest.mark.parametrize("var,value,message", [
    ("DLROVER_ASCEND_HCCL_CONNECT_TIMEOUT_S", "60", "DLROVER_ASCEND_HCCL_CONNECT_TIMEOUT_S=60 is out of range"),
    ("DLROVER_ASCEND_HCCL_EXEC_TIMEOUT_S", "20000", "allowed: 1..17340"),
    ("DLROVER_ASCEND_HCCL_IF_BASE_PORT", "80", "allowed: 1024..65520"),
    ("DLROVER_ASCEND_HCCL_IF_BASE_PORT", "sixty", "'sixty' is not an integer"),
])
def test_a_setting_out_of_cann_range_is_refused_naming_the_variable(monkeypatch, var, value, message):
    monkeypatch.setenv(var, value)
    with pytest.raises(DeviceError, match=message):
        AscendAccelerator()


def test_an_argument_out_of_range_is_refused_naming_the_argument():
    with pytest.raises(DeviceError, match="hccl_connect_timeout_s=100 is out of range"):
        AscendAccelerator(hccl_connect_timeout_s=100)


def test_k8s_resource_and_slurm_gres_default_and_follow_the_environment_even_on_the_class(monkeypatch):
    """A scheduler may read them from the class: the current environment applies there too."""
    assert AscendAccelerator.k8s_resource == "huawei.com/Ascend910"
    assert AscendAccelerator.slurm_gres == "npu"
    monkeypatch.setenv("DLROVER_ASCEND_K8S_RESOURCE", "huawei.com/Ascend310P")
    monkeypatch.setenv("DLROVER_ASCEND_SLURM_GRES", "ascend")
    assert AscendAccelerator.k8s_resource == "huawei.com/Ascend310P"
    assert AscendAccelerator().slurm_gres == "ascend"


def test_constructor_arguments_override_the_k8s_resource_and_gres():
    acc = AscendAccelerator(k8s_resource="huawei.com/Ascend910-4c", slurm_gres="npu910")
    assert (acc.k8s_resource, acc.slurm_gres) == ("huawei.com/Ascend910-4c", "npu910")
    assert AscendAccelerator.k8s_resource == "huawei.com/Ascend910"


def test_device_for_without_torch_npu_raises_a_device_error_saying_why(no_torch_npu):
    with pytest.raises(DeviceError, match=r"cannot use npu:0: torch_npu not importable: ModuleNotFoundError.*CANN"):
        AscendAccelerator().device_for(0)


def test_node_check_without_torch_npu_raises_a_device_error(no_torch_npu):
    with pytest.raises(DeviceError, match="cannot use the node check: torch_npu not importable"):
        AscendAccelerator().node_check()


_DEVICE_FOR = textwrap.dedent("""\
    import sys
    sys.path.insert(0, sys.argv[1])
    from dlrover_core.errors import DeviceError
    from dlrover_plugin_ascend import AscendAccelerator
    acc = AscendAccelerator()
    for rank in (0, 1, 3):
        try:
            print(rank, acc.device_for(rank))
        except DeviceError as exc:
            print(rank, "DeviceError:", exc)
""")


def test_device_for_gives_npu_local_rank_once_torch_npu_registers_the_backend(fake_torch_npu):
    """In a fresh process (the fake renames torch's privateuse1 backend to "npu", as torch_npu
    does, which cannot be undone), local rank r gets npu:r while r < the visible count."""
    site = fake_torch_npu(4, rename_backend=True)
    done = subprocess.run([sys.executable, "-c", _DEVICE_FOR, str(site)], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "ASCEND_RT_VISIBLE_DEVICES": "1,2"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "0 npu:0",
        "1 npu:1",
        "3 DeviceError: cannot use npu:3: 2 device(s) visible (ASCEND_RT_VISIBLE_DEVICES='1,2'); "
        "lower nproc_per_node to at most 2",
    ]
