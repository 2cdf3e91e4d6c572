"""Reading what Huawei's tools say about Ascend devices: the ``npu-smi info`` table and the
``ASCEND_RT_VISIBLE_DEVICES`` variable.

``npu-smi info`` prints one table (Huawei, npu-smi reference, "查询基本信息 / npu-smi info",
https://www.hiascend.com/document/detail/zh/Atlas%20200I%20A2/2520/re/npu/npusmi_007.html; the
fields and Health values are also described in the Atlas 300I Pro manual,
https://hiascend.com/document/detail/zh/Atlas%20300I%20Pro%20Inference%20Card/Atlas%20300I%20Pro%20Inference%20Card/300Ipro_015.html).
Its layout, with values of our own::

    +---------------------------------------------------------------------------------------+
    | npu-smi 24.1.rc2                 Version: 24.1.rc2                                    |
    +---------------------------+---------------+-------------------------------------------+
    | NPU   Name                | Health        | Power(W)    Temp(C)    Hugepages-Usage(page)|
    | Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB) |
    +===========================+===============+===========================================+
    | 0     910B3               | OK            | 96.4        41         0    / 0           |
    | 0                         | 0000:C1:00.0  | 0           0    / 0   3390 / 65536       |
    +===========================+===============+===========================================+
    | NPU     Chip              | Process id    | Process name       | Process memory(MB)   |
    ...

- the title row: the tool's version and ``Version:``, the driver version;
- two header rows, the second naming the columns of the chip rows (``HBM-Usage(MB)`` only on
  cards with HBM: the 910 families; inference cards such as the 310P show ``Memory-Usage(MB)``);
- then one block per NPU (card), separated by ``+===`` or ``+---`` lines: an NPU row (NPU id,
  chip name, Health, power, temperature, huge pages) followed by one row per chip (chip id,
  on some cards a device / physical id, Bus-Id, AI core use, memory ``used / total`` in MB).
  Cards with two chips (Atlas 300I Duo, Atlas A3) list two chip rows, or repeat the NPU row
  per chip; either way each chip is one device for the runtime;
- a process table, which we do not read.

Health is one of ``OK``, ``Warning`` (minor alarm), ``Alarm`` (major alarm), ``Critical``
(critical alarm) or ``UNKNOWN`` (device absent or not started), per the same reference and
``npu-smi info -t health``'s
(https://www.hiascend.com/document/detail/zh/Atlas%20200I%20A2/2520/re/npu/npusmi_027.html).
``npu-smi info -t board -i <id>`` gives more per card (firmware, serial number), but the main
table holds everything a probe needs, so one tool call is enough.
"""

from __future__ import annotations

import re

import attrs

__all__ = ["NpuChip", "NpuSmiInfo", "parse_npu_smi_info", "visible_device_ids"]

_USAGE = re.compile(r"(\d+)\s*/\s*(\d+)")
_LEADING_INT = re.compile(r"(\d+)(?:\s+(\S.*))?$")


@attrs.frozen(kw_only=True)
class NpuChip:
    """One chip (one runtime device) of ``npu-smi info``.

    Attributes:
        npu_id: the NPU (card) id npu-smi shows (``-i`` of ``npu-smi info -t ...``).
        chip_id: the chip id within the NPU (``-c``).
        name: the chip name, e.g. ``"910B3"`` or ``"Ascend910"``.
        health: npu-smi's Health word: ``OK``, ``Warning``, ``Alarm``, ``Critical`` or ``UNKNOWN``.
        bus_id: PCIe bus id, or ``None`` when npu-smi shows ``NA``.
        memory_mb: device memory in MiB (npu-smi's "MB"): the HBM total where the card has HBM,
            else the Memory-Usage total; ``None`` when neither is shown.
    """

    npu_id: int
    chip_id: int
    name: str
    health: str
    bus_id: str | None
    memory_mb: int | None

    @property
    def healthy(self) -> bool:
        """Only ``OK`` counts: every alarm level and ``UNKNOWN`` make a device unhealthy."""
        return self.health.upper() == "OK"


@attrs.frozen(kw_only=True)
class NpuSmiInfo:
    """What ``npu-smi info`` said.

    Attributes:
        tool_version: npu-smi's own version (title row), or ``None``.
        driver_version: the driver version (title row, ``Version:``), or ``None``.
        chips: every chip, in npu-smi's order, which is the order of the runtime's logical ids.
    """

    tool_version: str | None
    driver_version: str | None
    chips: tuple[NpuChip, ...]


def _cells(line: str) -> list[str] | None:
    line = line.strip()
    if not (line.startswith("|") and line.endswith("|")) or len(line) < 2:
        return None
    return [c.strip() for c in line[1:-1].split("|")]


