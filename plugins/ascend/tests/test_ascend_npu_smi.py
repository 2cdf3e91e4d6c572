"""Reading ``npu-smi info`` tables and ``ASCEND_RT_VISIBLE_DEVICES`` (pure functions)."""

from __future__ import annotations

import pytest

from dlrover_plugin_ascend import NpuChip, parse_npu_smi_info, visible_device_ids


def test_a2_table_gives_one_device_per_npu_with_hbm_size_health_and_driver(tables):
    """An Atlas A2 table: eight 910B3 NPUs of one chip each, 65536 MB of HBM, driver from 'Version:'."""
    info = parse_npu_smi_info(tables.a2_910b3_x8)
    assert info.driver_version == "24.1.rc2"
    assert info.tool_version == "24.1.rc2"
    assert [(c.npu_id, c.chip_id) for c in info.chips] == [(i, 0) for i in range(8)]
    assert info.chips[0] == NpuChip(npu_id=0, chip_id=0, name="910B3", health="OK", bus_id="0000:C1:00.0",
                                    memory_mb=65536)
    assert all(c.healthy for c in info.chips)


def test_two_chips_per_npu_are_two_devices_and_share_the_npu_health(tables):
    """Atlas A3 cards list two chip rows under one NPU row; each chip is a device."""
    info = parse_npu_smi_info(tables.a3_2x2)
    assert [(c.npu_id, c.chip_id, c.name) for c in info.chips] == [
        (0, 0, "Ascend910"), (0, 1, "Ascend910"), (1, 0, "Ascend910"), (1, 1, "Ascend910")]
    assert [c.health for c in info.chips] == ["OK", "OK", "Alarm", "Alarm"]
    assert [c.healthy for c in info.chips] == [True, True, False, False]


def test_npu_row_repeated_for_each_chip_is_read_the_same_way(tables):
    """Some npu-smi releases repeat the NPU row before each chip row, in separate blocks."""
    lines = tables.a3_2x2.splitlines()
    # split NPU 0's block in two: NPU row, chip 0, separator, NPU row again, chip 1
    npu_row = lines[6]
    repeated = "\n".join(lines[:8] + [lines[5], npu_row] + lines[8:]) + "\n"
    info = parse_npu_smi_info(repeated)
    assert [(c.npu_id, c.chip_id) for c in info.chips] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_inference_card_without_hbm_column_reports_its_memory_usage_total(tables):
    """A 310P3 Duo card: two chips, memory from the Memory-Usage(MB) total."""
    info = parse_npu_smi_info(tables.duo_310p3)
    assert [(c.npu_id, c.chip_id, c.memory_mb) for c in info.chips] == [(8, 0, 44280), (8, 1, 43693)]
    assert info.driver_version == "23.0.0"


@pytest.mark.parametrize("health,healthy", [("OK", True), ("Warning", False), ("Alarm", False),
                                            ("Critical", False), ("UNKNOWN", False)])
def test_only_ok_counts_as_healthy(tables, health, healthy):
    """npu-smi's Health levels: OK, Warning, Alarm, Critical, UNKNOWN; only OK is healthy."""
    info = parse_npu_smi_info(tables.with_health(tables.a2_910b3_x8, 3, health))
    assert info.chips[3].health == health
    assert info.chips[3].healthy is healthy
    assert sum(not c.healthy for c in info.chips) == (0 if healthy else 1)


def test_table_without_npu_blocks_lists_no_device(tables):
    assert parse_npu_smi_info(tables.no_devices).chips == ()


@pytest.mark.parametrize("text,why", [
    ("", "no 'NPU Name | Health"),
    ("dcmi module initialize failed. ret is -8005\n", "no 'NPU Name | Health"),
    ("| NPU   Name | Health | Power(W) |\n| something else |\n", "Chip | Bus-Id"),
])
def test_text_that_is_not_an_npu_smi_table_is_refused_with_what_was_missing(text, why):
    with pytest.raises(ValueError, match=why.replace("|", r"\|")):
        parse_npu_smi_info(text)


def test_a_garbled_device_row_is_refused(tables):
    garbled = tables.a2_910b3_x8.replace("| 0                         | 0000:C1:00.0  |", "| ?? | 0000:C1:00.0  |")
    with pytest.raises(ValueError, match="does not start with an id"):
        parse_npu_smi_info(garbled)


def test_an_npu_without_chip_row_is_refused(tables):
    lines = tables.a2_910b3_x8.splitlines()
    del lines[7]  # NPU 0's chip row
    with pytest.raises(ValueError, match="NPU 0 has no chip row"):
        parse_npu_smi_info("\n".join(lines))


@pytest.mark.parametrize("value,total,ids", [
    (None, 4, [0, 1, 2, 3]),  # unset: every device
    ("", 4, []),
    ("1", 8, [1]),
    ("1,2,3", 8, [1, 2, 3]),
    ("1, 2,3", 8, [1]),  # CANN stops at the first entry that is not a plain number
    ("1,3,8", 8, [1, 3]),  # ... or not a valid id
    ("3,1", 8, [3]),  # only ascending ids are supported
    ("0,abc", 8, [0]),
])
def test_visible_devices_are_read_as_cann_documents(value, total, ids):
    assert visible_device_ids(value, total) == ids
