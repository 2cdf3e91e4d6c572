"""``AscendAccelerator.probe()`` against fakes of npu-smi and torch_npu: what it finds, and
the reason it gives when it finds nothing usable."""

from __future__ import annotations

import os
import time

from structlog.testing import capture_logs

from dlrover_plugin_ascend import AscendAccelerator


def test_a_healthy_a2_node_is_present_with_model_memory_versions_and_health(fake_npu_smi, fake_torch_npu):
    """npu-smi lists eight healthy 910B3 and torch_npu counts eight: all of it is reported."""
    fake_npu_smi()
    fake_torch_npu(8, cann="8.1.RC1")
    report = AscendAccelerator().probe()
    assert report.present, report.reason
    assert report.count == 8
    assert report.model == "Ascend 910B3"
    assert report.memory_mb == 65536
    assert report.driver_version == "24.1.rc2"
    assert report.runtime_version == "8.1.RC1"
    assert report.healthy == (True,) * 8
    assert report.reason is None
    assert AscendAccelerator().default_nproc_per_node() == 8


def test_without_torch_npu_the_reason_says_it_is_not_importable_and_what_npu_smi_sees(fake_npu_smi, no_torch_npu):
    fake_npu_smi()
    report = AscendAccelerator().probe()
    assert not report.present and report.count == 0
    assert report.reason.startswith("torch_npu not importable: ModuleNotFoundError")
    assert "npu-smi sees 8 x 910B3" in report.reason
    assert "CANN" in report.reason


def test_a_torch_npu_that_fails_to_import_is_reported_not_raised(fake_npu_smi, fake_torch_npu):
    """A torch_npu built for another CANN fails on import; the probe says so."""
    fake_npu_smi()
    fake_torch_npu(import_error="libhccl.so: cannot open shared object file: No such file or directory")
    report = AscendAccelerator().probe()
    assert not report.present
    assert report.reason.startswith("torch_npu not importable: ImportError: libhccl.so")


def test_without_npu_smi_on_path_the_reason_names_it(no_npu_smi, fake_torch_npu):
    fake_torch_npu(8)
    report = AscendAccelerator().probe()
    assert not report.present
    assert report.reason == "npu-smi not on PATH"


def test_on_a_machine_without_the_stack_both_missing_pieces_are_named(no_npu_smi, no_torch_npu):
    report = AscendAccelerator().probe()
    assert report.reason == "npu-smi not on PATH; torch_npu is not installed either"


def test_npu_smi_at_a_configured_path_is_used(fake_npu_smi, fake_torch_npu, monkeypatch):
    """DLROVER_ASCEND_NPU_SMI may name the tool by path when it is not on PATH."""
    script = fake_npu_smi()
    path = [d for d in os.environ["PATH"].split(os.pathsep) if d != str(script.parent)]
    monkeypatch.setenv("PATH", os.pathsep.join(path))
    monkeypatch.setenv("DLROVER_ASCEND_NPU_SMI", str(script))
    fake_torch_npu(8)
    assert AscendAccelerator().probe().present


def test_npu_smi_that_fails_gives_its_status_and_message(fake_npu_smi, fake_torch_npu):
    """A driver that cannot initialise makes npu-smi exit non-zero with a message on stderr."""
    fake_npu_smi("", exit_code=255, stderr="dcmi module initialize failed. ret is -8005\n")
    fake_torch_npu(8)
    report = AscendAccelerator().probe()
    assert not report.present
    assert report.reason == "npu-smi exited with status 255: dcmi module initialize failed. ret is -8005"


def test_output_that_is_not_a_table_is_reported_as_not_understood(fake_npu_smi, fake_torch_npu):
    fake_npu_smi("Segmentation fault (core dumped)\n")
    fake_torch_npu(8)
    report = AscendAccelerator().probe()
    assert not report.present
    assert report.reason.startswith("npu-smi output not understood: no 'NPU Name | Health")


def test_a_hung_npu_smi_is_given_up_on_after_the_timeout(fake_npu_smi, fake_torch_npu):
    """npu-smi sleeping 60 s (a wedged driver) costs the probe only its timeout."""
    fake_npu_smi(hang=True)
    fake_torch_npu(8)
    start = time.monotonic()
    report = AscendAccelerator(tool_timeout_s=0.5).probe()
    took = time.monotonic() - start
    assert not report.present
    assert report.reason == "npu-smi timed out after 0.5 s"
    assert took < 5


def test_no_device_in_the_npu_smi_table_means_zero_visible(fake_npu_smi, fake_torch_npu, tables):
    fake_npu_smi(tables.no_devices)
    fake_torch_npu(0)
    report = AscendAccelerator().probe()
    assert not report.present and report.count == 0
    assert report.reason == "0 devices visible: npu-smi lists no device"
    assert report.driver_version == "24.1.rc2"


