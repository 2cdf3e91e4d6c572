"""The cuda probe against a stand-in ``nvidia-smi`` that prints what the real tool prints.

The stand-in answers ``--query-gpu=<fields> --format=csv[,noheader][,nounits]`` from a table,
as documented in nvidia-smi(1) (https://docs.nvidia.com/deploy/nvidia-smi/, SELECTIVE QUERY
OPTIONS: one line per GPU, values in the order asked, separated by ", ", numbers without units
under ``nounits``; unsupported data reads ``[N/A]``; RETURN VALUE 2 for an invalid argument,
6 when no object was found — printed as "No devices were found"). Field names and values are
those of ``nvidia-smi --help-query-gpu``.

These tests force the nvidia-smi path (``use_nvml=False``) and replace torch's answers, so they
pass the same on a machine with or without nvidia-ml-py, a GPU or a CUDA build of torch.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time

import pytest
import torch
from structlog.testing import capture_logs

from dlrover_core import DeviceError
from dlrover_plugin_cuda import CudaAccelerator, _accelerator, _probe
from dlrover_plugin_cuda._probe import BASE_FIELDS, HEALTH_FIELDS, TorchCuda, parse_smi_csv, select_visible

CPU_TORCH = TorchCuda(version="2.13.0+cpu")
CUDA_TORCH = TorchCuda(version="2.13.0+cu128", cuda="12.8", available=True, count=2)

# Rows as nvidia-smi prints them for an 8x H100 server, a workstation GeForce (no ECC, so its
# memory-health fields read [N/A]) and a GPU in trouble.
H100 = {
    "index": "0", "uuid": "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6", "name": "NVIDIA H100 80GB HBM3",
    "memory.total": "81559", "driver_version": "550.90.07", "pci.bus_id": "00000000:18:00.0",
    "ecc.errors.uncorrected.volatile.total": "0", "retired_pages.pending": "No", "remapped_rows.failure": "No",
}


def h100(index: int, uuid: str, bus: str, **changes: str) -> dict[str, str]:
    return {**H100, "index": str(index), "uuid": uuid, "pci.bus_id": bus, **changes}


FOUR_H100 = [
    h100(0, "GPU-8932f937-d72c-4106-c12f-20bd9faed9f6", "00000000:18:00.0"),
    h100(1, "GPU-1c2a4e55-0b3f-4a8e-9d41-7f0c9e2b6a10", "00000000:2A:00.0"),
    h100(2, "GPU-5e7d90c1-22aa-4c0f-b3e2-9a8f41d07c3b", "00000000:3A:00.0"),
    h100(3, "GPU-a0b1c2d3-e4f5-4a6b-8c7d-0e1f2a3b4c5d", "00000000:5D:00.0"),
]
GEFORCE = {
    "index": "0", "uuid": "GPU-57737cf0-1db6-4905-9caa-1eeb73beb974", "name": "NVIDIA GeForce RTX 4090",
    "memory.total": "24564", "driver_version": "550.90.07", "pci.bus_id": "00000000:01:00.0",
    "ecc.errors.uncorrected.volatile.total": "[N/A]", "retired_pages.pending": "[N/A]",
    "remapped_rows.failure": "[N/A]",
}

FAKE_SMI = '''\
#!{python}
"""Stand-in for nvidia-smi --query-gpu (see the test module's docstring)."""
import json
import sys

spec = json.load(open({spec!r}))
args = dict(a.split("=", 1) for a in sys.argv[1:] if "=" in a)
if spec.get("none"):
    print("No devices were found")
    sys.exit(6)
if spec.get("stdout") is not None:
    sys.stdout.write(spec["stdout"])
    sys.exit(0)
fields = args["--query-gpu"].split(",")
fmt = args["--format"].split(",")
for field in fields:
    if field not in spec["known"]:
        print(f'Field "{{field}}" is not a valid field to query.')
        print()
        print("Run 'nvidia-smi --help-query-gpu' for usage.")
        sys.exit(2)
if "csv" not in fmt:
    sys.exit(2)
units = {{"memory.total": " MiB"}}
if "noheader" not in fmt:
    print(", ".join(f + (" [MiB]" if f in units and "nounits" not in fmt else "") for f in fields))
for row in spec["rows"]:
    values = []
    for f in fields:
        v = row[f]
        if f in units and "nounits" not in fmt and not v.startswith("["):
            v += units[f]
        values.append(v)
    print(", ".join(values))
'''


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(_accelerator, "torch_cuda", lambda: CPU_TORCH)


@pytest.fixture
def smi(tmp_path, monkeypatch):
    """``smi(rows)`` puts a stand-in nvidia-smi first on PATH, answering with ``rows``."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")

    def install(rows=(), *, known=BASE_FIELDS + HEALTH_FIELDS, none=False, stdout=None, script=None):
        spec = tmp_path / "smi.json"
        spec.write_text(json.dumps({"rows": list(rows), "known": list(known), "none": none, "stdout": stdout}))
        tool = bindir / "nvidia-smi"
        tool.write_text(script or FAKE_SMI.format(python=sys.executable, spec=str(spec)))
        tool.chmod(0o755)

    return install


def acc(**kwargs) -> CudaAccelerator:
    return CudaAccelerator(use_nvml=False, **{"require_torch_cuda": False, "tool_timeout_s": 10, **kwargs})


def test_missing_tool_is_absent_with_reason(tmp_path, monkeypatch):
    """With no nvidia-smi on PATH and a torch without CUDA, the probe says both, and nothing is present."""
    monkeypatch.setenv("PATH", str(tmp_path))
    report = acc().probe()
    assert not report.present and report.count == 0 and report.healthy == ()
    assert report.reason == "nvidia-smi not on PATH and torch has no CUDA (torch 2.13.0+cpu)"


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch has CUDA")
def test_missing_tool_reason_names_the_real_torch(tmp_path, monkeypatch):
    """Unpatched, the reason names the torch installed here (a CPU build)."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(_accelerator, "torch_cuda", _probe.torch_cuda)
    report = acc().probe()
    assert not report.present
    assert report.reason == f"nvidia-smi not on PATH and torch has no CUDA (torch {torch.__version__})"


def test_four_gpus_found(smi):
    """Every GPU nvidia-smi lists is counted, with its model, memory (MiB) and the driver."""
    smi(FOUR_H100)
    report = acc().probe()
    assert report.present and report.reason is None
    assert report.count == 4 and report.healthy == (True,) * 4
    assert report.model == "NVIDIA H100 80GB HBM3"
    assert report.memory_mb == 81559 and report.driver_version == "550.90.07"
    assert acc().default_nproc_per_node() == 4


def test_geforce_without_ecc_is_healthy(smi):
    """[N/A] in a health field means the GPU does not support it (no ECC), not that it is sick."""
    smi([GEFORCE])
    report = acc().probe()
    assert report.present and report.count == 1 and report.healthy == (True,)
    assert report.model == "NVIDIA GeForce RTX 4090" and report.memory_mb == 24564


def test_malformed_output_is_reported(smi):
    """Output that is not the documented CSV makes the probe absent with what was not understood."""
    smi(stdout="NVIDIA H100 80GB HBM3, 81559\n")
    report = acc().probe()
    assert not report.present
    assert report.reason.startswith("nvidia-smi output not understood: line 1 has 2 values, expected 9")
    smi(stdout="GPU 0, GPU-x, NVIDIA H100, lots, 550.90.07, 00000000:18:00.0, 0, No, No\n")
    report = acc().probe()
    assert not report.present and "index 'GPU 0' is not a number" in report.reason


def test_hung_tool_times_out(smi):
    """A hung nvidia-smi is killed after tool_timeout_s and the probe says so, within about that time."""
    smi(script="#!/bin/sh\nexec sleep 60\n")
    t0 = time.monotonic()
    report = acc(tool_timeout_s=0.5).probe()
    elapsed = time.monotonic() - t0
    assert not report.present
    assert "nvidia-smi timed out after 0.5 s" in report.reason
    assert elapsed < 5, elapsed


def test_zero_devices(smi):
    """"No devices were found" (status 6) is zero visible devices, not a tool failure."""
    smi(none=True)
    report = acc().probe()
    assert not report.present and report.count == 0
    assert report.reason == "0 devices visible (nvidia-smi lists no GPU)"
    assert acc().default_nproc_per_node() == 1


def test_one_unhealthy_device_still_counts(smi):
    """A GPU with uncorrectable ECC errors counts, marked unhealthy, and the reason is logged."""
    rows = [FOUR_H100[0], {**FOUR_H100[1], "ecc.errors.uncorrected.volatile.total": "2"}]
    smi(rows)
    with capture_logs() as logs:
        report = acc().probe()
    assert report.present and report.count == 2 and report.healthy == (True, False)
    sick = [e for e in logs if e["event"] == "cuda_device_unhealthy"]
    assert len(sick) == 1 and sick[0]["index"] == 1 and sick[0]["log_level"] == "warning"
    assert sick[0]["problems"] == ["2 uncorrectable ECC error(s) since the driver loaded "
                                   "(ecc.errors.uncorrected.volatile.total)"]


@pytest.mark.parametrize(("changes", "problem"), [
    ({"retired_pages.pending": "Yes"}, "memory pages wait for retirement"),
    ({"remapped_rows.failure": "Yes"}, "a memory row remapping failed, an RMA condition"),
    ({"memory.total": "[GPU requires reset]", "ecc.errors.uncorrected.volatile.total": "[GPU requires reset]"},
     "memory.total reads [GPU requires reset]"),
    ({"name": "[Unknown Error]"}, "name reads [Unknown Error]"),
])
def test_unhealthy_signals(smi, changes, problem):
    """Pending page retirement, a failed row remapping and unreadable values each make a GPU unhealthy."""
    smi([FOUR_H100[0], {**FOUR_H100[1], **changes}])
    with capture_logs() as logs:
        report = acc().probe()
    assert report.present and report.healthy == (True, False)
    (sick,) = [e for e in logs if e["event"] == "cuda_device_unhealthy"]
    assert any(problem in p for p in sick["problems"]), sick["problems"]


def test_old_driver_without_health_fields(smi):
    """A driver that rejects a health field (status 2) is asked again for the base fields alone."""
    smi(FOUR_H100[:2], known=BASE_FIELDS + HEALTH_FIELDS[:2])
    report = acc().probe()
    assert report.present and report.count == 2 and report.healthy == (True, True)


@pytest.mark.parametrize(("value", "count", "first_uuid"), [
    ("2,0", 2, "GPU-5e7d"),
    ("3", 1, "GPU-a0b1"),
    ("GPU-1c2a4e55", 1, "GPU-1c2a"),
    ("GPU-a0b1c2d3-e4f5-4a6b-8c7d-0e1f2a3b4c5d,1", 2, "GPU-a0b1"),
])
def test_cuda_visible_devices_subset(smi, monkeypatch, value, count, first_uuid):
    """Only the GPUs CUDA_VISIBLE_DEVICES names (indices or UUID prefixes) are counted, in its order."""
    smi([FOUR_H100[0], {**FOUR_H100[1], "remapped_rows.failure": "Yes"}, *FOUR_H100[2:]])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    report = acc().probe()
    assert report.present and report.count == count
    visible, _ = select_visible(parse_smi_csv("\n".join(", ".join(r.values()) for r in FOUR_H100),
                                              BASE_FIELDS + HEALTH_FIELDS)[0], value)
    assert visible[0].uuid.startswith(first_uuid)
    assert report.healthy == tuple(g.index != 1 for g in visible)


def test_each_visible_gpus_numa_node_comes_from_its_pci_address(smi, monkeypatch, tmp_path):
    """--numa-binding: the NUMA node of each GPU the workers see, in CUDA_VISIBLE_DEVICES order,
    is its PCI device's in sysfs (-1, one node, reads 0), as torch finds it."""
    smi(FOUR_H100)
    for bus, node in (("18", "0"), ("2a", "-1"), ("3a", "1"), ("5d", "1")):
        path = tmp_path / "sys" / "bus" / "pci" / "devices" / f"0000:{bus}:00.0" / "numa_node"
        path.parent.mkdir(parents=True)
        path.write_text(node + "\n")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,0,1")
    gpus = acc()
    gpus.sysfs = str(tmp_path / "sys")
    assert gpus.numa_nodes() == (1, 0, 0)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(DeviceError, match="--numa-binding: no GPU is visible"):
        acc().numa_nodes()


def test_cuda_visible_devices_invalid_entry_stops(smi, monkeypatch):
    """As in CUDA, an entry that names no GPU hides itself and the entries after it."""
    smi(FOUR_H100)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,7,2")
    with capture_logs() as logs:
        report = acc().probe()
    assert report.present and report.count == 1
    (note,) = [e for e in logs if e["event"] == "cuda_visible_devices_entry_ignored"]
    assert note["note"] == "CUDA_VISIBLE_DEVICES entry '7' matches no GPU; it and the entries after it are ignored"


@pytest.mark.parametrize("value", ["", "-1", "GPU-ffff"])
def test_cuda_visible_devices_hides_everything(smi, monkeypatch, value):
    """CUDA_VISIBLE_DEVICES that selects nothing gives zero visible devices and says why."""
    smi(FOUR_H100)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    report = acc().probe()
    assert not report.present and report.count == 0
    assert report.reason.startswith("0 devices visible (") and "nvidia-smi lists 4 GPU(s)" in report.reason


def test_mig_entry_takes_parent_gpu(smi, monkeypatch):
    """A MIG-GPU-<uuid>/<gi>/<ci> entry counts as one device of its parent's model."""
    smi(FOUR_H100)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-GPU-8932f937-d72c-4106-c12f-20bd9faed9f6/1/0")
    report = acc().probe()
    assert report.present and report.count == 1 and report.model == "NVIDIA H100 80GB HBM3"


# ----- torch cross-check ----------------------------------------------------------------------


def test_gpus_without_cuda_torch_are_absent(smi):
    """GPUs that the installed torch cannot use (no CUDA build) are reported absent, saying so."""
    smi(FOUR_H100[:2])
    report = CudaAccelerator(use_nvml=False).probe()
    assert not report.present and report.count == 0
    assert report.reason == ("nvidia-smi lists 2 visible NVIDIA GPU(s) (NVIDIA H100 80GB HBM3) but torch has no "
                             "CUDA (torch 2.13.0+cpu); install a CUDA build of torch")
    assert report.model == "NVIDIA H100 80GB HBM3" and report.driver_version == "550.90.07"


def test_torch_cuda_unavailable_is_absent(smi, monkeypatch):
    """A CUDA torch that cannot reach the GPUs (driver too old) makes the report absent."""
    smi(FOUR_H100[:2])
    monkeypatch.setattr(_accelerator, "torch_cuda", lambda: TorchCuda(version="2.13.0+cu128", cuda="12.8",
                                                                       available=False, count=0))
    report = CudaAccelerator(use_nvml=False).probe()
    assert not report.present
    assert "but torch.cuda.is_available() is False (torch 2.13.0+cu128, CUDA 12.8, driver 550.90.07)" in report.reason


def test_cuda_torch_agrees(smi, monkeypatch):
    """With a CUDA torch that sees the same GPUs, the report carries torch's CUDA version."""
    smi(FOUR_H100[:2])
    monkeypatch.setattr(_accelerator, "torch_cuda", lambda: CUDA_TORCH)
    report = CudaAccelerator(use_nvml=False).probe()
    assert report.present and report.count == 2 and report.runtime_version == "12.8"


def test_torch_count_wins_on_mismatch(smi, monkeypatch):
    """When torch sees fewer devices than the tool lists, its count (what workers get) is reported."""
    smi(FOUR_H100)
    monkeypatch.setattr(_accelerator, "torch_cuda", lambda: CUDA_TORCH)
    with capture_logs() as logs:
        report = CudaAccelerator(use_nvml=False).probe()
    assert report.present and report.count == 2 and len(report.healthy) == 2
    assert [e["event"] for e in logs if e["event"] == "cuda_count_mismatch"] == ["cuda_count_mismatch"]


def _torch_only(monkeypatch, tmp_path, names):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(_accelerator, "torch_cuda", lambda: TorchCuda(version="2.13.0+cu128", cuda="12.8",
                                                                       available=True, count=len(names)))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=None: names[i])
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: type("Props", (), {"total_memory": 80 * 2**30})())


def test_ppu_through_torch_cuda_is_not_claimed(monkeypatch, tmp_path):
    """Without nvidia-smi, devices that answer through torch.cuda but are not NVIDIA's are left to their plugin."""
    _torch_only(monkeypatch, tmp_path, ["PPU-ZW810E", "PPU-ZW810E"])
    report = CudaAccelerator(use_nvml=False).probe()
    assert not report.present
    assert report.reason == "torch.cuda devices are not NVIDIA GPUs (PPU-ZW810E); see the ppu plugin"


def test_nvidia_gpus_through_torch_only(monkeypatch, tmp_path):
    """Without nvidia-smi, NVIDIA-named devices seen by torch.cuda are reported from torch."""
    _torch_only(monkeypatch, tmp_path, ["NVIDIA A100-SXM4-80GB", "NVIDIA A100-SXM4-80GB"])
    report = CudaAccelerator(use_nvml=False).probe()
    assert report.present and report.count == 2 and report.model == "NVIDIA A100-SXM4-80GB"
    assert report.memory_mb == 80 * 1024 and report.runtime_version == "12.8"


# ----- NVML ---------------------------------------------------------------------------------


class _NVMLError(Exception):
    def __init__(self, value):
        self.value = value
        super().__init__({3: "Not Supported", 15: "GPU is lost"}.get(value, "Unknown Error"))


class FakeNVML:
    """The part of nvidia-ml-py's ``pynvml`` API the probe uses (NVML API Reference Guide)."""

    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
    NVML_VOLATILE_ECC = 0
    NVML_FEATURE_ENABLED = 1

    def __init__(self, rows, *, init_error=None):
        self.rows, self.init_error, self.shut = rows, init_error, False

    def nvmlInit(self):
        if self.init_error:
            raise _NVMLError(self.init_error)

    def nvmlShutdown(self):
        self.shut = True

    def nvmlSystemGetDriverVersion(self):
        return "550.90.07"

    def nvmlDeviceGetCount(self):
        return len(self.rows)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.rows[i]

    def nvmlDeviceGetName(self, h):
        return h["name"]

    def nvmlDeviceGetUUID(self, h):
        return h["uuid"]

    def nvmlDeviceGetMemoryInfo(self, h):
        return type("Memory", (), {"total": h["mem_bytes"]})()

    def nvmlDeviceGetPciInfo(self, h):
        return type("Pci", (), {"busId": h["bus"]})()

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        assert (kind, counter) == (1, 0)
        if h.get("ecc") is None:
            raise _NVMLError(3)
        return h["ecc"]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h):
        raise _NVMLError(3)  # Ampere and later remap rows instead

    def nvmlDeviceGetRemappedRows(self, h):
        return (0, 1, 0, h.get("remap_failure", 0))


NVML_ROWS = [
    {"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-a", "mem_bytes": 81559 * 2**20, "bus": "00000000:18:00.0", "ecc": 0},
    {"name": b"NVIDIA H100 80GB HBM3", "uuid": b"GPU-b", "mem_bytes": 81559 * 2**20, "bus": b"00000000:2A:00.0",
     "ecc": None, "remap_failure": 1},
]


def test_nvml_is_preferred_when_importable(monkeypatch, tmp_path):
    """With pynvml importable, GPUs and their health come from NVML; unsupported counters are not problems."""
    fake = FakeNVML(NVML_ROWS)
    monkeypatch.setattr(_accelerator, "try_import", lambda name: (fake, None) if name == "pynvml" else (None, "no"))
    monkeypatch.setenv("PATH", str(tmp_path))
    report = CudaAccelerator(require_torch_cuda=False).probe()
    assert report.present and report.count == 2 and report.healthy == (True, False)
    assert report.memory_mb == 81559 and report.driver_version == "550.90.07" and fake.shut


def test_nvml_failure_falls_back_to_nvidia_smi(monkeypatch, smi):
    """When NVML cannot start (no driver library), nvidia-smi is asked instead."""
    fake = FakeNVML(NVML_ROWS, init_error=12)
    monkeypatch.setattr(_accelerator, "try_import", lambda name: (fake, None))
    smi([GEFORCE])
    report = CudaAccelerator(require_torch_cuda=False).probe()
    assert report.present and report.model == "NVIDIA GeForce RTX 4090"


def test_probe_never_raises(monkeypatch):
    """A bug or a surprise inside the probe becomes an absent report with the error, not an exception."""
    def boom():
        raise RuntimeError("surprise")

    monkeypatch.setattr(_accelerator, "torch_cuda", boom)
    report = acc().probe()
    assert not report.present and report.reason == "cuda probe failed: RuntimeError: surprise"


def test_stand_in_prints_documented_header_without_noheader(tmp_path):
    """Sanity check of the stand-in itself: without noheader/nounits it prints a header and units."""
    spec = tmp_path / "s.json"
    spec.write_text(json.dumps({"rows": [H100], "known": list(H100), "none": False, "stdout": None}))
    tool = tmp_path / "nvidia-smi"
    tool.write_text(FAKE_SMI.format(python=sys.executable, spec=str(spec)))
    tool.chmod(0o755)
    import subprocess

    out = subprocess.run([str(tool), "--query-gpu=name,memory.total", "--format=csv"], capture_output=True, text=True)
    assert out.stdout == textwrap.dedent("""\
        name, memory.total [MiB]
        NVIDIA H100 80GB HBM3, 81559 MiB
        """)
