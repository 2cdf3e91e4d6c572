"""The ``ppu`` accelerator: T-Head Zhenwu PPUs (PPU-ZW810E and kin), driven through torch.cuda.

A PPU implements the CUDA runtime and driver APIs, so PyTorch reaches it through
``torch.cuda`` and ``torch.device("cuda", i)``; there is no ``torch.ppu`` (FlagGems' T-Head
backend, https://github.com/flagos-ai/FlagGems/tree/master/src/flag_gems/runtime/backend/_thead).
Collectives go through PCCL, which implements the NCCL API, so the ``torch.distributed``
backend is ``nccl`` (Alibaba Cloud, "PCCL: NCCL APIs and environment variable support",
https://help.aliyun.com/en/document_detail/2997068.html).

Because an NVIDIA GPU answers through the very same ``torch.cuda`` calls, the probe claims
devices only on positive evidence of a PPU: ``ppu-smi`` lists them (and torch.cuda does not
show NVIDIA GPUs), or ppu-smi cannot be asked and every ``torch.cuda.get_device_name()``
matches the PPU name pattern (``PPU-ZW810E``; ``alixpu`` on early SDKs).
"""

from __future__ import annotations

import glob
import math
import os
import re
import time
from collections.abc import Callable
from typing import Any

import attrs

from dlrover_core import DeviceError
from dlrover_core.backend import (
    TOOL_TIMEOUT_S,
    Accelerator,
    DeviceReport,
    NodeCheckResult,
    cpu_only_torch,
    get_logger,
    run_tool,
    try_import,
)
from dlrover_plugin_ppu._settings import (
    BACKEND_ENV,
    K8S_RESOURCE_ENV,
    NAME_PATTERN_ENV,
    SLURM_GRES_ENV,
    SMI_ENV,
    SMI_TIMEOUT_ENV,
    VISIBLE_DEVICES_ENV_ENV,
    EnvSetting,
)
from dlrover_plugin_ppu._smi import (
    CSV_FORMAT,
    DEVICE_PROPERTIES,
    REMAP_PROPERTIES,
    SmiDevice,
    SmiOutputError,
    parse_devices,
    parse_remapped_rows,
    select_visible,
)

__all__ = ["DEFAULT_NAME_PATTERN", "PpuAccelerator", "time_allreduce", "time_matmul"]

log = get_logger()

#: Device names taken for a PPU: ``PPU-ZW810E`` (what ppu-smi, the ACK node label
#: ``aliyun.accelerator/ppu_name`` and ``torch.cuda.get_device_name()`` report on 810E
#: machines) and ``alixpu`` (the product name early PPU SDKs report).
DEFAULT_NAME_PATTERN = r"\bPPU\b|alixpu"

#: Device names that are NVIDIA GPUs (``NVIDIA H100 80GB HBM3``, ``Tesla V100-SXM2-32GB``...).
_NVIDIA_NAME = re.compile(r"\b(nvidia|tesla|geforce|quadro|titan)\b", re.IGNORECASE)

#: Device nodes of the PPU kernel driver, ``/dev/alixpu_ppu<minor>`` (PPU-SMI manual,
#: "Minor Number"); only used to make the "ppu-smi not on PATH" reason more helpful.
_DEVICE_NODES = "/dev/alixpu_ppu*"


def _positive_float(value: str) -> float:
    number = float(value)
    if not math.isfinite(number) or number <= 0:
        raise ValueError(f"{value!r} is not a positive number of seconds")
    return number


@attrs.frozen
class _SmiAnswer:
    devices: list[SmiDevice] | None  # None: ppu-smi could not be asked or was not understood
    reason: str | None = None


@attrs.frozen(kw_only=True)
class _TorchView:
    available: bool = False
    count: int = 0
    names: tuple[str, ...] = ()
    memory_mb: int | None = None
    cuda_version: str | None = None
    reason: str | None = None


