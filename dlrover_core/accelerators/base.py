"""The accelerator interface: what a device plugin tells the core about a kind of chip."""

from __future__ import annotations

import abc
from typing import Any, ClassVar

import attrs

from dlrover_core.errors import DeviceError

__all__ = ["Accelerator", "DeviceReport", "NodeCheckResult"]


@attrs.frozen(kw_only=True)
class DeviceReport:
    """What a probe found on this machine.

    Attributes:
        accelerator: the accelerator's registered name.
        present: whether usable devices were found.
        count: number of visible devices (0 when absent).
        model: device model name, e.g. ``"NVIDIA H100 80GB HBM3"``; ``None`` if unknown.
        memory_mb: memory per device in MiB; ``None`` if unknown.
        driver_version: driver version string; ``None`` if unknown.
        runtime_version: runtime (CUDA, CANN, ...) version; ``None`` if unknown.
        healthy: per-device health, one bool per device.
        reason: why nothing usable was found (``"npu-smi not on PATH"``); ``None`` if present.
    """

    accelerator: str
    present: bool
    count: int = 0
    model: str | None = None
    memory_mb: int | None = None
    driver_version: str | None = None
    runtime_version: str | None = None
    healthy: tuple[bool, ...] = ()
    reason: str | None = None


@attrs.frozen(kw_only=True)
class NodeCheckResult:
    """Timings of a node check on one node.

    Attributes:
        matmul_tflops: measured matmul throughput, TFLOP/s.
        allreduce_gbps: all-reduce bus bandwidth in GB/s (``None`` without a process group).
        elapsed_s: wall time of the whole check, seconds.
    """

    matmul_tflops: float
    allreduce_gbps: float | None
    elapsed_s: float


class Accelerator(abc.ABC):
    """A kind of accelerator (cpu, cuda, npu, ppu), registered through
    ``dlrover_register_accelerators``.

    Class attributes:
        name: registered name, what ``Job(accelerator=...)`` selects.
        priority: order for ``accelerator="auto"``; the present accelerator with the highest
            priority wins (cpu is 0).
        torch_device_type: ``torch.device`` type, e.g. ``"cuda"``, ``"npu"``, ``"cpu"``.
        dist_backend: ``torch.distributed`` backend, e.g. ``"nccl"``, ``"hccl"``, ``"gloo"``.
        visible_devices_env: env variable that restricts visible devices
            (``CUDA_VISIBLE_DEVICES``...), ``None`` when the device has none.
        k8s_resource: extended resource name for Kubernetes requests, or ``None``.
        slurm_gres: GRES name for Slurm requests, or ``None``.
    """

    name: ClassVar[str]
    priority: ClassVar[int] = 0
    torch_device_type: ClassVar[str]
    dist_backend: ClassVar[str]
    visible_devices_env: ClassVar[str | None] = None
    k8s_resource: ClassVar[str | None] = None
    slurm_gres: ClassVar[str | None] = None

    @abc.abstractmethod
    def probe(self) -> DeviceReport:
        """Look for devices on this machine. Never raises; never takes more than seconds."""

    def default_nproc_per_node(self) -> int:
        """Processes per node for ``nproc_per_node="auto"``: the device count (at least 1)."""
        return max(1, self.probe().count)

    def worker_env(self, local_rank: int, local_world_size: int) -> dict[str, str]:
        """Environment variables for the worker with ``local_rank`` (e.g. visible devices)."""
        return {}

    def numa_nodes(self) -> tuple[int, ...]:
        """The NUMA node of each device this node's workers use, in device order (the worker
        with local rank ``i`` uses device ``i``), for ``Nodes(numa_binding=...)`` (torchrun's
        ``--numa-binding``; :mod:`dlrover_core.accelerators.numa` binds each worker to CPUs
        near its device). :func:`dlrover_core.backend.pci_numa_node` reads a PCI device's.

        Raises:
            DeviceError: this accelerator's devices have no NUMA node to bind near (the
                default: no device, e.g. cpu), naming the option and the fix.
        """
        raise DeviceError(
            f"--numa-binding (nodes.numa_binding) binds each worker to the CPUs near its device, and the "
            f"{self.name} accelerator has no device with a NUMA node to bind near (torchrun fails the same way "
            "where there is no GPU); leave the option out, or run on an accelerator that has such devices (cuda)")

    def device_for(self, local_rank: int) -> Any:
        """The ``torch.device`` a worker with ``local_rank`` should use."""
        import torch  # torch: heavy, workers only

        return torch.device(self.torch_device_type, local_rank)

    @abc.abstractmethod
    def node_check(self, *, group: Any = None) -> NodeCheckResult:
        """Time a matmul and, when ``group`` (a process group) is given, an all-reduce."""
