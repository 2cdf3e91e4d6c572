"""The ppu probe: what it finds, and why it finds nothing, without PPU hardware."""

from __future__ import annotations

import time

import pytest
from structlog.testing import capture_logs

from dlrover_plugin_ppu import PpuAccelerator, _accelerator


def probe(**settings):
    return PpuAccelerator(**settings).probe()


# ----- ppu-smi missing, failing, hanging, not understood ----------------------------------


def test_without_ppu_smi_on_a_cpu_machine_the_reason_is_the_missing_tool(no_smi, torch_cuda):
    """No ppu-smi and no CUDA devices: absent, and the reason names the missing tool."""
    torch_cuda(None)
    report = probe()
    assert not report.present
    assert report.count == 0
    assert report.reason == "ppu-smi not on PATH"


def test_a_ppu_smi_path_that_does_not_exist_is_named_in_the_reason(no_smi, torch_cuda, tmp_path, monkeypatch):
    """DLROVER_PPU_SMI may point at the SDK's ppu-smi; a wrong path says where it looked."""
    torch_cuda(None)
    monkeypatch.setenv("DLROVER_PPU_SMI", str(tmp_path / "sdk" / "ppu-smi"))
    report = probe()
    assert not report.present
    assert report.reason == f"ppu-smi not found at {tmp_path / 'sdk' / 'ppu-smi'} (DLROVER_PPU_SMI)"


def test_ppu_smi_named_by_path_is_used_when_it_is_not_on_path(fake_smi, torch_cuda, tmp_path, monkeypatch):
    """A ppu-smi outside PATH works when DLROVER_PPU_SMI names it."""
    fake_smi.lists(fake_smi.TWO_PPUS).remapped("")
    monkeypatch.setenv("PATH", str(tmp_path))  # the fake's own directory is no longer on PATH
    monkeypatch.setenv("DLROVER_PPU_SMI", str(fake_smi.path))
    torch_cuda(["PPU-ZW810E"] * 2)
    assert probe().present


def test_malformed_output_is_reported_as_not_understood(fake_smi, torch_cuda):
    """Output that is not the queried CSV is never guessed at."""
    torch_cuda(None)
    fake_smi.lists("+-----------------------------+\n| PPU-SMI 1.28  Driver Version |\n")
    report = probe()
    assert not report.present
    assert report.reason.startswith("ppu-smi output not understood: --query-ppu line 1 has 1 fields, expected 6")


def test_a_non_numeric_index_is_not_understood(fake_smi, torch_cuda):
    torch_cuda(None)
    fake_smi.lists("zero, GPU-1, PPU-ZW810E, 98304, Default, 1.3.2\n")
    assert probe().reason == "ppu-smi output not understood: --query-ppu: index 'zero' is not a number"


def test_a_hanging_ppu_smi_is_abandoned_after_the_timeout(fake_smi, torch_cuda):
    """A hung management tool costs the probe its timeout, not more, and says so."""
    torch_cuda(None)
    fake_smi.lists(fake_smi.TWO_PPUS).hangs()
    t0 = time.monotonic()
    report = probe(smi_timeout_s=0.5)
    elapsed_s = time.monotonic() - t0
    assert not report.present
    assert report.reason == "ppu-smi timed out after 0.5 s"
    assert elapsed_s < 5.0


def test_the_timeout_can_be_set_by_environment(fake_smi, torch_cuda, monkeypatch):
    torch_cuda(None)
    fake_smi.hangs()
    monkeypatch.setenv("DLROVER_PPU_SMI_TIMEOUT_S", "0.3")
    assert probe().reason == "ppu-smi timed out after 0.3 s"


def test_a_failing_ppu_smi_gives_its_exit_status_and_message(fake_smi, torch_cuda):
    torch_cuda(None)
    fake_smi.lists("", rc=9, stderr="Failed to initialize HGML: Driver Not Loaded\n")
    report = probe()
    assert not report.present
    assert report.reason == "ppu-smi exited with status 9: Failed to initialize HGML: Driver Not Loaded"


# ----- zero devices -----------------------------------------------------------------------


def test_ppu_smi_listing_nothing_means_zero_devices(fake_smi, torch_cuda):
    torch_cuda(None)
    fake_smi.lists("")
    report = probe()
    assert not report.present
    assert report.reason == "0 devices visible: ppu-smi lists no PPU"


def test_ppu_smi_reporting_no_devices_means_zero_devices(fake_smi, torch_cuda):
    torch_cuda(None)
    fake_smi.lists("", rc=6, stderr="No devices were found\n")
    assert probe().reason == "0 devices visible: ppu-smi exited with status 6: No devices were found"


def test_ppus_hidden_from_this_process_are_zero_visible_devices(fake_smi, torch_cuda, monkeypatch):
    """ppu-smi lists the host's PPUs, but an empty CUDA_VISIBLE_DEVICES hides them all."""
    fake_smi.lists(fake_smi.TWO_PPUS).remapped("")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    torch_cuda([])
    report = probe()
    assert not report.present
    assert report.reason == ("0 devices visible: ppu-smi lists 2 PPU(s) but torch.cuda sees none "
                             "(CUDA_VISIBLE_DEVICES='')")


