"""Fakes of the Ascend stack's observable interface, so these tests run without an NPU.

- :func:`fake_npu_smi`: an ``npu-smi`` script, first on ``PATH``, that answers ``npu-smi info``
  with a stored table in the layout Huawei documents (npu-smi reference, "查询基本信息 / npu-smi
  info": title row with the driver ``Version:``, two header rows, one block per NPU with an NPU
  row and one row per chip; Health one of OK / Warning / Alarm / Critical / UNKNOWN). Sources:
  https://www.hiascend.com/document/detail/zh/Atlas%20200I%20A2/2520/re/npu/npusmi_007.html
  and, for the fields and Health values,
  https://hiascend.com/document/detail/zh/Atlas%20300I%20Pro%20Inference%20Card/Atlas%20300I%20Pro%20Inference%20Card/300Ipro_015.html
  The values in the tables below are our own; the column layout of the training cards
  (``HBM-Usage(MB)`` after ``Memory-Usage(MB)``) is the one npu-smi prints on Atlas A2/A3.
- :func:`fake_torch_npu`: a ``torch_npu`` package on ``sys.path`` that, when imported (after
  ``torch``), registers ``torch.npu`` with ``is_available``, ``device_count`` (honouring
  ``ASCEND_RT_VISIBLE_DEVICES`` as CANN documents it), ``get_device_name``, ``set_device``,
  ``synchronize``, and offers ``torch_npu.utils.get_cann_version(module="CANN")``.
"""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

# Atlas 800T A2 style: eight 910B3 NPUs, one chip each, 64 GiB HBM.
SMI_910B3_X8 = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 24.1.rc2                 Version: 24.1.rc2                                             |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     910B3               | OK            | 96.4        41                0    / 0             |
| 0                         | 0000:C1:00.0  | 0           0    / 0          3390 / 65536         |
+===========================+===============+====================================================+
| 1     910B3               | OK            | 92.1        38                0    / 0             |
| 0                         | 0000:C2:00.0  | 0           0    / 0          3385 / 65536         |
+===========================+===============+====================================================+
| 2     910B3               | OK            | 97.8        40                0    / 0             |
| 0                         | 0000:81:00.0  | 0           0    / 0          3386 / 65536         |
+===========================+===============+====================================================+
| 3     910B3               | OK            | 94.0        39                0    / 0             |
| 0                         | 0000:82:00.0  | 0           0    / 0          3388 / 65536         |
+===========================+===============+====================================================+
| 4     910B3               | OK            | 90.3        37                0    / 0             |
| 0                         | 0000:01:00.0  | 0           0    / 0          3384 / 65536         |
+===========================+===============+====================================================+
| 5     910B3               | OK            | 95.5        42                0    / 0             |
| 0                         | 0000:02:00.0  | 0           0    / 0          3387 / 65536         |
+===========================+===============+====================================================+
| 6     910B3               | OK            | 93.7        40                0    / 0             |
| 0                         | 0000:41:00.0  | 0           0    / 0          3391 / 65536         |
+===========================+===============+====================================================+
| 7     910B3               | OK            | 91.9        38                0    / 0             |
| 0                         | 0000:42:00.0  | 0           0    / 0          3383 / 65536         |
+===========================+===============+====================================================+
+---------------------------+---------------+----------------------------------------------------+
| NPU     Chip              | Process id    | Process name             | Process memory(MB)      |
+===========================+===============+====================================================+
| No running processes found in NPU 0                                                            |
+===========================+===============+====================================================+
| No running processes found in NPU 1                                                            |
+===========================+===============+====================================================+
"""

# Atlas A3 style: each NPU carries two chips (two runtime devices), with a Phy-ID column.
SMI_A3_2X2 = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 25.0.rc1                 Version: 25.0.rc1                                             |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip  Phy-ID              | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
| 0     Ascend910           | OK            | 168.2       36                0    / 0             |
| 0     0                   | 0000:9D:00.0  | 0           0    / 0          3412 / 65536         |
| 1     1                   | 0000:9F:00.0  | 0           0    / 0          3398 / 65536         |
+===========================+===============+====================================================+
| 1     Ascend910           | Alarm         | 171.0       37                0    / 0             |
| 0     2                   | 0000:99:00.0  | 0           0    / 0          3405 / 65536         |
| 1     3                   | 0000:9B:00.0  | 0           0    / 0          3401 / 65536         |
+===========================+===============+====================================================+
"""

