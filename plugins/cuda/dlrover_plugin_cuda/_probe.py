"""Reading NVIDIA GPUs: NVML (``pynvml``, optional) or ``nvidia-smi``; ``CUDA_VISIBLE_DEVICES``;
what torch says about CUDA.

Nothing here raises on a machine without the NVIDIA stack: each reader returns either what it
found or a reason string, like :func:`dlrover_core.accelerators.tools.run_tool`.

Sources (read, not copied):

* nvidia-smi(1), "NVIDIA System Management Interface program",
  https://docs.nvidia.com/deploy/nvidia-smi/ — SELECTIVE QUERY OPTIONS: ``--query-gpu=<fields>``
  with ``--format=csv,noheader,nounits`` prints one line per GPU, the values in the order asked,
  separated by commas, numbers without their units (``memory.total`` in MiB); field names and
  meanings are listed by ``nvidia-smi --help-query-gpu``. Unsupported data reads ``[N/A]``
  (or ``[Not Supported]``); a value the driver could not read is another bracketed word
  (``[Unknown Error]``, ``[GPU requires reset]``). RETURN VALUE: 2 "A supplied argument or flag
  is invalid" (a field this driver does not know), 6 "A query to find an object was
  unsuccessful" (printed with "No devices were found"), 9 "NVIDIA driver is not loaded".
* NVML API Reference Guide, https://docs.nvidia.com/deploy/nvml-api/ (the same data through
  ``nvidia-ml-py``, imported as ``pynvml``): nvmlDeviceGetTotalEccErrors,
  nvmlDeviceGetRetiredPagesPendingStatus, nvmlDeviceGetRemappedRows.
* Health signals: "Dynamic Page Retirement", https://docs.nvidia.com/deploy/dpr-whitepaper/
  (a page pending retirement keeps being used until the driver is reloaded; XID 48 is an
  uncorrectable ECC error), and "NVIDIA A100 GPU Memory Error Management",
  https://docs.nvidia.com/deploy/a100-gpu-mem-error-mgmt/ (a row-remapping failure is an RMA
  condition; a *pending* remapping does not stop new work, so it is not counted here).
* ``CUDA_VISIBLE_DEVICES``: CUDA C++ Programming Guide, "CUDA Environment Variables" — a
  comma-separated list of indices or GPU UUIDs (``GPU-...``, a unique prefix is enough) or MIG
  identifiers (``MIG-...``); devices are enumerated in the order of the list, and an invalid
  entry hides itself and every entry after it.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Sequence
from typing import Any

import attrs

from dlrover_core.backend import cpu_only_torch, run_tool, try_import

__all__ = [
    "BASE_FIELDS",
    "HEALTH_FIELDS",
    "Gpu",
    "Inventory",
    "TorchCuda",
    "is_nvidia_name",
    "parse_smi_csv",
    "query_nvidia_smi",
    "read_nvml",
    "select_visible",
    "torch_cuda",
]

#: ``--query-gpu`` fields every driver answers, in the order asked.
BASE_FIELDS: tuple[str, ...] = ("index", "uuid", "name", "memory.total", "driver_version", "pci.bus_id")
#: Health fields (``nvidia-smi --help-query-gpu``): uncorrectable ECC errors since the driver
#: loaded, pages waiting for retirement (pre-Ampere), a failed row remapping (Ampere and later).
HEALTH_FIELDS: tuple[str, ...] = (
    "ecc.errors.uncorrected.volatile.total",
    "retired_pages.pending",
    "remapped_rows.failure",
)
#: What nvidia-smi prints for data a device does not support.
_UNSUPPORTED = {"[n/a]", "n/a", "[not supported]", "not supported"}
#: Words that mark an NVIDIA product in a device name (CUDA's ``get_device_name``).
_NVIDIA_MARKERS = ("nvidia", "tesla", "geforce", "quadro", "rtx", "titan")
_STATUS_RE = re.compile(r"exited with status (\d+)")


@attrs.frozen(kw_only=True)
class Gpu:
    """One GPU as the management tool sees it.

    Attributes:
        index: the tool's index (PCI bus order), ``-1`` for a MIG device not matched to a GPU.
        uuid: ``GPU-...`` (or the ``MIG-...`` identifier it was selected by); ``None`` if unreadable.
        name: product name, e.g. ``"NVIDIA H100 80GB HBM3"``; ``None`` if unreadable.
        memory_mb: total memory in MiB; ``None`` if unknown.
        pci_bus_id: ``"00000000:18:00.0"``; ``None`` if unreadable.
        problems: why the device is unhealthy, in words; empty when healthy.
    """

    index: int
    uuid: str | None = None
    name: str | None = None
    memory_mb: int | None = None
    pci_bus_id: str | None = None
    problems: tuple[str, ...] = ()

    @property
    def healthy(self) -> bool:
        return not self.problems


@attrs.frozen(kw_only=True)
class Inventory:
    """Every GPU of the machine, from one source.

    Attributes:
        source: ``"NVML"`` or ``"nvidia-smi"``.
        gpus: all GPUs, before ``CUDA_VISIBLE_DEVICES`` is applied.
        driver_version: e.g. ``"535.129.03"``; ``None`` if unknown.
        health_checked: whether the health fields could be read (an old driver may not know them).
    """

    source: str
    gpus: tuple[Gpu, ...]
    driver_version: str | None = None
    health_checked: bool = True


class _NotUnderstood(ValueError):
    """nvidia-smi printed something that is not the documented CSV."""


# ----- nvidia-smi ---------------------------------------------------------------------------


def _is_marker(value: str) -> bool:
    """A value that is not a reading: ``[N/A]``, ``[Unknown Error]``, ``ERR!``..."""
    return (value.startswith("[") and value.endswith("]")) or value.upper() in ("N/A", "ERR!")


def _bool_reading(value: str) -> bool | None:
    v = value.strip().lower()
    if v in ("yes", "true", "1", "enabled"):
        return True
    if v in ("no", "false", "0", "disabled"):
        return False
    return None


def _health_problems(values: dict[str, str]) -> list[str]:
    """Problems shown by the health fields of one row; unsupported fields say nothing."""
    problems = []
    for field in HEALTH_FIELDS:
        value = values.get(field)
        if value is None or value.lower() in _UNSUPPORTED:
            continue
        if _is_marker(value):
            problems.append(f"{field} reads {value}")
            continue
        if field == "ecc.errors.uncorrected.volatile.total":
            if value.isdigit() and int(value) > 0:
                problems.append(f"{value} uncorrectable ECC error(s) since the driver loaded ({field})")
        elif field == "retired_pages.pending" and _bool_reading(value):
            problems.append(f"memory pages wait for retirement: reset the GPU or reload the driver ({field})")
        elif field == "remapped_rows.failure" and _bool_reading(value):
            problems.append(f"a memory row remapping failed, an RMA condition ({field})")
    return problems


def parse_smi_csv(text: str, fields: Sequence[str]) -> tuple[list[Gpu], str | None]:
    """GPUs and the driver version from ``nvidia-smi --query-gpu=<fields>
    --format=csv,noheader,nounits`` output (``fields`` must start with :data:`BASE_FIELDS`).

    A device whose identity or memory reads as a marker (``[N/A]``, ``[GPU requires reset]``,
    ``ERR!``) is kept but unhealthy, as is one whose health fields show errors.

    Raises:
        _NotUnderstood: a line with the wrong number of values, or an index or memory size
            that is neither a number nor a marker.
    """
    gpus: list[Gpu] = []
    driver: str | None = None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        parts = [p.strip() for p in line.split(",")]
        if len(parts) != len(fields):
            raise _NotUnderstood(f"line {number} has {len(parts)} values, expected {len(fields)} "
                                 f"({','.join(fields)}): {line.strip()[:120]!r}")
        values = dict(zip(fields, parts, strict=True))
        index = values["index"]
        if not index.isdigit():
            raise _NotUnderstood(f"line {number}: index {index!r} is not a number: {line.strip()[:120]!r}")
        problems: list[str] = []
        ident: dict[str, str | None] = {}
        for field in ("uuid", "name", "pci.bus_id"):
            if _is_marker(values[field]):
                problems.append(f"{field} reads {values[field]}")
                ident[field] = None
            else:
                ident[field] = values[field]
        memory = values["memory.total"]
        memory_mb = None
        if memory.isdigit():
            memory_mb = int(memory)
        elif _is_marker(memory):
            problems.append(f"memory.total reads {memory}")
        else:
            raise _NotUnderstood(f"line {number}: memory.total {memory!r} is not a number of MiB: "
                                 f"{line.strip()[:120]!r}")
        if not _is_marker(values["driver_version"]):
            driver = driver or values["driver_version"]
        problems += _health_problems(values)
        gpus.append(Gpu(index=int(index), uuid=ident["uuid"], name=ident["name"], memory_mb=memory_mb,
                        pci_bus_id=ident["pci.bus_id"], problems=tuple(problems)))
    return gpus, driver


def _exit_status(reason: str | None) -> int | None:
    match = _STATUS_RE.search(reason or "")
    return int(match.group(1)) if match else None


def query_nvidia_smi(*, timeout_s: float) -> tuple[Inventory | None, str | None]:
    """Ask ``nvidia-smi`` for every GPU; ``(inventory, None)`` or ``(None, reason)``.

    The health fields are asked for together with the base ones; a driver that does not know
    one of them answers with status 2 (invalid argument), and the base fields are asked for
    alone. Zero GPUs (status 6, "No devices were found") is an empty inventory, not a failure.
    """
    inventory, reason, status = _query(BASE_FIELDS + HEALTH_FIELDS, timeout_s)
    if status == 2:
        inventory, reason, status = _query(BASE_FIELDS, timeout_s)
        if inventory is not None:
            inventory = attrs.evolve(inventory, health_checked=False)
    return inventory, reason


def _query(fields: tuple[str, ...], timeout_s: float) -> tuple[Inventory | None, str | None, int | None]:
    out = run_tool(["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader,nounits"],
                   timeout_s=timeout_s)
    if not out.ok:
        status = _exit_status(out.reason)
        if status == 6 or "no devices were found" in (out.reason or "").lower():
            return Inventory(source="nvidia-smi", gpus=()), None, status
        return None, out.reason, status
    if "no devices were found" in out.stdout.lower():
        return Inventory(source="nvidia-smi", gpus=()), None, 0
    try:
        gpus, driver = parse_smi_csv(out.stdout, fields)
    except _NotUnderstood as exc:
        return None, f"nvidia-smi output not understood: {exc}", 0
    return Inventory(source="nvidia-smi", gpus=tuple(gpus), driver_version=driver), None, 0


# ----- NVML ---------------------------------------------------------------------------------


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _unsupported(nvml: Any, exc: BaseException) -> bool:
    """NVML_ERROR_NOT_SUPPORTED (3) or NVML_ERROR_FUNCTION_NOT_FOUND (13): nothing to read."""
    codes = {getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", 3), getattr(nvml, "NVML_ERROR_FUNCTION_NOT_FOUND", 13)}
    return getattr(exc, "value", None) in codes


def _nvml_gpu(nvml: Any, index: int) -> Gpu:
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
    except Exception as exc:
        return Gpu(index=index, problems=(f"NVML cannot open it: {exc}",))
    problems: list[str] = []

    def read(what: str, fn: Any) -> Any:
        try:
            return fn()
        except Exception as exc:
            problems.append(f"{what}: {exc}")
            return None

    name = read("name", lambda: _text(nvml.nvmlDeviceGetName(handle)))
    uuid = read("uuid", lambda: _text(nvml.nvmlDeviceGetUUID(handle)))
    memory = read("memory", lambda: int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // 2**20)
    bus = read("pci bus id", lambda: _text(nvml.nvmlDeviceGetPciInfo(handle).busId))

    def health(what: str, fn: Any) -> Any:
        try:
            return fn()
        except Exception as exc:
            if not _unsupported(nvml, exc):
                problems.append(f"{what}: {exc}")
            return None

    uncorrected = health("uncorrectable ECC errors", lambda: nvml.nvmlDeviceGetTotalEccErrors(
        handle, getattr(nvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1), getattr(nvml, "NVML_VOLATILE_ECC", 0)))
    if uncorrected:
        problems.append(f"{uncorrected} uncorrectable ECC error(s) since the driver loaded")
    pending = health("retired pages", lambda: nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle))
    if pending is not None and pending == getattr(nvml, "NVML_FEATURE_ENABLED", 1):
        problems.append("memory pages wait for retirement: reset the GPU or reload the driver")
    rows = health("remapped rows", lambda: nvml.nvmlDeviceGetRemappedRows(handle))
    if rows is not None and len(rows) >= 4 and rows[3]:
        problems.append("a memory row remapping failed, an RMA condition")
    return Gpu(index=index, uuid=uuid, name=name, memory_mb=memory, pci_bus_id=bus, problems=tuple(problems))


def _read_nvml(nvml: Any) -> Inventory:
    nvml.nvmlInit()
    try:
        driver = _text(nvml.nvmlSystemGetDriverVersion())
        gpus = tuple(_nvml_gpu(nvml, i) for i in range(int(nvml.nvmlDeviceGetCount())))
    finally:
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()
    return Inventory(source="NVML", gpus=gpus, driver_version=driver)


def read_nvml(nvml: Any, *, timeout_s: float) -> tuple[Inventory | None, str | None]:
    """Read every GPU through the ``pynvml`` module ``nvml``; ``(inventory, None)`` or
    ``(None, reason)``. Runs in a daemon thread so a hung driver cannot hold the probe past
    ``timeout_s`` seconds (the thread is abandoned)."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["inventory"] = _read_nvml(nvml)
        except BaseException as exc:  # noqa: BLE001 - reported as the reason
            box["error"] = exc

    thread = threading.Thread(target=work, name="dlrover-cuda-nvml", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return None, f"NVML did not answer within {timeout_s:g} s"
    if "error" in box:
        exc = box["error"]
        return None, f"NVML failed: {type(exc).__name__}: {exc}"
    return box["inventory"], None


# ----- CUDA_VISIBLE_DEVICES -----------------------------------------------------------------


def select_visible(gpus: Sequence[Gpu], value: str | None) -> tuple[list[Gpu], str | None]:
    """The GPUs a CUDA program sees under ``CUDA_VISIBLE_DEVICES=value`` (``None``: unset),
    in its order, and a note when an entry matched nothing (it and the rest are ignored, as
    CUDA does). A repeated entry counts as invalid (each device is enumerated once).

    Indices are the tool's (PCI bus order), which is CUDA's when ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
    or when all GPUs are the same model (CUDA's default FASTEST_FIRST then keeps bus order).
    A ``MIG-GPU-<uuid>/...`` entry takes its parent GPU's name and health; any other ``MIG-``
    entry counts as a device whose properties are unknown.
    """
    if value is None:
        return list(gpus), None
    if not value.strip():
        return [], "CUDA_VISIBLE_DEVICES is empty"
    chosen: list[Gpu] = []
    seen: set[int] = set()
    for raw in value.split(","):
        token = raw.strip()
        match: Gpu | None = None
        if token.isdigit():
            match = next((g for g in gpus if g.index == int(token)), None)
        elif token.upper().startswith("MIG-"):
            parent_uuid = token[4:].split("/")[0]
            parent = _by_uuid_prefix(gpus, parent_uuid) if parent_uuid.upper().startswith("GPU-") else None
            placeholder = Gpu(index=-1, uuid=token)
            chosen.append(attrs.evolve(parent, uuid=token, memory_mb=None) if parent else placeholder)
            continue
        elif token.upper().startswith("GPU-"):
            match = _by_uuid_prefix(gpus, token)
        if match is None or match.index in seen:
            why = "repeats a device" if match is not None else "matches no GPU"
            return chosen, f"CUDA_VISIBLE_DEVICES entry {token!r} {why}; it and the entries after it are ignored"
        seen.add(match.index)
        chosen.append(match)
    return chosen, None


def _by_uuid_prefix(gpus: Sequence[Gpu], prefix: str) -> Gpu | None:
    hits = [g for g in gpus if g.uuid and g.uuid.lower().startswith(prefix.lower())]
    return hits[0] if len(hits) == 1 else None


# ----- torch --------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class TorchCuda:
    """What the installed torch says about CUDA.

    Attributes:
        version: ``torch.__version__`` (``"2.13.0+cpu"``); ``None`` if torch does not import.
        cuda: ``torch.version.cuda``, the CUDA runtime torch was built with; ``None`` for a
            build without CUDA (CPU, ROCm).
        available: ``torch.cuda.is_available()``; ``None`` when not asked (no CUDA build).
        count: ``torch.cuda.device_count()``; ``None`` when not asked.
        error: why torch could not be asked, if it could not.
    """

    version: str | None
    cuda: str | None = None
    available: bool | None = None
    count: int | None = None
    error: str | None = None

    def describe(self) -> str:
        """``"torch 2.13.0+cpu"``, ``"torch 2.5.1+cu124, CUDA 12.4"``."""
        if self.version is None:
            return f"torch not importable ({self.error})"
        return f"torch {self.version}" + (f", CUDA {self.cuda}" if self.cuda else "")


def torch_cuda() -> TorchCuda:
    """Ask torch about CUDA without creating a CUDA context (``is_available`` and
    ``device_count`` only). Never raises. A CPU build of torch (``+cpu``) has no CUDA: known
    without importing it (:func:`~dlrover_core.backend.cpu_only_torch`).
    """
    cpu_build = cpu_only_torch()
    if cpu_build is not None:
        return TorchCuda(version=cpu_build)
    torch, reason = try_import("torch")
    if torch is None:
        return TorchCuda(version=None, error=reason)
    version = str(torch.__version__)
    cuda = getattr(torch.version, "cuda", None)
    if cuda is None:
        return TorchCuda(version=version)
    try:
        available = bool(torch.cuda.is_available())
        count = int(torch.cuda.device_count()) if available else 0
    except Exception as exc:
        return TorchCuda(version=version, cuda=cuda, available=False, count=0,
                         error=f"{type(exc).__name__}: {exc}")
    return TorchCuda(version=version, cuda=cuda, available=available, count=count)


def is_nvidia_name(name: str) -> bool:
    """Whether a CUDA device name is an NVIDIA product's (``"NVIDIA A100-SXM4-80GB"``,
    ``"Tesla V100-SXM2-16GB"``, ``"Quadro RTX 8000"``); other devices that answer through the
    CUDA API (Alibaba T-Head PPU) have other names."""
    lowered = name.lower()
    return any(marker in lowered for marker in _NVIDIA_MARKERS)
