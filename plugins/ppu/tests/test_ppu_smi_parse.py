"""Parsing ppu-smi's selective-query CSV and mapping visible-device lists onto its rows."""

from __future__ import annotations

import pytest

from dlrover_plugin_ppu._smi import SmiDevice, SmiOutputError, parse_devices, parse_remapped_rows, select_visible


def device(index: int, uuid: str) -> SmiDevice:
    return SmiDevice(index=index, uuid=uuid, name="PPU-ZW810E", memory_mb=98304)


def test_devices_are_read_with_or_without_spaces_after_commas():
    """The manual's examples put a space after each comma; the Telegraf test data does not."""
    out = ("0,GPU-a,PPU-ZW810E,98304,Default,1.3.2-d7f5a2\n"
           "1, GPU-b, PPU-ZW810E, 98304, Exclusive_Process, 1.3.2-d7f5a2\n")
    assert parse_devices(out) == [
        SmiDevice(index=0, uuid="GPU-a", name="PPU-ZW810E", memory_mb=98304, compute_mode="Default",
                  driver_version="1.3.2-d7f5a2"),
        SmiDevice(index=1, uuid="GPU-b", name="PPU-ZW810E", memory_mb=98304, compute_mode="Exclusive_Process",
                  driver_version="1.3.2-d7f5a2"),
    ]


def test_na_values_are_unknown_and_a_unit_left_in_is_tolerated():
    (d,) = parse_devices("3, PPU-0cdd, alixpu, 40960 MiB, N/A, [Not Supported]\n\n")
    assert (d.index, d.memory_mb, d.compute_mode, d.driver_version) == (3, 40960, None, None)


@pytest.mark.parametrize("line,message", [
    ("0, GPU-a, PPU-ZW810E, 98304, Default\n", "--query-ppu line 1 has 5 fields, expected 6"),
    ("x, GPU-a, PPU-ZW810E, 98304, Default, 1\n", "index 'x' is not a number"),
    ("0, GPU-a, PPU-ZW810E, 96 GiB, Default, 1\n", "memory.total '96 GiB' of device 0 is not MiB"),
    ("0, N/A, PPU-ZW810E, 98304, Default, 1\n", "device 0 has no uuid or name"),
])
def test_what_is_not_the_queried_csv_is_rejected(line, message):
    with pytest.raises(SmiOutputError, match=message):
        parse_devices(line)


def test_remapped_row_flags_are_matched_by_uuid():
    devices = [device(0, "GPU-a"), device(1, "GPU-b"), device(2, "GPU-c")]
    out = "GPU-b, Yes, No\nGPU-a, false, 1\nGPU-c, N/A, [Not Supported]\n"
    flags = [(d.remap_pending, d.remap_failed) for d in parse_remapped_rows(out, devices)]
    assert flags == [(False, True), (True, False), (None, None)]


def test_unknown_flags_leave_a_device_healthy():
    (d,) = parse_remapped_rows("GPU-a, maybe, N/A\n", [device(0, "GPU-a")])
    assert d.healthy and d.problems == ()


def test_problems_are_said_in_words():
    d = SmiDevice(index=0, uuid="u", name="n", compute_mode="Prohibited", remap_pending=True, remap_failed=True)
    assert d.problems == ("compute mode is Prohibited (no context can be created)",
                          "a memory row remap has failed", "a memory row remap is pending a device reset")


@pytest.mark.parametrize("visible,expected", [
    (None, [0, 1, 2, 3]),       # unset: all
    ("", []),                   # empty: none
    ("2,0", [2, 0]),            # in the order given
    ("1,7,2", [1]),             # an invalid index ends the list
    ("GPU-c", [2]),             # a UUID
    ("GPU-d1", [3]),            # a UUID prefix
])
def test_visible_devices_follow_cuda_visible_devices_rules(visible, expected):
    devices = [device(0, "GPU-a0"), device(1, "GPU-b1"), device(2, "GPU-c2"), device(3, "GPU-d1")]
    chosen = select_visible(devices, visible)
    assert [d.index for d in chosen] == expected


def test_a_visible_entry_matching_no_single_device_is_unknown():
    devices = [device(0, "GPU-a0"), device(1, "GPU-a1")]
    assert select_visible(devices, "MIG-79c6") is None
    assert select_visible(devices, "GPU-a") is None  # ambiguous prefix