# Atlas 300I Duo style: an inference card with two 310P3 chips and no HBM column.
SMI_310P3_DUO = """\
+--------------------------------------------------------------------------------------------------------+
| npu-smi 23.0.0                                   Version: 23.0.0                                       |
+-------------------------------+-----------------+------------------------------------------------------+
| NPU     Name                  | Health          | Power(W)     Temp(C)           Hugepages-Usage(page) |
| Chip    Device                | Bus-Id          | AICore(%)    Memory-Usage(MB)                        |
+===============================+=================+======================================================+
| 8       310P3                 | OK              | NA           46                0     / 0             |
| 0       0                     | 0000:01:00.0    | 0            1612 / 44280                            |
| 1       1                     | 0000:01:00.0    | 0            1507 / 43693                            |
+===============================+=================+======================================================+
"""

# A host whose driver sees no device: title and headers, no NPU block.
SMI_NO_DEVICES = """\
+------------------------------------------------------------------------------------------------+
| npu-smi 24.1.rc2                 Version: 24.1.rc2                                             |
+---------------------------+---------------+----------------------------------------------------+
| NPU   Name                | Health        | Power(W)    Temp(C)           Hugepages-Usage(page)|
| Chip                      | Bus-Id        | AICore(%)   Memory-Usage(MB)  HBM-Usage(MB)        |
+===========================+===============+====================================================+
"""


def with_health(table: str, npu_id: int, health: str) -> str:
    """``table`` with the Health of NPU ``npu_id`` replaced (column width kept)."""
    pattern = re.compile(rf"^(\|\s*{npu_id}\s+\S+\s*\|\s)(\S+)(\s*)(\|)", re.MULTILINE)

    def swap(m: re.Match[str]) -> str:
        width = len(m.group(2)) + len(m.group(3))
        return f"{m.group(1)}{health:<{width - 1}} {m.group(4)}"

    out, n = pattern.subn(swap, table, count=1)
    assert n == 1, f"NPU {npu_id} not in the table"
    return out


_ASCEND_VARS = (
    "ASCEND_RT_VISIBLE_DEVICES", "ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH",
    "HCCL_CONNECT_TIMEOUT", "HCCL_EXEC_TIMEOUT", "HCCL_IF_BASE_PORT",
    "DLROVER_ASCEND_K8S_RESOURCE", "DLROVER_ASCEND_SLURM_GRES", "DLROVER_ASCEND_NPU_SMI",
    "DLROVER_ASCEND_HCCL_CONNECT_TIMEOUT_S", "DLROVER_ASCEND_HCCL_EXEC_TIMEOUT_S", "DLROVER_ASCEND_HCCL_IF_BASE_PORT",
)


@pytest.fixture(autouse=True)
def _clean_ascend_env(monkeypatch):
    """No test sees the Ascend or HCCL settings of the shell that runs pytest."""
    for var in _ASCEND_VARS:
        monkeypatch.delenv(var, raising=False)


def _path_without_npu_smi() -> str:
    dirs = [d for d in os.environ.get("PATH", "").split(os.pathsep) if d and not (Path(d) / "npu-smi").exists()]
    return os.pathsep.join(dirs)


@pytest.fixture
def no_npu_smi(monkeypatch) -> None:
    """``PATH`` holds no ``npu-smi``."""
    monkeypatch.setenv("PATH", _path_without_npu_smi())


@pytest.fixture
def fake_npu_smi(tmp_path, monkeypatch) -> Callable[..., Path]:
    """Install a fake ``npu-smi`` first on ``PATH``; call it with what ``npu-smi info`` prints.

    ``fake_npu_smi(table, exit_code=0, stderr="", hang=False)``: ``hang`` makes the tool sleep
    for 60 s, as a wedged driver does.
    """
    bin_dir = tmp_path / "npu-smi-bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{_path_without_npu_smi()}")

    def install(table: str = SMI_910B3_X8, *, exit_code: int = 0, stderr: str = "", hang: bool = False) -> Path:
        (bin_dir / "info.txt").write_text(table)
        (bin_dir / "stderr.txt").write_text(stderr)
        lines = ["#!/bin/sh", "# Stand-in for Huawei's npu-smi (tests of dlrover-plugin-ascend).",
                 'if [ "$1" = "info" ] && [ "$#" -eq 1 ]; then']
        if hang:
            lines.append("  exec sleep 60")
        else:
            lines += [f'  cat "{bin_dir}/info.txt"', f'  cat "{bin_dir}/stderr.txt" >&2', f"  exit {exit_code}"]
        lines += ["fi", 'echo "Usage: npu-smi <Command|-h|-v> [Options...]" >&2', "exit 1", ""]
        script = bin_dir / "npu-smi"
        script.write_text("\n".join(lines))
        script.chmod(0o755)
        return script

    return install


