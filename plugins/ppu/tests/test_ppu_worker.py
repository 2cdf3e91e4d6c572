"""What a worker gets on a PPU node, and the node check's timings (run here on cpu)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from dlrover_core.errors import DeviceError
from dlrover_plugin_ppu import PpuAccelerator
from dlrover_plugin_ppu._accelerator import time_allreduce, time_matmul


def test_a_worker_uses_the_cuda_device_of_its_local_rank():
    assert PpuAccelerator().device_for(3) == torch.device("cuda", 3)


def test_workers_keep_the_nodes_visible_devices():
    """No per-worker narrowing: cuda:<local_rank> must keep meaning the node's local_rank-th PPU."""
    assert PpuAccelerator().worker_env(0, 8) == {}
    assert PpuAccelerator().worker_env(7, 8) == {}


def test_node_check_needs_torch_cuda(torch_cuda):
    torch_cuda(None)
    with pytest.raises(DeviceError, match="torch.cuda is not available"):
        PpuAccelerator().node_check()


def test_matmul_throughput_is_measured_in_tflops():
    tflops = time_matmul(torch.device("cpu"), n=64, reps=3, dtype=torch.float32)
    assert 0 < tflops < 1000


def test_a_matmul_with_non_finite_results_fails_the_check(monkeypatch):
    monkeypatch.setattr(torch, "matmul", lambda a, b: torch.full_like(a, float("nan")))
    with pytest.raises(DeviceError, match="non-finite"):
        time_matmul(torch.device("cpu"), n=8, reps=1, dtype=torch.float32)


@pytest.fixture
def one_process_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def test_allreduce_bus_bandwidth_follows_nccl_tests(one_process_group):
    """Bus bandwidth is 2(n-1)/n · bytes / time: zero for a group of one."""
    assert time_allreduce(one_process_group, torch.device("cpu"), numel=1024, reps=2) == 0.0


def test_a_wrong_allreduce_sum_fails_the_check(one_process_group, monkeypatch):
    monkeypatch.setattr(dist, "all_reduce", lambda tensor, group=None: tensor.zero_())
    with pytest.raises(DeviceError, match="summed ones to 0.0, expected 1"):
        time_allreduce(one_process_group, torch.device("cpu"), numel=16, reps=1)