def test_torch_npu_counting_zero_devices_means_zero_visible(fake_npu_smi, fake_torch_npu):
    fake_npu_smi()
    fake_torch_npu(0)
    report = AscendAccelerator().probe()
    assert not report.present
    assert report.reason.startswith("0 devices visible to torch_npu")


def test_a_visible_devices_list_that_selects_nothing_means_zero_visible(fake_npu_smi, fake_torch_npu, monkeypatch):
    fake_npu_smi()
    fake_torch_npu(8)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "9")
    report = AscendAccelerator().probe()
    assert not report.present
    assert report.reason == "0 devices visible: ASCEND_RT_VISIBLE_DEVICES='9' selects none of the 8 devices npu-smi lists"


def test_one_critical_device_is_reported_unhealthy_and_logged(fake_npu_smi, fake_torch_npu, tables):
    """A node with one NPU in Critical state is present, with that device marked unhealthy."""
    fake_npu_smi(tables.with_health(tables.a2_910b3_x8, 5, "Critical"))
    fake_torch_npu(8)
    with capture_logs() as logs:
        report = AscendAccelerator().probe()
    assert report.present and report.count == 8
    assert report.healthy == (True,) * 5 + (False,) + (True,) * 2
    assert {"event": "ascend_devices_unhealthy", "log_level": "warning",
            "devices": ["npu 5 chip 0: Critical"]} in logs


def test_a_warning_counts_as_unhealthy_too(fake_npu_smi, fake_torch_npu, tables):
    fake_npu_smi(tables.with_health(tables.a2_910b3_x8, 0, "Warning"))
    fake_torch_npu(8)
    assert AscendAccelerator().probe().healthy[0] is False


def test_when_every_visible_device_is_unhealthy_nothing_usable_is_present(fake_npu_smi, fake_torch_npu, tables,
                                                                          monkeypatch):
    fake_npu_smi(tables.with_health(tables.a2_910b3_x8, 2, "Critical"))
    fake_torch_npu(8)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "2")
    report = AscendAccelerator().probe()
    assert not report.present
    assert report.reason == "all 1 visible devices are unhealthy (npu 2 chip 0: Critical)"


def test_visible_devices_subset_is_counted_and_mapped_to_its_own_health(fake_npu_smi, fake_torch_npu, tables,
                                                                        monkeypatch):
    """ASCEND_RT_VISIBLE_DEVICES=2,3,5 on an 8-NPU node: three devices, the third being NPU 5."""
    fake_npu_smi(tables.with_health(tables.a2_910b3_x8, 5, "Alarm"))
    fake_torch_npu(8)
    monkeypatch.setenv("ASCEND_RT_VISIBLE_DEVICES", "2,3,5")
    acc = AscendAccelerator()
    report = acc.probe()
    assert report.present and report.count == 3
    assert report.healthy == (True, True, False)
    assert acc.default_nproc_per_node() == 3


def test_two_chips_per_npu_count_as_two_devices(fake_npu_smi, fake_torch_npu, tables):
    """Atlas A3: 2 NPUs x 2 chips are 4 devices; NPU 1's alarm marks both of its chips."""
    fake_npu_smi(tables.a3_2x2)
    fake_torch_npu(4, name="910_9391")
    report = AscendAccelerator().probe()
    assert report.count == 4
    assert report.model == "Ascend910"
    assert report.healthy == (True, True, False, False)


def test_a_count_mismatch_gives_every_device_the_node_health(fake_npu_smi, fake_torch_npu, tables):
    """When torch_npu and npu-smi disagree on the count, chips cannot be matched to devices."""
    fake_npu_smi(tables.with_health(tables.a2_910b3_x8, 7, "Critical"))
    fake_torch_npu(4)
    with capture_logs() as logs:
        report = AscendAccelerator().probe()
    assert report.present and report.count == 4
    assert report.healthy == (False,) * 4
    assert any(e["event"] == "ascend_device_count_mismatch" for e in logs)


def test_cann_version_falls_back_to_the_toolkit_install_info(fake_npu_smi, fake_torch_npu, tmp_path, monkeypatch):
    """Before CANN 8.1.RC1 get_cann_version() returns ''; the toolkit's install info has the version."""
    fake_npu_smi()
    fake_torch_npu(8, cann="")
    toolkit = tmp_path / "ascend-toolkit" / "latest"
    (toolkit / "aarch64-linux").mkdir(parents=True)
    (toolkit / "aarch64-linux" / "ascend_toolkit_install.info").write_text(
        "package_name=Ascend-cann-toolkit\nversion=8.0.RC3\ninnerversion=V100R001C19SPC001B123\narch=aarch64\n")
    monkeypatch.setenv("ASCEND_TOOLKIT_HOME", str(toolkit))
    assert AscendAccelerator().probe().runtime_version == "8.0.RC3"


def test_without_any_cann_version_source_runtime_version_is_none(fake_npu_smi, fake_torch_npu):
    fake_npu_smi()
    fake_torch_npu(8, cann="")
    report = AscendAccelerator().probe()
    assert report.present and report.runtime_version is None