_FAKE_TORCH_NPU_BODY = '''
import os
import sys
import types

import torch  # like torch_npu, this needs torch imported first

if IMPORT_ERROR:
    raise ImportError(IMPORT_ERROR)


def _visible_count():
    # CANN reads ASCEND_RT_VISIBLE_DEVICES up to the first entry that is not a valid id.
    value = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    if value is None:
        return TOTAL
    count, last = 0, -1
    for token in value.split(","):
        if not token.isdigit() or int(token) >= TOTAL or int(token) <= last:
            break
        count, last = count + 1, int(token)
    return count


npu = types.ModuleType("torch_npu.npu")
npu.is_available = lambda: _visible_count() > 0
npu.device_count = _visible_count
npu.get_device_name = lambda device=None: "Ascend" + NAME
npu.set_device = lambda device: None
npu.synchronize = lambda device=None: None
utils = types.ModuleType("torch_npu.utils")
utils.get_cann_version = lambda module="CANN": CANN if module == "CANN" else ""
sys.modules["torch_npu.npu"] = npu
sys.modules["torch_npu.utils"] = utils

if RENAME_BACKEND:  # what the real package does; irreversible, so only in subprocesses
    torch.utils.rename_privateuse1_backend("npu")
    torch._register_device_module("npu", npu)
else:
    torch.npu = npu
    sys.modules["torch.npu"] = npu
'''


def _forget_fake_torch_npu() -> None:
    import torch

    for name in [m for m in sys.modules if m == "torch_npu" or m.startswith("torch_npu.")]:
        del sys.modules[name]
    if getattr(getattr(torch, "npu", None), "__name__", "") == "torch_npu.npu":
        del torch.npu
        sys.modules.pop("torch.npu", None)


@pytest.fixture
def fake_torch_npu(tmp_path, monkeypatch) -> Iterator[Callable[..., Path]]:
    """Put a fake ``torch_npu`` package on ``sys.path``; returns the directory holding it.

    ``fake_torch_npu(total=8, name="910B3", cann="8.1.RC1", import_error=None, rename_backend=False)``.
    ``import_error`` makes the import fail with that message, as a torch_npu built for another
    CANN does. The module and ``torch.npu`` are removed again after the test.
    """
    if importlib.util.find_spec("torch_npu") is not None and "torch_npu" not in sys.modules:
        pytest.skip("a real torch_npu is installed; the fake would be shadowed")
    site = tmp_path / "fake-site"
    site.mkdir()

    def install(total: int = 8, *, name: str = "910B3", cann: str = "8.1.RC1", import_error: str | None = None,
                rename_backend: bool = False) -> Path:
        _forget_fake_torch_npu()
        pkg = site / "torch_npu"
        pkg.mkdir(exist_ok=True)
        header = (f'"""Stand-in for Huawei\'s torch_npu (tests of dlrover-plugin-ascend)."""\n'
                  f"TOTAL = {total!r}\nNAME = {name!r}\nCANN = {cann!r}\n"
                  f"IMPORT_ERROR = {import_error!r}\nRENAME_BACKEND = {rename_backend!r}\n")
        (pkg / "__init__.py").write_text(header + _FAKE_TORCH_NPU_BODY)
        monkeypatch.syspath_prepend(str(site))
        return site

    yield install
    _forget_fake_torch_npu()


@pytest.fixture
def no_torch_npu() -> None:
    """``torch_npu`` cannot be found (skips where a real one is installed)."""
    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("a real torch_npu is installed")


@pytest.fixture
def tables() -> SimpleNamespace:
    """The stored ``npu-smi info`` tables above, and ``with_health(table, npu_id, health)``."""
    return SimpleNamespace(a2_910b3_x8=SMI_910B3_X8, a3_2x2=SMI_A3_2X2, duo_310p3=SMI_310P3_DUO,
                           no_devices=SMI_NO_DEVICES, with_health=with_health)
