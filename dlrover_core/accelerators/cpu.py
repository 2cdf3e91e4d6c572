"""The built-in ``cpu`` accelerator (gloo backend), registered like any plugin."""

from __future__ import annotations

import os
import platform
import time
from typing import Any

import psutil

from dlrover_core.accelerators.base import Accelerator, DeviceReport, NodeCheckResult
from dlrover_core.markers import hookimpl

__all__ = ["CpuAccelerator"]


class CpuAccelerator(Accelerator):
    """Host CPUs: always present, one "device"; collectives run over gloo."""

    name = "cpu"
    priority = 0
    torch_device_type = "cpu"
    dist_backend = "gloo"

    def probe(self) -> DeviceReport:
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        try:
            memory_mb = int(psutil.virtual_memory().total // 2**20)
        except Exception:  # psutil is a dependency, but a probe never raises
            memory_mb = None
        return DeviceReport(
            accelerator=self.name,
            present=True,
            count=1,
            model=f"{platform.machine()} ({cores} cores)",
            memory_mb=memory_mb,
            healthy=(True,),
        )

    def default_nproc_per_node(self) -> int:
        """Half the usable cores, at least 1 (leaves room for the agent and data loading)."""
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        return max(1, cores // 2)

    def device_for(self, local_rank: int) -> Any:
        import torch  # torch: heavy, workers only

        return torch.device("cpu")

    def node_check(self, *, group: Any = None) -> NodeCheckResult:
        """Time a 512×512 float32 matmul (×20) and a 4 MiB float32 all-reduce (×5)."""
        import torch  # torch: heavy, workers only
        import torch.distributed as dist  # torch: heavy, workers only

        start = time.perf_counter()
        n, reps = 512, 20
        a = torch.randn(n, n)
        b = torch.randn(n, n)
        torch.matmul(a, b)  # warm-up
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b)
        mm_s = time.perf_counter() - t0
        tflops = 2 * n**3 * reps / mm_s / 1e12
        gbps = None
        if group is not None:
            world = dist.get_world_size(group)
            x = torch.ones(2**20)
            dist.all_reduce(x, group=group)
            t0 = time.perf_counter()
            for _ in range(5):
                dist.all_reduce(x, group=group)
            ar_s = (time.perf_counter() - t0) / 5
            # Bus bandwidth of a ring all-reduce (nccl-tests' convention): 2(n-1)/n · bytes / t.
            gbps = (2 * (world - 1) / max(world, 1)) * x.numel() * 4 / ar_s / 1e9
        return NodeCheckResult(matmul_tflops=tflops, allreduce_gbps=gbps, elapsed_s=time.perf_counter() - start)


@hookimpl
def dlrover_register_accelerators(register):
    register(CpuAccelerator)
