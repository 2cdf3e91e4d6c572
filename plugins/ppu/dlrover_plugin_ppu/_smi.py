"""Reading ``ppu-smi``, T-Head's management tool for Zhenwu PPUs.

Only ppu-smi's documented "selective query" interface is used: ``--query-ppu=<props>`` and
``--query-remapped-rows=<props>`` with ``--format=csv,noheader,nounits`` print one CSV line
per PPU, the properties in the order asked for (PPU-SMI manual, section "选择性查询" /
"selective query"; Alibaba Cloud, "PPU-SMI (v1.7)",
https://help.aliyun.com/en/document_detail/2996754.html). The property names asked for here
all appear in that manual's examples or in its ``--help-query-ppu`` listing; the line format
(comma separated, ``N/A`` where a value is not supported, memory in MiB) matches the manual's
examples and the test data of the ``ppusmi`` Telegraf input
(https://github.com/yunionio/telegraf/tree/master/plugins/inputs/ppusmi).

Everything here is pure parsing; running the tool is :func:`dlrover_core.accelerators.tools.run_tool`.
"""

from __future__ import annotations

import csv
import re

import attrs

__all__ = [
    "CSV_FORMAT",
    "DEVICE_PROPERTIES",
    "REMAP_PROPERTIES",
    "SmiDevice",
    "SmiOutputError",
    "parse_devices",
    "parse_remapped_rows",
    "select_visible",
]

#: ``--format`` value: CSV (mandatory for selective queries), no header line, no units.
CSV_FORMAT = "csv,noheader,nounits"

#: ``--query-ppu`` properties, in the order the parser expects them.
DEVICE_PROPERTIES: tuple[str, ...] = ("index", "uuid", "name", "memory.total", "compute_mode", "driver_version")

#: ``--query-remapped-rows`` properties: a pending row remap needs a reset before the memory
#: is trusted again; a failed remap means the device needs service (manual, "Remapped Rows").
REMAP_PROPERTIES: tuple[str, ...] = ("uuid", "remapped_rows.pending", "remapped_rows.failure")

_NA = {"", "n/a", "[n/a]", "[not supported]", "not supported", "[unknown error]"}
_MIB = re.compile(r"^(\d+)(?:\s*MiB)?$", re.IGNORECASE)
_YES = {"yes", "true", "1", "enabled"}
_NO = {"no", "false", "0", "disabled"}


class SmiOutputError(ValueError):
    """ppu-smi printed something this parser does not understand (``str()`` says what)."""


@attrs.frozen(kw_only=True)
class SmiDevice:
    """One PPU as ``ppu-smi --query-ppu`` lists it.

    Attributes:
        index: ppu-smi's enumeration index (the ``N`` of ``/dev/alixpu_ppuN``).
        uuid: the device UUID (``GPU-019e...`` on current SDKs, ``PPU-...`` on older ones).
        name: product name, e.g. ``"PPU-ZW810E"``.
        memory_mb: device memory in MiB; ``None`` when ppu-smi says ``N/A``.
        compute_mode: ``Default``, ``Exclusive_Process`` or ``Prohibited`` (no context can be
            created); ``None`` when unknown.
        driver_version: kernel driver version; ``None`` when unknown.
        remap_pending: a row remap waits for a device reset; ``None`` when unknown.
        remap_failed: a row remap has failed in the past; ``None`` when unknown.
    """

    index: int
    uuid: str
    name: str
    memory_mb: int | None = None
    compute_mode: str | None = None
    driver_version: str | None = None
    remap_pending: bool | None = None
    remap_failed: bool | None = None

    @property
    def problems(self) -> tuple[str, ...]:
        """Why this device should not be trusted with a job (empty when healthy)."""
        found = []
        if self.compute_mode is not None and self.compute_mode.lower() == "prohibited":
            found.append("compute mode is Prohibited (no context can be created)")
        if self.remap_failed:
            found.append("a memory row remap has failed")
        if self.remap_pending:
            found.append("a memory row remap is pending a device reset")
        return tuple(found)

    @property
    def healthy(self) -> bool:
        return not self.problems


def _value(raw: str) -> str | None:
    raw = raw.strip()
    return None if raw.lower() in _NA else raw