# ----- present, healthy and not --------------------------------------------------------------


def test_two_ppus_listed_by_ppu_smi_and_seen_by_torch(fake_smi, torch_cuda):
    """The common case: model, memory and driver from ppu-smi, count from torch.cuda."""
    fake_smi.lists(fake_smi.TWO_PPUS).remapped(f"{fake_smi.UUID0}, No, No\n{fake_smi.UUID1}, No, No\n")
    torch_cuda(["PPU-ZW810E"] * 2)
    report = probe()
    assert report.present
    assert report.count == 2
    assert report.model == "PPU-ZW810E"
    assert report.memory_mb == 98304
    assert report.driver_version == "1.3.2-d7f5a2"
    assert report.healthy == (True, True)
    assert report.reason is None
    assert fake_smi.calls == [
        "--query-ppu=index,uuid,name,memory.total,compute_mode,driver_version --format=csv,noheader,nounits",
        "--query-remapped-rows=uuid,remapped_rows.pending,remapped_rows.failure --format=csv,noheader,nounits",
    ]


def test_a_failed_row_remap_makes_that_device_unhealthy(fake_smi, torch_cuda):
    """Health is per device, from what ppu-smi shows; the bad one is logged."""
    fake_smi.lists(fake_smi.TWO_PPUS).remapped(f"{fake_smi.UUID0}, No, No\n{fake_smi.UUID1}, No, Yes\n")
    torch_cuda(["PPU-ZW810E"] * 2)
    with capture_logs() as logs:
        report = probe()
    assert report.present
    assert report.healthy == (True, False)
    assert {"event": "ppu_device_unhealthy", "index": 1, "uuid": fake_smi.UUID1,
            "problems": ["a memory row remap has failed"], "log_level": "warning"} in logs


def test_a_pending_row_remap_makes_that_device_unhealthy(fake_smi, torch_cuda):
    fake_smi.lists(fake_smi.TWO_PPUS).remapped(f"{fake_smi.UUID0}, Yes, No\n{fake_smi.UUID1}, No, No\n")
    torch_cuda(["PPU-ZW810E"] * 2)
    assert probe().healthy == (False, True)


def test_a_prohibited_compute_mode_makes_that_device_unhealthy(fake_smi, torch_cuda):
    """A PPU in compute mode Prohibited accepts no context: a job cannot use it."""
    fake_smi.lists(fake_smi.TWO_PPUS.replace("98304, Default, 1.3.2-d7f5a2\n", "98304, Prohibited, 1.3.2-d7f5a2\n", 1))
    fake_smi.remapped("")
    torch_cuda(["PPU-ZW810E"] * 2)
    assert probe().healthy == (False, True)


def test_health_follows_the_visible_devices(fake_smi, torch_cuda, monkeypatch):
    """With CUDA_VISIBLE_DEVICES=1 the one visible PPU is ppu-smi's device 1."""
    fake_smi.lists(fake_smi.TWO_PPUS).remapped(f"{fake_smi.UUID0}, No, Yes\n{fake_smi.UUID1}, No, No\n")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    torch_cuda(["PPU-ZW810E"])
    report = probe()
    assert (report.count, report.healthy) == (1, (True,))


def test_unmatched_visible_devices_share_the_hosts_verdict(fake_smi, torch_cuda, monkeypatch):
    """A visible set ppu-smi's rows cannot be matched to (a MIG UUID) gets the conservative
    verdict: unhealthy if any of the host's PPUs is."""
    fake_smi.lists(fake_smi.TWO_PPUS).remapped(f"{fake_smi.UUID0}, No, Yes\n{fake_smi.UUID1}, No, No\n")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-79c62632-04cc-574b-af7b-cb2e307121c85")
    torch_cuda(["PPU-ZW810E"])
    assert probe().healthy == (False,)


def test_remapped_rows_that_cannot_be_queried_do_not_hide_the_devices(fake_smi, torch_cuda):
    """Older ppu-smi without --query-remapped-rows: devices present, health from compute mode."""
    fake_smi.lists(fake_smi.TWO_PPUS).remapped("", rc=2, stderr="Invalid combination of input arguments.\n")
    torch_cuda(["PPU-ZW810E"] * 2)
    report = probe()
    assert (report.present, report.healthy) == (True, (True, True))


def test_memory_reported_as_na_falls_back_to_torch(fake_smi, torch_cuda):
    fake_smi.lists("0, GPU-a, PPU-ZW810E, N/A, Default, N/A\n").remapped("GPU-a, N/A, N/A\n")
    torch_cuda(["PPU-ZW810E"], memory_mb=98304)
    report = probe()
    assert (report.memory_mb, report.driver_version, report.healthy) == (98304, None, (True,))