class PpuAccelerator(Accelerator):
    """T-Head Zhenwu PPUs through PyTorch's CUDA API, collectives over PCCL (``nccl``).

    ``priority`` is 110, above the ``cuda`` plugin's 100: on a PPU machine torch.cuda answers
    too, and ``accelerator="auto"`` must pick ``ppu`` there. It cannot take NVIDIA machines
    away from ``cuda``, because this probe refuses NVIDIA GPUs (and the cuda plugin refuses
    devices that are not NVIDIA's).

    The values public documentation does not settle are settings: a constructor argument
    wins over the environment variable, which wins over the default (the registry builds
    accelerators with no arguments, so a site normally uses the variables).

    Args:
        dist_backend: ``torch.distributed`` backend; ``DLROVER_PPU_BACKEND``, default ``nccl``.
        visible_devices_env: variable that restricts visible PPUs;
            ``DLROVER_PPU_VISIBLE_DEVICES_ENV``, default ``CUDA_VISIBLE_DEVICES``.
        k8s_resource: Kubernetes extended resource; ``DLROVER_PPU_K8S_RESOURCE``, default
            ``alibabacloud.com/ppu``.
        slurm_gres: Slurm GRES name; ``DLROVER_PPU_SLURM_GRES``, default ``ppu``.
        smi: the ppu-smi program, a name on ``PATH`` or a path; ``DLROVER_PPU_SMI``, default
            ``ppu-smi``.
        smi_timeout_s: seconds all ppu-smi calls of one probe may take together;
            ``DLROVER_PPU_SMI_TIMEOUT_S``, default 5.
        name_pattern: case-insensitive regular expression a torch.cuda device name must match
            to count as a PPU when ppu-smi cannot be asked; ``DLROVER_PPU_NAME_PATTERN``,
            default :data:`DEFAULT_NAME_PATTERN`.
    """

    name = "ppu"
    priority = 110
    torch_device_type = "cuda"
    dist_backend = EnvSetting(BACKEND_ENV, "nccl")
    visible_devices_env = EnvSetting(VISIBLE_DEVICES_ENV_ENV, "CUDA_VISIBLE_DEVICES")
    k8s_resource = EnvSetting(K8S_RESOURCE_ENV, "alibabacloud.com/ppu")
    slurm_gres = EnvSetting(SLURM_GRES_ENV, "ppu")
    smi = EnvSetting(SMI_ENV, "ppu-smi")
    smi_timeout_s = EnvSetting(SMI_TIMEOUT_ENV, TOOL_TIMEOUT_S, convert=_positive_float)
    name_pattern = EnvSetting(NAME_PATTERN_ENV, DEFAULT_NAME_PATTERN)

    #: Node check sizes: an n×n matmul (bf16 where supported) timed over ``MATMUL_REPS`` runs,
    #: and a float32 all-reduce of ``ALLREDUCE_NUMEL`` elements (64 MiB, DLRover's size) timed
    #: over ``ALLREDUCE_REPS`` runs.
    MATMUL_N = 8192
    MATMUL_REPS = 20
    ALLREDUCE_NUMEL = 2**24
    ALLREDUCE_REPS = 10

    def __init__(
        self,
        *,
        dist_backend: str | None = None,
        visible_devices_env: str | None = None,
        k8s_resource: str | None = None,
        slurm_gres: str | None = None,
        smi: str | None = None,
        smi_timeout_s: float | None = None,
        name_pattern: str | None = None,
    ) -> None:
        given = {"dist_backend": dist_backend, "visible_devices_env": visible_devices_env,
                 "k8s_resource": k8s_resource, "slurm_gres": slurm_gres, "smi": smi,
                 "smi_timeout_s": smi_timeout_s, "name_pattern": name_pattern}
        for key, value in given.items():
            if value is not None:
                setattr(self, key, value)

    # ----- probe ---------------------------------------------------------------------------

    def probe(self) -> DeviceReport:
        """Look for PPUs; never raises, takes at most ``smi_timeout_s`` plus torch's own
        device query.

        ``present`` only on positive evidence of a PPU (see the module docstring). The
        ``reason`` when absent starts with one of: ``ppu-smi not on PATH``, ``ppu-smi timed
        out after N s``, ``ppu-smi exited with status N``, ``ppu-smi output not understood``,
        ``0 devices visible``, ``torch.cuda devices are NVIDIA GPUs, not PPUs``, ``ppu-smi
        lists N PPU(s) but torch.cuda is not available``.
        """
        try:
            report = self._probe()
        except Exception as exc:  # a probe never raises: a broken vendor stack is a reason
            log.warning("ppu_probe_failed", error=f"{type(exc).__name__}: {exc}")
            report = self._absent(f"probe failed: {type(exc).__name__}: {exc}")
        log.debug("ppu_probe", present=report.present, count=report.count, model=report.model,
                  reason=report.reason)
        return report

    def _absent(self, reason: str) -> DeviceReport:
        return DeviceReport(accelerator=self.name, present=False, reason=reason)

    def _probe(self) -> DeviceReport:
        try:
            pattern = re.compile(self.name_pattern, re.IGNORECASE)
        except re.error as exc:
            return self._absent(f"{NAME_PATTERN_ENV}={self.name_pattern!r} is not a regular expression: {exc}")
        smi = self._ask_smi()
        view = self._ask_torch()
        looks_ppu = [bool(pattern.search(n)) for n in view.names]
        looks_nvidia = [bool(_NVIDIA_NAME.search(n)) and not p for n, p in zip(view.names, looks_ppu, strict=True)]
        seen = _describe(view.names)

        if smi.devices is not None:  # ppu-smi answered and was understood
            listed = len(smi.devices)
            if listed == 0:
                return self._absent("0 devices visible: ppu-smi lists no PPU")
            if not view.available:
                return self._absent(f"ppu-smi lists {listed} PPU(s) but {view.reason}: the PPU build of "
                                    f"PyTorch (T-Head's PPU pip source) is needed to use them")
            if view.count == 0:
                return self._absent(f"0 devices visible: ppu-smi lists {listed} PPU(s) but torch.cuda sees none "
                                    f"({self._visible_setting()})")
            if any(looks_nvidia):
                return self._absent(f"torch.cuda devices are NVIDIA GPUs, not PPUs ({seen}), although ppu-smi "
                                    f"lists {listed} PPU(s): this PyTorch drives NVIDIA's CUDA")
            return self._present_from_smi(smi.devices, view)

        if view.available and view.count > 0:
            if all(looks_ppu):
                log.debug("ppu_probe_without_smi", reason=smi.reason, names=list(view.names))
                return DeviceReport(accelerator=self.name, present=True, count=view.count, model=view.names[0],
                                    memory_mb=view.memory_mb, runtime_version=view.cuda_version,
                                    healthy=(True,) * view.count)
            if any(looks_nvidia):
                return self._absent(f"torch.cuda devices are NVIDIA GPUs, not PPUs ({seen}); {smi.reason}")
            return self._absent(f"{smi.reason}, and torch.cuda's devices ({seen}) do not match the PPU name "
                                f"pattern {self.name_pattern!r} ({NAME_PATTERN_ENV})")
        return self._absent(f"{smi.reason}{_smi_hint(smi.reason)}")

    def _present_from_smi(self, devices: list[SmiDevice], view: _TorchView) -> DeviceReport:
        """A report for ``view.count`` visible PPUs, with model, memory and health from ppu-smi."""
        env = self.visible_devices_env
        visible = select_visible(devices, os.environ.get(env) if env else None)
        if visible is not None and len(visible) == view.count:
            rows = visible
            healthy = tuple(d.healthy for d in rows)
        else:
            # ppu-smi lists every PPU of the host; when the visible set cannot be matched to
            # its rows, the visible devices share the verdict on all of them (conservative).
            rows = devices
            healthy = (all(d.healthy for d in rows),) * view.count
            log.info("ppu_visible_devices_unmatched", variable=env, value=os.environ.get(env or ""),
                     ppu_smi_devices=len(devices), torch_devices=view.count)
        for device in rows:
            if not device.healthy:
                log.warning("ppu_device_unhealthy", index=device.index, uuid=device.uuid,
                            problems=list(device.problems))
        first = rows[0]
        return DeviceReport(
            accelerator=self.name,
            present=True,
            count=view.count,
            model=first.name,
            memory_mb=first.memory_mb if first.memory_mb is not None else view.memory_mb,
            driver_version=first.driver_version,
            runtime_version=view.cuda_version,
            healthy=healthy,
        )

    def _visible_setting(self) -> str:
        env = self.visible_devices_env
        if not env:
            return "no visible-devices variable configured"
        return f"{env}={os.environ[env]!r}" if env in os.environ else f"{env} unset"

    def _ask_smi(self) -> _SmiAnswer:
        """List PPUs with ``ppu-smi --query-ppu``, then add remapped-row health with
        ``--query-remapped-rows`` if the time budget allows (its failure is not fatal)."""
        timeout_s = float(self.smi_timeout_s)
        deadline = time.monotonic() + timeout_s
        tool = str(self.smi)
        out = run_tool([tool, f"--query-ppu={','.join(DEVICE_PROPERTIES)}", f"--format={CSV_FORMAT}"],
                       timeout_s=timeout_s)
        if not out.ok:
            reason = out.reason or "ppu-smi failed"
            if os.sep in tool and reason.endswith("not on PATH"):
                reason = f"ppu-smi not found at {tool} ({SMI_ENV})"
            elif "no device" in reason.lower():
                reason = f"0 devices visible: {reason}"
            return _SmiAnswer(None, reason)
        try:
            devices = parse_devices(out.stdout)
        except SmiOutputError as exc:
            return _SmiAnswer(None, f"ppu-smi output not understood: {exc}")
        remaining_s = deadline - time.monotonic()
        if devices and remaining_s > 0.05:
            health = run_tool([tool, f"--query-remapped-rows={','.join(REMAP_PROPERTIES)}", f"--format={CSV_FORMAT}"],
                              timeout_s=remaining_s)
            if health.ok:
                try:
                    devices = parse_remapped_rows(health.stdout, devices)
                except SmiOutputError as exc:
                    log.warning("ppu_smi_remapped_rows_not_understood", error=str(exc))
            else:
                log.info("ppu_smi_remapped_rows_unavailable", reason=health.reason)
        return _SmiAnswer(devices)

    @staticmethod
    def _ask_torch() -> _TorchView:
        """What torch.cuda shows this process: availability, count, names, memory of device 0
        (a CPU build of torch shows none, known without importing it)."""
        cpu_build = cpu_only_torch()
        if cpu_build is not None:
            return _TorchView(reason=f"torch.cuda is not available (torch {cpu_build})")
        torch, reason = try_import("torch")
        if torch is None:
            return _TorchView(reason=reason)
        version = getattr(torch, "__version__", "?")
        try:
            available = bool(torch.cuda.is_available())
        except Exception as exc:
            return _TorchView(reason=f"torch.cuda.is_available() raised {type(exc).__name__}: {exc}")
        if not available:
            return _TorchView(reason=f"torch.cuda is not available (torch {version})")
        count = int(torch.cuda.device_count())
        names = []
        for i in range(count):
            try:
                names.append(str(torch.cuda.get_device_name(i)))
            except Exception as exc:  # one unreadable device must not hide the others
                log.info("ppu_torch_device_name_failed", device=i, error=str(exc))
                names.append("")
        memory_mb = None
        if count:
            try:
                memory_mb = int(torch.cuda.get_device_properties(0).total_memory // 2**20)
            except Exception:
                memory_mb = None
        return _TorchView(available=True, count=count, names=tuple(names), memory_mb=memory_mb,
                          cuda_version=getattr(torch.version, "cuda", None))

    # ----- workers -------------------------------------------------------------------------

    def worker_env(self, local_rank: int, local_world_size: int) -> dict[str, str]:
        """Nothing to add: every worker inherits the node's visible PPUs (``CUDA_VISIBLE_DEVICES``
        or the configured variable) and picks its own with ``device_for(local_rank)``, as
        torchrun's workers do on CUDA. Narrowing visibility per worker would renumber the
        devices and break ``cuda:<local_rank>``."""
        return {}

    def device_for(self, local_rank: int) -> Any:
        """``torch.device("cuda", local_rank)``: PPUs are CUDA devices to PyTorch."""
        import torch  # torch: heavy, workers only

        return torch.device("cuda", local_rank)

    # ----- node check ----------------------------------------------------------------------

    def node_check(self, *, group: Any = None) -> NodeCheckResult:
        """Time an ``MATMUL_N``² matmul on the current PPU and, with ``group``, an all-reduce.

        Raises:
            DeviceError: torch.cuda is not available here, or a result is wrong (a matmul
                with non-finite values, an all-reduce with the wrong sum).
        """
        import torch  # torch: heavy, workers only

        start = time.perf_counter()
        if not torch.cuda.is_available():
            raise DeviceError("ppu node check: torch.cuda is not available in this process; "
                              "is this the PPU build of PyTorch, and are PPUs visible?")
        device = torch.device("cuda", torch.cuda.current_device())
        dtype = torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        tflops = time_matmul(device, n=self.MATMUL_N, reps=self.MATMUL_REPS, dtype=dtype)
        gbps = None
        if group is not None:
            gbps = time_allreduce(group, device, numel=self.ALLREDUCE_NUMEL, reps=self.ALLREDUCE_REPS)
        return NodeCheckResult(matmul_tflops=tflops, allreduce_gbps=gbps, elapsed_s=time.perf_counter() - start)


def _synchronizer(device: Any) -> Callable[[], None]:
    """Wait for queued device work (a no-op on cpu, where work is synchronous)."""
    import torch  # torch: heavy, workers only

    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def time_matmul(device: Any, *, n: int, reps: int, dtype: Any) -> float:
    """Matmul throughput in TFLOP/s: ``reps`` products of two n×n matrices (2·n³ FLOP each)
    after one warm-up.

    Raises:
        DeviceError: the product has non-finite values (a broken device computes garbage).
    """
    import torch  # torch: heavy, workers only

    sync = _synchronizer(device)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    c = torch.matmul(a, b)
    sync()
    if not bool(torch.isfinite(c).all()):
        raise DeviceError(f"matmul on {device} produced non-finite values")
    t0 = time.perf_counter()
    for _ in range(reps):
        torch.matmul(a, b)
    sync()
    elapsed_s = time.perf_counter() - t0
    return 2 * n**3 * reps / elapsed_s / 1e12


def time_allreduce(group: Any, device: Any, *, numel: int, reps: int) -> float:
    """All-reduce bus bandwidth in GB/s of a float32 tensor of ``numel`` elements, averaged
    over ``reps`` runs after one warm-up, by nccl-tests' convention: 2(n-1)/n · bytes / time
    (https://github.com/NVIDIA/nccl-tests/blob/master/doc/PERFORMANCE.md).

    Raises:
        DeviceError: the warm-up's sum of ones is not the group size.
    """
    import torch  # torch: heavy, workers only
    import torch.distributed as dist  # torch: heavy, workers only

    sync = _synchronizer(device)
    world = dist.get_world_size(group)
    x = torch.ones(numel, device=device, dtype=torch.float32)
    dist.all_reduce(x, group=group)
    sync()
    got = float(x[0].item())
    if got != float(world):
        raise DeviceError(f"all-reduce on {device} summed ones to {got}, expected {world}")
    t0 = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(x, group=group)
    sync()
    per_run_s = (time.perf_counter() - t0) / reps
    return (2 * (world - 1) / world) * numel * 4 / per_run_s / 1e9


def _describe(names: tuple[str, ...]) -> str:
    """``"8 × NVIDIA H100 80GB HBM3"`` — the distinct device names torch.cuda reports."""
    parts = []
    for name in dict.fromkeys(names):
        count = names.count(name)
        label = repr(name) if name else "unnamed device"
        parts.append(f"{count} × {label}" if count > 1 else label)
    return ", ".join(parts) or "none"


def _smi_hint(reason: str | None) -> str:
    """A pointer for "ppu-smi not on PATH" on a machine whose PPU driver is loaded."""
    if reason and reason.startswith("ppu-smi not") and glob.glob(_DEVICE_NODES):
        return (f"; PPU device nodes ({_DEVICE_NODES}) exist here: put the PPU SDK's ppu-smi on PATH "
                f"or name it in {SMI_ENV}")
    return ""
