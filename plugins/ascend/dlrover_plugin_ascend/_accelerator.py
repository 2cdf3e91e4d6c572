"""The ``ascend`` accelerator: Huawei Ascend NPUs through ``torch_npu`` and HCCL.

Nothing here imports ``torch_npu`` at module import time (the hook spec's rule): the probe
imports it, after ``torch``, when it runs.

Settings (environment variables, each also a constructor argument; see README.md):

====================================== ======================== ====================================
variable                               default                  what
====================================== ======================== ====================================
DLROVER_ASCEND_K8S_RESOURCE            ``huawei.com/Ascend910`` extended resource a pod requests
DLROVER_ASCEND_SLURM_GRES              ``npu``                  Slurm GRES name (site-defined)
DLROVER_ASCEND_NPU_SMI                 ``npu-smi``              the tool, a name on PATH or a path
DLROVER_ASCEND_HCCL_CONNECT_TIMEOUT_S  600                      workers' ``HCCL_CONNECT_TIMEOUT``
DLROVER_ASCEND_HCCL_EXEC_TIMEOUT_S     1836                     workers' ``HCCL_EXEC_TIMEOUT``
DLROVER_ASCEND_HCCL_IF_BASE_PORT       60000                    workers' ``HCCL_IF_BASE_PORT``
====================================== ======================== ====================================

Sources (Huawei documentation):

- HCCL_CONNECT_TIMEOUT: https://www.hiascend.com/document/detail/zh/canncommercial/83RC1/maintenref/envvar/envref_07_0149.html
- HCCL_EXEC_TIMEOUT: https://www.hiascend.com/document/detail/zh/canncommercial/900/maintenref/envvar/envref_07_0078.html
- HCCL_IF_BASE_PORT: https://www.hiascend.com/document/detail/en/canncommercial/850/maintenref/envvar/envref_07_0074.html
- ASCEND_RT_VISIBLE_DEVICES: https://www.hiascend.com/document/detail/en/canncommercial/850/maintenref/envvar/envref_07_0028.html
- Ascend Device Plugin resource names: https://www.hiascend.com/doc_center/source/en/mindcluster/730/clustersched/schedulingug/dlruntime_ug_005.html
- npu-smi: see :mod:`dlrover_plugin_ascend._npu_smi`.
"""

from __future__ import annotations

import importlib.util
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
    run_tool,
    try_import,
)
from dlrover_plugin_ascend._cann import cann_version
from dlrover_plugin_ascend._npu_smi import NpuChip, parse_npu_smi_info, visible_device_ids

__all__ = ["AscendAccelerator", "dlrover_register_accelerators"]

log = get_logger()

K8S_RESOURCE_ENV = "DLROVER_ASCEND_K8S_RESOURCE"
SLURM_GRES_ENV = "DLROVER_ASCEND_SLURM_GRES"
NPU_SMI_ENV = "DLROVER_ASCEND_NPU_SMI"
HCCL_CONNECT_TIMEOUT_ENV = "DLROVER_ASCEND_HCCL_CONNECT_TIMEOUT_S"
HCCL_EXEC_TIMEOUT_ENV = "DLROVER_ASCEND_HCCL_EXEC_TIMEOUT_S"
HCCL_IF_BASE_PORT_ENV = "DLROVER_ASCEND_HCCL_IF_BASE_PORT"

#: Resource name of the Ascend Device Plugin (MindCluster) for training NPUs; it also
#: advertises ``huawei.com/Ascend310``, ``huawei.com/Ascend310P`` and virtual NPUs.
DEFAULT_K8S_RESOURCE = "huawei.com/Ascend910"
#: GRES name; Slurm has no standard one for NPUs, each site names it in gres.conf.
DEFAULT_SLURM_GRES = "npu"