def _flag(raw: str) -> bool | None:
    value = (_value(raw) or "").lower()
    if value in _YES:
        return True
    if value in _NO:
        return False
    return None  # N/A, or a spelling we do not know: unknown, not unhealthy


def _rows(stdout: str, width: int, what: str) -> list[list[str]]:
    rows = []
    for number, fields in enumerate(csv.reader(stdout.splitlines(), skipinitialspace=True), start=1):
        if not fields or all(not f.strip() for f in fields):
            continue
        if len(fields) != width:
            line = ", ".join(fields)[:120]
            raise SmiOutputError(f"{what} line {number} has {len(fields)} fields, expected {width}: {line!r}")
        rows.append(fields)
    return rows


def parse_devices(stdout: str) -> list[SmiDevice]:
    """Parse ``ppu-smi --query-ppu=<DEVICE_PROPERTIES> --format=csv,noheader,nounits``.

    Raises:
        SmiOutputError: a line with the wrong number of fields, a non-numeric index or
            memory size, or a missing UUID or name.
    """
    devices = []
    for fields in _rows(stdout, len(DEVICE_PROPERTIES), "--query-ppu"):
        index, uuid, name, memory, mode, driver = (f.strip() for f in fields)
        if not index.isdigit():
            raise SmiOutputError(f"--query-ppu: index {index!r} is not a number")
        if _value(uuid) is None or _value(name) is None:
            raise SmiOutputError(f"--query-ppu: device {index} has no uuid or name")
        memory_mb = None
        if _value(memory) is not None:
            match = _MIB.match(memory)
            if match is None:
                raise SmiOutputError(f"--query-ppu: memory.total {memory!r} of device {index} is not MiB")
            memory_mb = int(match.group(1))
        devices.append(SmiDevice(index=int(index), uuid=uuid, name=name, memory_mb=memory_mb,
                                 compute_mode=_value(mode), driver_version=_value(driver)))
    return devices


def parse_remapped_rows(stdout: str, devices: list[SmiDevice]) -> list[SmiDevice]:
    """Add the remapped-row flags of ``ppu-smi --query-remapped-rows=<REMAP_PROPERTIES>
    --format=csv,noheader,nounits`` to ``devices`` (matched by UUID).

    Flags spelled ``Yes``/``No`` (as ``ppu-smi -q -d ROW_REMAPPER`` prints them),
    ``true``/``false`` or ``1``/``0`` are understood; anything else leaves the flag unknown.
    Devices the output does not mention are returned unchanged.

    Raises:
        SmiOutputError: a line with the wrong number of fields.
    """
    flags = {}
    for fields in _rows(stdout, len(REMAP_PROPERTIES), "--query-remapped-rows"):
        uuid, pending, failure = (f.strip() for f in fields)
        flags[uuid] = (_flag(pending), _flag(failure))
    out = []
    for device in devices:
        if device.uuid in flags:
            pending, failed = flags[device.uuid]
            device = attrs.evolve(device, remap_pending=pending, remap_failed=failed)
        out.append(device)
    return out


def select_visible(devices: list[SmiDevice], visible: str | None) -> list[SmiDevice] | None:
    """The devices a visible-devices value (``"0,3"``, ``"GPU-019e..."``) leaves visible, in
    its order, following ``CUDA_VISIBLE_DEVICES`` semantics (index or UUID prefix; the list
    ends at the first entry that names no device).

    Returns:
        all of ``devices`` when ``visible`` is ``None`` (unset); ``None`` when a non-numeric
        entry matches no single device (a MIG UUID, say), so the caller cannot tell which
        devices are visible.
    """
    if visible is None:
        return list(devices)
    chosen: list[SmiDevice] = []
    for item in (v.strip() for v in visible.split(",")):
        if item.isdigit():
            match = [d for d in devices if d.index == int(item)]
        elif item:
            match = [d for d in devices if d.uuid.startswith(item)]
            if len(match) != 1:
                return None
        else:
            match = []
        if len(match) != 1:
            break  # an invalid entry ends the list, as it does for CUDA_VISIBLE_DEVICES
        chosen.append(match[0])
    return chosen
