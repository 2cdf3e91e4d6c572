"""The ``cuda`` accelerator: NVIDIA GPUs through CUDA, collectives over NCCL.

How :meth:`CudaAccelerator.probe` decides (details and sources in :mod:`._probe`):

1. Read every GPU from NVML when ``pynvml`` imports (``pip install dlrover-plugin-cuda[nvml]``),
   else from ``nvidia-smi --query-gpu=... --format=csv,noheader,nounits``, with a timeout.
   Both are NVIDIA-only, so a device they list is an NVIDIA GPU.
2. Keep the GPUs that ``CUDA_VISIBLE_DEVICES`` makes visible, in its order.
3. Cross-check with torch: a torch without CUDA (``torch.version.cuda is None``) cannot use the
   GPUs, nor can one whose ``torch.cuda.is_available()`` is False (often a driver older than
   torch's CUDA runtime); both make the report absent, with that reason. When torch counts
   another number of devices than the tool, torch's count wins (it is what workers see).
4. When neither NVML nor nvidia-smi answers but torch's CUDA does, the devices are reported
   only if their names are NVIDIA products': other chips (Alibaba T-Head PPU) also answer
   through ``torch.cuda`` and belong to their own plugin.
"""

from __future__ import annotations

import os
import time
from typing import Any

from dlrover_core import DeviceError, hookimpl
from dlrover_core.backend import (
    TOOL_TIMEOUT_S,
    Accelerator,
    DeviceReport,
    NodeCheckResult,
    get_logger,
    pci_numa_node,
    try_import,
)
from dlrover_plugin_cuda._probe import (
    Gpu,
    TorchCuda,
    is_nvidia_name,
    query_nvidia_smi,
    read_nvml,
    select_visible,
    torch_cuda,
)

__all__ = ["CudaAccelerator", "dlrover_register_accelerators"]

log = get_logger()