#: Seconds HCCL waits for every rank to build its links. CANN's default and floor is 120 s
#: (range [120, 7200]; the real wait is the value + 20 s; CANN env var reference,
#: HCCL_CONNECT_TIMEOUT). HCCL links lazily at the first collective, and after a restart ranks
#: reach it at different times (restore from storage, operator compilation), so we allow 600 s,
#: the same as ``Nodes.join_timeout_s``'s default.
DEFAULT_HCCL_CONNECT_TIMEOUT_S = 600
#: Seconds a device waits for its peers inside a collective. 1836 is CANN's default (range
#: (0, 17340] on Atlas training products, where it is rounded down to a multiple of 68 -
#: 1836 = 27 x 68 -, [0, 2**31-1] on A2/A3; CANN env var reference, HCCL_EXEC_TIMEOUT). We pin
#: it so every rank agrees whatever its CANN release's default, and keep it above
#: ``Failure.collective_timeout_s`` so the job's own timeout reports a stuck collective first.
DEFAULT_HCCL_EXEC_TIMEOUT_S = 1836
#: First of the host ports HCCL's root rank listens on to collect cluster information (16 or,
#: from CANN 8.2, 32 ports from here). 60000 is CANN's default (range [1024, 65520]; CANN env
#: var reference, HCCL_IF_BASE_PORT); set another base for a second job on the same hosts.
DEFAULT_HCCL_IF_BASE_PORT = 60000

#: Matmul of the node check: fp16, n x n, timed over this many repetitions after a warm-up.
NODE_CHECK_MATMUL_N = 4096
NODE_CHECK_MATMUL_REPS = 20
#: All-reduce of the node check: bytes of float32 per all-reduce, and timed repetitions.
NODE_CHECK_ALLREDUCE_BYTES = 64 * 2**20
NODE_CHECK_ALLREDUCE_REPS = 5


class _EnvSetting:
    """A class attribute read from an environment variable at each lookup, so code that reads
    it from the class (a scheduler building a pod request) sees the current value; an instance
    built with an explicit value keeps that value."""

    def __init__(self, env_var: str, default: str) -> None:
        self.env_var = env_var
        self.default = default
        self.attr = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.attr = f"_{name}"

    def __get__(self, obj: Any, objtype: type | None = None) -> str:
        if obj is not None and obj.__dict__.get(self.attr):
            return obj.__dict__[self.attr]
        return os.environ.get(self.env_var) or self.default


def _int_setting(value: int | None, env_var: str, default: int, low: int, high: int) -> int:
    """``value``, else ``$env_var``, else ``default``, checked to lie in [low, high].

    Raises:
        DeviceError: the value is not an integer in range (the message names where it came from).
    """
    where = env_var.removeprefix("DLROVER_ASCEND_").lower()
    if value is None:
        raw = os.environ.get(env_var)
        if not raw:
            return default
        where = env_var
        try:
            value = int(raw)
        except ValueError:
            raise DeviceError(f"{where}={raw!r} is not an integer (allowed: {low}..{high})") from None
    if not low <= int(value) <= high:
        raise DeviceError(f"{where}={value} is out of range (allowed: {low}..{high}, "
                          f"see CANN's environment variable reference)")
    return int(value)


def _describe(chips: list[NpuChip]) -> str:
    names = sorted({c.name for c in chips})
    return f"{len(chips)} x {'/'.join(names)}" if chips else "no devices"