def parse_npu_smi_info(text: str) -> NpuSmiInfo:
    """Parse the output of ``npu-smi info``.

    Args:
        text: the tool's standard output.

    Returns:
        An :class:`NpuSmiInfo`; ``chips`` is empty when the table lists no device.

    Raises:
        ValueError: the text is not an ``npu-smi info`` table (the message says what was
            missing or which row was not understood).
    """
    lines = text.splitlines()
    tool_version = driver_version = None
    header_at = None
    for i, line in enumerate(lines):
        cells = _cells(line)
        if cells and len(cells) == 3 and cells[0].split()[:1] == ["NPU"] and cells[1] == "Health":
            header_at = i
            break
        m = re.search(r"npu-smi\s+(\S+)", line)
        if m and tool_version is None:
            tool_version = m.group(1)
        m = re.search(r"Version:\s*(\S+)", line)
        if m and driver_version is None:
            driver_version = m.group(1)
    if header_at is None:
        first = next((ln.strip() for ln in lines if ln.strip()), "")
        raise ValueError(f"no 'NPU Name | Health | ...' header row (first line: {first[:80]!r})")
    columns = _cells(lines[header_at + 1]) if header_at + 1 < len(lines) else None
    if not columns or len(columns) != 3 or columns[1] != "Bus-Id":
        raise ValueError("the header row is not followed by the 'Chip | Bus-Id | ...' row")
    has_hbm = "HBM-Usage" in columns[2]

    chips: list[NpuChip] = []
    npu: tuple[int, str, str] | None = None  # (npu id, name, health) of the current block
    block_start = True  # the next table row opens a block: an NPU row
    chips_in_block = 0
    for line in lines[header_at + 2:]:
        stripped = line.strip()
        if not stripped:
            continue
        if stripped.startswith("+"):
            if not block_start and chips_in_block == 0 and npu is not None:
                raise ValueError(f"NPU {npu[0]} has no chip row")
            block_start, chips_in_block = True, 0
            continue
        cells = _cells(stripped)
        if cells is None:
            raise ValueError(f"not a table row: {stripped[:80]!r}")
        if any(c.startswith("Process id") for c in cells) or stripped.startswith("| No running processes"):
            break  # the process table: not ours to read
        if len(cells) != 3:
            raise ValueError(f"expected 3 columns, got {len(cells)}: {stripped[:80]!r}")
        m = _LEADING_INT.match(cells[0])
        if m is None:
            raise ValueError(f"row does not start with an id: {stripped[:80]!r}")
        if block_start:
            if not m.group(2):
                raise ValueError(f"NPU row without a chip name: {stripped[:80]!r}")
            health = cells[1].split()[0] if cells[1] else "UNKNOWN"
            npu = (int(m.group(1)), m.group(2).strip(), health)
            block_start = False
            continue
        assert npu is not None
        usage = _USAGE.findall(cells[2])
        memory = None
        if has_hbm and len(usage) >= 2 and int(usage[1][1]) > 0:
            memory = int(usage[1][1])
        elif usage and int(usage[0][1]) > 0:
            memory = int(usage[0][1])
        bus_id = cells[1] if cells[1] and cells[1] != "NA" else None
        chips.append(NpuChip(npu_id=npu[0], chip_id=int(m.group(1)), name=npu[1], health=npu[2],
                             bus_id=bus_id, memory_mb=memory))
        chips_in_block += 1
    if not block_start and chips_in_block == 0 and npu is not None:
        raise ValueError(f"NPU {npu[0]} has no chip row")
    return NpuSmiInfo(tool_version=tool_version, driver_version=driver_version, chips=tuple(chips))


def visible_device_ids(value: str | None, total: int) -> list[int]:
    """The logical device ids a process may use, read as CANN reads ``ASCEND_RT_VISIBLE_DEVICES``.

    CANN's reference for the variable: ids are logical ids ``0..total-1``, comma separated,
    in ascending order; reading stops at the first entry that is not a plain number or not a
    valid id (``"1, 2,3"`` selects only 1, ``"1,3,8"`` on 8 devices selects 1 and 3). Unset
    means every device. We also stop at an id that is not larger than the one before, since
    only ascending ids are supported.

    Args:
        value: the variable's value, or ``None`` when it is unset.
        total: how many devices the machine (or container) has.

    Returns:
        The selected logical ids; position ``i`` of the list is the process's device ``i``.
    """
    if value is None:
        return list(range(total))
    ids: list[int] = []
    for token in value.split(","):
        if not token.isdigit() or int(token) >= total or (ids and int(token) <= ids[-1]):
            break
        ids.append(int(token))
    return ids