class CudaAccelerator(Accelerator):
    """NVIDIA GPUs (CUDA); collectives over NCCL.

    Args:
        tool_timeout_s: seconds ``nvidia-smi`` (or NVML) gets to answer before the probe gives
            up and says it timed out; default :attr:`tool_timeout_s`.
        use_nvml: read the GPUs through ``pynvml`` (package ``nvidia-ml-py``) when it imports;
            ``False`` always asks ``nvidia-smi``. Default :attr:`use_nvml`.
        require_torch_cuda: report GPUs as absent when the installed torch has no CUDA (the
            workers could not use them). Default :attr:`require_torch_cuda`.

    Workers: ``worker_env`` leaves ``CUDA_VISIBLE_DEVICES`` as the node has it and each worker
    uses ``cuda:<LOCAL_RANK>`` (:meth:`device_for`), as torchrun does.
    """

    name = "cuda"
    priority = 100
    torch_device_type = "cuda"
    dist_backend = "nccl"
    visible_devices_env = "CUDA_VISIBLE_DEVICES"
    k8s_resource = "nvidia.com/gpu"
    slurm_gres = "gpu"

    #: Seconds the management tool gets to answer.
    tool_timeout_s: float = TOOL_TIMEOUT_S
    #: Prefer NVML (``pynvml``) over ``nvidia-smi`` when it imports.
    use_nvml: bool = True
    #: Where sysfs is mounted (a GPU's NUMA node: ``<sysfs>/bus/pci/devices/<address>/numa_node``).
    sysfs: str = "/sys"
    #: A torch without CUDA makes GPUs absent (nobody could use them).
    require_torch_cuda: bool = True
    #: Node check: matrix side (elements) and timed repetitions of the matmul.
    matmul_size: int = 4096
    matmul_reps: int = 50
    #: Node check: all-reduce buffer in MiB (float32) and timed repetitions.
    allreduce_mib: int = 64
    allreduce_reps: int = 10

    def __init__(self, *, tool_timeout_s: float | None = None, use_nvml: bool | None = None,
                 require_torch_cuda: bool | None = None) -> None:
        if tool_timeout_s is not None:
            self.tool_timeout_s = float(tool_timeout_s)
        if use_nvml is not None:
            self.use_nvml = use_nvml
        if require_torch_cuda is not None:
            self.require_torch_cuda = require_torch_cuda
        self._numa_nodes: tuple[int, ...] | None = None

    # ----- probe ---------------------------------------------------------------------------

    def probe(self) -> DeviceReport:
        """Find the visible NVIDIA GPUs (see the module docstring). Never raises; takes at most
        about ``tool_timeout_s`` seconds plus torch's import (twice the timeout when an old
        driver makes nvidia-smi ask again without the health fields)."""
        try:
            return self._probe()
        except Exception as exc:  # a probe never raises
            log.warning("cuda_probe_failed", error=f"{type(exc).__name__}: {exc}")
            return self._absent(f"cuda probe failed: {type(exc).__name__}: {exc}")

    def _absent(self, reason: str, **known: Any) -> DeviceReport:
        return DeviceReport(accelerator=self.name, present=False, count=0, reason=reason, **known)

    def _probe(self) -> DeviceReport:
        notes: list[str] = []
        inventory = None
        if self.use_nvml:
            nvml, _ = try_import("pynvml")
            if nvml is not None:
                inventory, why = read_nvml(nvml, timeout_s=self.tool_timeout_s)
                if inventory is None:
                    if "did not answer" in (why or ""):
                        return self._absent(f"{why} (a hung GPU or driver?)")
                    notes.append(why or "NVML failed")
        smi_reason = None
        if inventory is None:
            inventory, smi_reason = query_nvidia_smi(timeout_s=self.tool_timeout_s)
        facts = torch_cuda()
        if inventory is None:
            why = "; ".join([*notes, smi_reason or "nvidia-smi failed"])
            if "timed out" in why:
                return self._absent(f"{why} (a hung GPU or driver?)")
            return self._from_torch_only(why, facts)
        return self._from_inventory(inventory.source, inventory.gpus, inventory.driver_version, facts)

    def _from_inventory(self, source: str, gpus: tuple[Gpu, ...], driver: str | None, facts: TorchCuda) -> DeviceReport:
        env_value = os.environ.get(self.visible_devices_env or "")
        visible, note = select_visible(gpus, env_value)
        if note:
            log.warning("cuda_visible_devices_entry_ignored", note=note, value=env_value)
        if not visible:
            if not gpus:
                return self._absent(f"0 devices visible ({source} lists no GPU)", driver_version=driver)
            detail = note or f"{self.visible_devices_env}={env_value!r}"
            return self._absent(f"0 devices visible ({detail}; {source} lists {len(gpus)} GPU(s))",
                                driver_version=driver)
        names = list(dict.fromkeys(g.name for g in visible if g.name))
        model = ", ".join(names) or None
        memories = [g.memory_mb for g in visible if g.memory_mb is not None]
        memory_mb = min(memories) if memories else None
        known = {"model": model, "memory_mb": memory_mb, "driver_version": driver, "runtime_version": facts.cuda}
        lists = f"{source} lists {len(visible)} visible NVIDIA GPU(s) ({model or 'model unknown'})"
        if facts.cuda is None:
            if self.require_torch_cuda:
                return self._absent(f"{lists} but torch has no CUDA ({facts.describe()}); install a CUDA build "
                                    f"of torch", **known)
        elif not facts.available:
            extra = f": {facts.error}" if facts.error else ""
            return self._absent(f"{lists} but torch.cuda.is_available() is False ({facts.describe()}, driver "
                                f"{driver or 'unknown'}{extra}); is the driver older than torch's CUDA runtime?",
                                **known)
        healthy = [g.healthy for g in visible]
        for g in visible:
            if not g.healthy:
                log.warning("cuda_device_unhealthy", index=g.index, uuid=g.uuid, name=g.name, problems=list(g.problems))
        count = len(visible)
        if facts.count is not None and facts.available and facts.count != count:
            log.warning("cuda_count_mismatch", source=source, tool_count=count, torch_count=facts.count,
                        hint="torch's count is used; check CUDA_VISIBLE_DEVICES and MIG settings")
            count = facts.count
            healthy = (healthy + [True] * count)[:count]
        log.debug("cuda_probed", source=source, count=count, model=model, unhealthy=healthy.count(False))
        return DeviceReport(accelerator=self.name, present=True, count=count, healthy=tuple(healthy), **known)

    def _from_torch_only(self, why: str, facts: TorchCuda) -> DeviceReport:
        """No NVIDIA tool answered (``why``): report from torch's CUDA, NVIDIA devices only."""
        if facts.cuda is None:
            joiner = "; " if ":" in why else " and "
            return self._absent(f"{why}{joiner}torch has no CUDA ({facts.describe()})")
        if not facts.available:
            extra = f": {facts.error}" if facts.error else ""
            return self._absent(f"{why}; torch.cuda.is_available() is False ({facts.describe()}{extra})",
                                runtime_version=facts.cuda)
        if not facts.count:
            return self._absent(f"0 devices visible (torch.cuda.device_count() is 0; {why})",
                                runtime_version=facts.cuda)
        import torch  # torch: heavy, workers only

        names = [torch.cuda.get_device_name(i) for i in range(facts.count)]
        foreign = [n for n in names if not is_nvidia_name(n)]
        if foreign:
            return self._absent(f"torch.cuda devices are not NVIDIA GPUs ({foreign[0]}); see the ppu plugin")
        memory_mb = int(torch.cuda.get_device_properties(0).total_memory) // 2**20
        log.info("cuda_probed_through_torch", reason=why, count=facts.count)
        return DeviceReport(accelerator=self.name, present=True, count=facts.count,
                            model=", ".join(dict.fromkeys(names)), memory_mb=memory_mb,
                            runtime_version=facts.cuda, healthy=(True,) * facts.count)

    # ----- workers -------------------------------------------------------------------------

    def default_nproc_per_node(self) -> int:
        """One worker per visible GPU (at least 1)."""
        return max(1, self.probe().count)

    def worker_env(self, local_rank: int, local_world_size: int) -> dict[str, str]:
        """Nothing: like torchrun, every worker keeps the node's ``CUDA_VISIBLE_DEVICES`` and
        selects ``cuda:<LOCAL_RANK>`` (see :meth:`device_for`); narrowing visibility per worker
        would break CUDA IPC and NVLink peer access between the workers of a node."""
        return {}

    def numa_nodes(self) -> tuple[int, ...]:
        """The NUMA node of each visible GPU, in ``CUDA_VISIBLE_DEVICES`` order: its PCI
        address from NVML or ``nvidia-smi`` (``pci.bus_id``), then that PCI device's
        ``numa_node`` in sysfs, as torch's ``--numa-binding`` finds it (torch asks CUDA for the
        address). Read once per accelerator object (an agent asks at every worker start).

        Raises:
            DeviceError: neither NVML nor nvidia-smi answered, no GPU is visible, or a GPU's
                PCI address or NUMA node is unknown (a MIG instance named without its GPU).
        """
        if self._numa_nodes is None:
            inventory, why = None, None
            if self.use_nvml:
                nvml, _ = try_import("pynvml")
                if nvml is not None:
                    inventory, why = read_nvml(nvml, timeout_s=self.tool_timeout_s)
            if inventory is None:
                inventory, why = query_nvidia_smi(timeout_s=self.tool_timeout_s)
            if inventory is None:
                raise DeviceError(f"--numa-binding: cannot tell which NUMA node each GPU is on: {why}")
            visible, _ = select_visible(inventory.gpus, os.environ.get(self.visible_devices_env or ""))
            if not visible:
                raise DeviceError("--numa-binding: no GPU is visible here to bind the workers near")
            nodes = []
            for gpu in visible:
                if not gpu.pci_bus_id:
                    raise DeviceError(f"--numa-binding: the PCI address of GPU {gpu.uuid or gpu.index} is unknown "
                                      "(a MIG instance is named by its GPU's UUID: MIG-GPU-<uuid>/...)")
                nodes.append(pci_numa_node(gpu.pci_bus_id, sysfs=self.sysfs))
            self._numa_nodes = tuple(nodes)
        return self._numa_nodes

    def device_for(self, local_rank: int) -> Any:
        """``torch.device("cuda", local_rank)``: the ``local_rank``-th visible GPU."""
        import torch  # torch: heavy, workers only

        return torch.device("cuda", local_rank)

    # ----- node check ----------------------------------------------------------------------

    def node_check(self, *, group: Any = None) -> NodeCheckResult:
        """Time a bf16 (fp16 where bf16 is unsupported) :attr:`matmul_size`² matmul on the
        current GPU and, when ``group`` is given, a float32 all-reduce of :attr:`allreduce_mib`
        MiB; both after a warm-up, timed between ``torch.cuda.synchronize()`` calls.

        Throughput: ``2·n³`` FLOP per matmul, in TFLOP/s. All-reduce: bus bandwidth in GB/s
        (10⁹ B/s), ``busbw = 2(n-1)/n · bytes / time`` for ``n`` ranks, the convention of
        nccl-tests (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md).

        Raises:
            DeviceError: no CUDA device, a matmul with non-finite results, or an all-reduce
                with a wrong sum.
        """
        facts = torch_cuda()
        if not facts.available:
            raise DeviceError(f"the cuda node check needs a CUDA device; {facts.describe()} sees none"
                              + (f" ({facts.error})" if facts.error else ""))
        import torch  # torch: heavy, workers only
        import torch.distributed as dist  # torch: heavy, workers only

        start = time.perf_counter()
        device = torch.device("cuda", torch.cuda.current_device())
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        n, reps = self.matmul_size, self.matmul_reps
        gen = torch.Generator(device=device)
        gen.manual_seed(0)
        a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
        b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
        c = torch.empty_like(a)
        for _ in range(3):
            torch.matmul(a, b, out=c)
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b, out=c)
        torch.cuda.synchronize(device)
        mm_s = time.perf_counter() - t0
        if not bool(torch.isfinite(c).all()):
            raise DeviceError(f"matmul on {device} ({torch.cuda.get_device_name(device)}) gave non-finite values")
        tflops = 2 * n**3 * reps / mm_s / 1e12
        del a, b, c
        gbps = None
        if group is not None:
            world = dist.get_world_size(group)
            numel = self.allreduce_mib * 2**20 // 4
            x = torch.ones(numel, device=device, dtype=torch.float32)
            dist.all_reduce(x, group=group)
            torch.cuda.synchronize(device)
            got = float(x[0].item())
            if got != world:
                raise DeviceError(f"all-reduce of ones over {world} rank(s) on {device} gave {got}")
            x.zero_()  # later sums stay 0: no overflow however many repetitions
            dist.all_reduce(x, group=group)
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            for _ in range(self.allreduce_reps):
                dist.all_reduce(x, group=group)
            torch.cuda.synchronize(device)
            ar_s = (time.perf_counter() - t0) / self.allreduce_reps
            gbps = (2 * (world - 1) / world) * numel * 4 / ar_s / 1e9
        elapsed = time.perf_counter() - start
        log.debug("cuda_node_check", device=str(device), dtype=str(dtype), matmul_tflops=round(tflops, 1),
                  allreduce_gbps=None if gbps is None else round(gbps, 1), elapsed_s=round(elapsed, 3))
        return NodeCheckResult(matmul_tflops=tflops, allreduce_gbps=gbps, elapsed_s=elapsed)


@hookimpl
def dlrover_register_accelerators(register):
    """Register :class:`CudaAccelerator` (name ``cuda``)."""
    register(CudaAccelerator)