class AscendAccelerator(Accelerator):
    """Huawei Ascend NPUs (Atlas training and inference products) driven by ``torch_npu``;
    collectives over HCCL.

    Present when ``npu-smi info`` answers within ``tool_timeout_s`` with a table this plugin
    understands, ``ASCEND_RT_VISIBLE_DEVICES`` selects at least one of its chips, ``torch_npu``
    imports (after ``torch``), ``torch.npu`` counts at least one device, and not every
    visible device is unhealthy.

    Args:
        k8s_resource: Kubernetes extended resource (default ``$DLROVER_ASCEND_K8S_RESOURCE``
            or ``huawei.com/Ascend910``).
        slurm_gres: Slurm GRES name (default ``$DLROVER_ASCEND_SLURM_GRES`` or ``npu``).
        npu_smi: the management tool, a name looked up on PATH or a path (default
            ``$DLROVER_ASCEND_NPU_SMI`` or ``npu-smi``).
        tool_timeout_s: seconds ``npu-smi`` may take before it counts as hung.
        hccl_connect_timeout_s: workers' ``HCCL_CONNECT_TIMEOUT``, seconds, 120..7200.
        hccl_exec_timeout_s: workers' ``HCCL_EXEC_TIMEOUT``, seconds, 1..17340.
        hccl_if_base_port: workers' ``HCCL_IF_BASE_PORT``, 1024..65520.

    Raises:
        DeviceError: a setting is out of its range.
    """

    name = "ascend"
    priority = 90
    torch_device_type = "npu"
    dist_backend = "hccl"
    visible_devices_env = "ASCEND_RT_VISIBLE_DEVICES"
    k8s_resource = _EnvSetting(K8S_RESOURCE_ENV, DEFAULT_K8S_RESOURCE)  # type: ignore[assignment]
    slurm_gres = _EnvSetting(SLURM_GRES_ENV, DEFAULT_SLURM_GRES)  # type: ignore[assignment]

    def __init__(
        self,
        *,
        k8s_resource: str | None = None,
        slurm_gres: str | None = None,
        npu_smi: str | None = None,
        tool_timeout_s: float = TOOL_TIMEOUT_S,
        hccl_connect_timeout_s: int | None = None,
        hccl_exec_timeout_s: int | None = None,
        hccl_if_base_port: int | None = None,
    ) -> None:
        self._k8s_resource = k8s_resource
        self._slurm_gres = slurm_gres
        self.npu_smi = npu_smi or os.environ.get(NPU_SMI_ENV) or "npu-smi"
        self.tool_timeout_s = tool_timeout_s
        self.hccl_connect_timeout_s = _int_setting(hccl_connect_timeout_s, HCCL_CONNECT_TIMEOUT_ENV,
                                                   DEFAULT_HCCL_CONNECT_TIMEOUT_S, 120, 7200)
        self.hccl_exec_timeout_s = _int_setting(hccl_exec_timeout_s, HCCL_EXEC_TIMEOUT_ENV,
                                                DEFAULT_HCCL_EXEC_TIMEOUT_S, 1, 17340)
        self.hccl_if_base_port = _int_setting(hccl_if_base_port, HCCL_IF_BASE_PORT_ENV,
                                              DEFAULT_HCCL_IF_BASE_PORT, 1024, 65520)

    # ----- probe ---------------------------------------------------------------------------

    def _absent(self, reason: str, **found: Any) -> DeviceReport:
        log.debug("ascend_probe_absent", reason=reason)
        return DeviceReport(accelerator=self.name, present=False, reason=reason, **found)

    def probe(self) -> DeviceReport:
        """Look for Ascend devices. Never raises; bounded by ``tool_timeout_s`` plus the time
        ``import torch_npu`` takes.

        Order: ``npu-smi info`` (model, memory in MiB, Health, driver version), then the
        chips ``ASCEND_RT_VISIBLE_DEVICES`` selects (position i of its list is device i), then
        ``torch_npu`` (imported after ``torch``) and ``torch.npu.is_available()`` /
        ``device_count()``, the count workers will see. Neither call initialises the NPU
        runtime in this process. A device is healthy when npu-smi's Health is ``OK``; when
        torch_npu's count differs from the selected chips', every device gets the health of
        all of them (logged as ``ascend_device_count_mismatch``).

        Returns:
            A :class:`DeviceReport`; ``reason`` names what is missing when not ``present``:
            ``"npu-smi not on PATH"``, ``"npu-smi timed out after 5 s"``, ``"npu-smi exited
            with status ..."``, ``"npu-smi output not understood: ..."``, ``"0 devices
            visible: ..."``, ``"torch_npu not importable: ..."``, ``"all N visible devices
            are unhealthy (...)"``.
        """
        smi = run_tool([self.npu_smi, "info"], timeout_s=self.tool_timeout_s)
        if not smi.ok:
            reason = smi.reason or "npu-smi failed"
            if _not_installed("torch_npu"):
                reason += "; torch_npu is not installed either"
            return self._absent(reason)
        try:
            info = parse_npu_smi_info(smi.stdout)
        except ValueError as exc:
            return self._absent(f"npu-smi output not understood: {exc}")
        visible = os.environ.get(self.visible_devices_env)
        ids = visible_device_ids(visible, len(info.chips))
        chips = [info.chips[i] for i in ids]
        found = {"driver_version": info.driver_version}
        if not chips:
            if not info.chips:
                return self._absent("0 devices visible: npu-smi lists no device", **found)
            return self._absent(f"0 devices visible: {self.visible_devices_env}={visible!r} selects none of the "
                                f"{len(info.chips)} devices npu-smi lists", **found)

        torch, reason = try_import("torch")
        torch_npu = None
        if reason is None:
            torch_npu, reason = try_import("torch_npu")
        if reason is not None:
            return self._absent(f"{reason} (npu-smi sees {_describe(chips)}; install the torch_npu build that "
                                f"matches this machine's CANN version)", **found)
        try:
            count = int(torch.npu.device_count()) if torch.npu.is_available() else 0
        except Exception as exc:  # a broken driver can raise anything here
            return self._absent(f"torch.npu could not count devices: {type(exc).__name__}: {exc}", **found)
        if count == 0:
            where = f" with {self.visible_devices_env}={visible!r}" if visible is not None else ""
            return self._absent(f"0 devices visible to torch_npu{where} (npu-smi sees {_describe(chips)})", **found)

        sick = [f"npu {c.npu_id} chip {c.chip_id}: {c.health}" for c in chips if not c.healthy]
        # The model comes from npu-smi, not torch.npu.get_device_name(): that one initialises the
        # NPU runtime in the calling process (torch_npu's _lazy_init), which would leave the
        # agent holding a context, and memory, on device 0 for the job's life.
        memory = [c.memory_mb for c in chips if c.memory_mb]
        found.update(model=_model(chips), memory_mb=min(memory) if memory else None,
                     runtime_version=cann_version(torch_npu))
        if len(chips) == count:
            healthy = tuple(c.healthy for c in chips)
            if not any(healthy):
                return self._absent(f"all {count} visible devices are unhealthy ({'; '.join(sick)})", **found)
        else:  # chips cannot be matched to devices: each device gets the health of them all
            log.warning("ascend_device_count_mismatch", torch_npu=count, npu_smi=len(chips),
                        visible_devices=visible)
            healthy = (not sick,) * count
        if sick:
            log.warning("ascend_devices_unhealthy", devices=sick)
        return DeviceReport(accelerator=self.name, present=True, count=count, healthy=healthy, **found)

    # ----- workers -------------------------------------------------------------------------

    def worker_env(self, local_rank: int, local_world_size: int) -> dict[str, str]:
        """HCCL settings for a worker; a variable already set in the environment is kept.

        ``HCCL_CONNECT_TIMEOUT`` and ``HCCL_EXEC_TIMEOUT`` (seconds) and ``HCCL_IF_BASE_PORT``
        (see the ``DEFAULT_*`` constants for the values and their sources). Device selection
        is torchrun's: every worker sees all the node's devices (``ASCEND_RT_VISIBLE_DEVICES``
        is passed through, never narrowed, so HCCL can use the links between them) and uses
        ``npu:<local_rank>`` (:meth:`device_for`).
        """
        wanted = {
            "HCCL_CONNECT_TIMEOUT": str(self.hccl_connect_timeout_s),
            "HCCL_EXEC_TIMEOUT": str(self.hccl_exec_timeout_s),
            "HCCL_IF_BASE_PORT": str(self.hccl_if_base_port),
        }
        return {k: v for k, v in wanted.items() if k not in os.environ}

    def device_for(self, local_rank: int) -> Any:
        """``torch.device("npu", local_rank)``, after importing ``torch_npu``.

        Raises:
            DeviceError: ``torch_npu`` cannot be imported, or fewer than ``local_rank + 1``
                devices are visible.
        """
        torch = _import_torch_npu(f"npu:{local_rank}")
        try:
            count = int(torch.npu.device_count())
        except Exception as exc:
            raise DeviceError(f"cannot use npu:{local_rank}: torch.npu.device_count() raised "
                              f"{type(exc).__name__}: {exc}") from exc
        if not 0 <= local_rank < count:
            visible = os.environ.get(self.visible_devices_env)
            raise DeviceError(f"cannot use npu:{local_rank}: {count} device(s) visible"
                              f"{f' ({self.visible_devices_env}={visible!r})' if visible is not None else ''}; "
                              f"lower nproc_per_node to at most {count}")
        return torch.device("npu", local_rank)

    # ----- node check ----------------------------------------------------------------------

    def node_check(self, *, group: Any = None) -> NodeCheckResult:
        """Time an fp16 4096 x 4096 matmul on ``npu:$LOCAL_RANK`` (0 when unset) and, with a
        process group, a 64 MiB float32 all-reduce.

        Returns:
            matmul TFLOP/s (2 n^3 flops per matmul), all-reduce bus bandwidth in GB/s by the
            nccl-tests convention (``2 (n - 1) / n x bytes / time`` for n ranks; ``None``
            without a group) and the check's wall time in seconds.

        Raises:
            DeviceError: ``torch_npu`` cannot be imported, or the matmul gives non-finite values.
        """
        torch = _import_torch_npu("the node check")
        import torch.distributed as dist  # torch: heavy, workers only

        start = time.perf_counter()
        device = torch.device("npu", int(os.environ.get("LOCAL_RANK", "0")))
        torch.npu.set_device(device)
        n, reps = NODE_CHECK_MATMUL_N, NODE_CHECK_MATMUL_REPS
        a = torch.randn(n, n, dtype=torch.float16, device=device)
        b = torch.randn(n, n, dtype=torch.float16, device=device)
        for _ in range(3):  # warm-up: operator compilation and caches
            c = torch.matmul(a, b)
        torch.npu.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            c = torch.matmul(a, b)
        torch.npu.synchronize(device)
        mm_s = time.perf_counter() - t0
        if not bool(torch.isfinite(c).all()):
            raise DeviceError(f"{device}: a {n}x{n} fp16 matmul of normal values gave non-finite results")
        tflops = 2 * n**3 * reps / mm_s / 1e12

        gbps = None
        if group is not None:
            world = dist.get_world_size(group)
            x = torch.ones(NODE_CHECK_ALLREDUCE_BYTES // 4, dtype=torch.float32, device=device)
            dist.all_reduce(x, group=group)  # warm-up: builds the HCCL communicator
            torch.npu.synchronize(device)
            t0 = time.perf_counter()
            for _ in range(NODE_CHECK_ALLREDUCE_REPS):
                dist.all_reduce(x, group=group)
            torch.npu.synchronize(device)
            ar_s = (time.perf_counter() - t0) / NODE_CHECK_ALLREDUCE_REPS
            gbps = 2 * (world - 1) / max(world, 1) * x.numel() * x.element_size() / ar_s / 1e9
        elapsed = time.perf_counter() - start
        log.debug("ascend_node_check", device=str(device), matmul_tflops=tflops, allreduce_gbps=gbps, elapsed_s=elapsed)
        return NodeCheckResult(matmul_tflops=tflops, allreduce_gbps=gbps, elapsed_s=elapsed)


def _not_installed(module: str) -> bool:
    """Whether ``module`` cannot be found, without importing it."""
    try:
        return importlib.util.find_spec(module) is None
    except (ImportError, ValueError):
        return True


def _model(chips: list[NpuChip]) -> str:
    """The chip name npu-smi shows, as "Ascend <name>" (npu-smi prints "910B3" on A2 cards and
    "Ascend910" on A3 ones)."""
    name = chips[0].name
    return name if name.lower().startswith("ascend") else f"Ascend {name}"


def _import_torch_npu(purpose: str) -> Any:
    """``torch`` with ``torch.npu`` registered (``torch_npu`` imported after ``torch``).

    Raises:
        DeviceError: either cannot be imported.
    """
    torch, reason = try_import("torch")
    if reason is None:
        _, reason = try_import("torch_npu")
    if reason is not None:
        raise DeviceError(f"cannot use {purpose}: {reason}; install the torch_npu build that matches this "
                          f"machine's CANN version (see the dlrover-plugin-ascend README)")
    return torch


@hookimpl
def dlrover_register_accelerators(register):
    """Register :class:`AscendAccelerator` as ``ascend``."""
    register(AscendAccelerator)