def test_ppu_smi_listing_ppus_but_cpu_only_torch_is_not_usable(fake_smi, torch_cuda):
    """The devices are there but this PyTorch cannot drive them: say so, do not claim them."""
    fake_smi.lists(fake_smi.TWO_PPUS)
    torch_cuda(None)
    report = probe()
    assert not report.present
    assert report.reason.startswith("ppu-smi lists 2 PPU(s) but torch.cuda is not available (torch ")


# ----- PPU or NVIDIA: both answer through torch.cuda ----------------------------------------


def test_nvidia_gpus_are_not_claimed(no_smi, torch_cuda):
    """An NVIDIA machine answers torch.cuda too; without ppu-smi it is not a PPU machine."""
    torch_cuda(["NVIDIA H100 80GB HBM3"] * 8)
    report = probe()
    assert not report.present
    assert report.reason == ("torch.cuda devices are NVIDIA GPUs, not PPUs (8 × 'NVIDIA H100 80GB HBM3'); "
                             "ppu-smi not on PATH")


def test_older_nvidia_names_are_recognised_too(no_smi, torch_cuda):
    torch_cuda(["Tesla V100-SXM2-32GB"])
    assert probe().reason.startswith("torch.cuda devices are NVIDIA GPUs, not PPUs ('Tesla V100-SXM2-32GB')")


def test_nvidia_gpus_are_not_claimed_even_beside_a_ppu_smi(fake_smi, torch_cuda):
    """ppu-smi lists PPUs but this torch drives NVIDIA GPUs: not usable as PPUs."""
    fake_smi.lists(fake_smi.TWO_PPUS)
    torch_cuda(["NVIDIA A100-SXM4-80GB"] * 2)
    report = probe()
    assert not report.present
    assert report.reason.startswith("torch.cuda devices are NVIDIA GPUs, not PPUs (2 × 'NVIDIA A100-SXM4-80GB'), "
                                    "although ppu-smi lists 2 PPU(s)")


def test_ppus_are_found_by_name_when_ppu_smi_is_missing(no_smi, torch_cuda):
    """In a container without ppu-smi, torch.cuda's device names identify PPUs."""
    torch_cuda(["PPU-ZW810E"] * 4, memory_mb=98304)
    report = probe()
    assert report.present
    assert (report.count, report.model, report.memory_mb, report.healthy) == (4, "PPU-ZW810E", 98304, (True,) * 4)


def test_early_sdk_device_names_are_ppus(no_smi, torch_cuda):
    torch_cuda(["alixpu"])
    assert probe().present


def test_unknown_device_names_are_not_claimed_without_ppu_smi(no_smi, torch_cuda):
    torch_cuda(["Some Other Accelerator"])
    report = probe()
    assert not report.present
    assert report.reason == (r"ppu-smi not on PATH, and torch.cuda's devices ('Some Other Accelerator') do not match "
                             r"the PPU name pattern '\\bPPU\\b|alixpu' (DLROVER_PPU_NAME_PATTERN)")


def test_the_name_pattern_is_a_setting(no_smi, torch_cuda, monkeypatch):
    torch_cuda(["Zhenwu 910X"])
    monkeypatch.setenv("DLROVER_PPU_NAME_PATTERN", r"zhenwu")
    assert probe().present


def test_an_invalid_name_pattern_is_a_reason_not_a_crash(no_smi, torch_cuda, monkeypatch):
    torch_cuda(None)
    monkeypatch.setenv("DLROVER_PPU_NAME_PATTERN", "PPU(")
    report = probe()
    assert not report.present
    assert report.reason.startswith("DLROVER_PPU_NAME_PATTERN='PPU(' is not a regular expression")


# ----- a probe never raises -----------------------------------------------------------------


def test_a_crashing_torch_cuda_becomes_a_reason(no_smi, monkeypatch):
    import torch

    def broken():
        raise RuntimeError("driver crashed")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", broken)
    monkeypatch.setattr(_accelerator, "cpu_only_torch", lambda: None)  # a GPU build of torch
    report = probe()
    assert not report.present
    assert report.reason == "probe failed: RuntimeError: driver crashed"


def test_an_unreadable_device_name_is_not_taken_for_a_ppu(no_smi, torch_cuda, monkeypatch):
    import torch

    torch_cuda(["PPU-ZW810E", "PPU-ZW810E"])

    def name(device=None):
        raise RuntimeError("cannot read the name")

    monkeypatch.setattr(torch.cuda, "get_device_name", name)
    report = probe()
    assert not report.present
    assert "2 × unnamed device" in report.reason


@pytest.mark.parametrize("count,expected", [(4, 4), (0, 1)])
def test_default_processes_per_node_is_the_ppu_count(no_smi, torch_cuda, count, expected):
    torch_cuda(["PPU-ZW810E"] * count if count else None)
    assert PpuAccelerator().default_nproc_per_node() == expected
