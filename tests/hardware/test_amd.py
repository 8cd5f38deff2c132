"""AMD: amd-smi JSON in each shape it has had, and rocm-smi JSON, from recorded outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.hardware import amd
from shoal.hardware.profile import Accelerator
from shoal.protocol.telemetry import GpuSample

FIXTURES = Path(__file__).parent / "fixtures"
MIB = 1 << 20


def read(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def test_rocm_61_list_shape_with_units() -> None:
    gpus = amd.parse_amd_smi(
        read("amd_smi_static_list_rx6600.json"), read("amd_smi_metric_list_rx6600.json")
    )
    assert len(gpus) == 1
    gpu = gpus[0]
    assert gpu.index == 0
    assert gpu.name == "Navi 23 [Radeon RX 6600/6600 XT"
    assert gpu.accelerator is Accelerator.ROCM
    assert gpu.memory_total_bytes == 8176 * MIB
    assert gpu.memory_free_bytes == 7974 * MIB
    assert gpu.driver == "7.0.0-3-pve"


def test_gpu_data_wrapper_static_only() -> None:
    gpus = amd.parse_amd_smi(read("amd_smi_static_gpu_data_mi210.json"))
    assert [(g.index, g.name, g.memory_total_bytes) for g in gpus] == [
        (0, "AMD Instinct MI210", 65520 * MIB)
    ]
    assert gpus[0].memory_free_bytes is None  # no metric output given


def test_gpu_data_wrapper_metric_of_two_gpus() -> None:
    metric = read("amd_smi_metric_gpu_data_2gpu.json")
    assert amd.parse_amd_smi_memory(metric) == {
        0: (30576 * MIB, 10126 * MIB),
        1: (32624 * MIB, 32567 * MIB),
    }
    gpus = amd.parse_amd_smi("", metric)
    assert [(g.index, g.name, g.memory_total_bytes, g.memory_free_bytes) for g in gpus] == [
        (0, "AMD GPU 0", 30576 * MIB, 10126 * MIB),
        (1, "AMD GPU 1", 32624 * MIB, 32567 * MIB),
    ]


def test_rocm_60_shape_reconstructed_from_the_cli_source() -> None:
    gpus = amd.parse_amd_smi(
        read("amd_smi_static_rocm60_RECONSTRUCTED.json"),
        read("amd_smi_metric_rocm60_RECONSTRUCTED.json"),
    )
    assert [(g.index, g.memory_total_bytes, g.memory_free_bytes) for g in gpus] == [
        (0, 8176 * MIB, 7974 * MIB)
    ]


def test_single_device_object_and_a_warning_line() -> None:
    # One object instead of a list (a ``-g 0`` query), after a warning line (constructed).
    text = "WARNING: [Errno 13] Permission denied: '/dev/kfd'\n" + (
        read("amd_smi_static_list_rx6600.json").strip().removeprefix("[").removesuffix("]")
    )
    gpus = amd.parse_amd_smi(text)
    assert [(g.index, g.memory_total_bytes) for g in gpus] == [(0, 8176 * MIB)]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (8176, 8176 * MIB),
        ("8176 MB", 8176 * MIB),
        ({"value": 8176, "unit": "MB"}, 8176 * MIB),
        ({"value": 192, "unit": "GB"}, 192 << 30),
        ({"value": 512, "unit": "B"}, 512),
        ({"value": "N/A", "unit": "MB"}, None),
        ("N/A", None),
        (None, None),
        ({"value": 1, "unit": "parsecs"}, None),
        ("inf", None),
        ({"value": "nan", "unit": "MB"}, None),
    ],
)
def test_amd_units(value: object, expected: int | None) -> None:
    assert amd.amd_bytes(value) == expected


def test_rocm_smi_single_card() -> None:
    gpus = amd.parse_rocm_smi_json(read("rocm_smi_rx7900xt.json"))
    assert [(g.index, g.name) for g in gpus] == [(0, "Radeon RX 7900 XT")]
    assert gpus[0].memory_total_bytes == 21458059264
    assert gpus[0].memory_free_bytes == 21458059264 - 27856896


def test_rocm_smi_two_dies() -> None:
    gpus = amd.parse_rocm_smi_json(read("rocm_smi_mi250_2card.json"))
    assert [g.index for g in gpus] == [0, 1]
    assert {g.name for g in gpus} == {"AMD INSTINCT MI250 (MCM) OAM AC MBA"}
    assert [g.memory_total_bytes for g in gpus] == [68702699520, 68702699520]
    assert [g.memory_free_bytes for g in gpus] == [
        68702699520 - 51527024640,
        68702699520 - 11665408,
    ]


def test_rocm_smi_without_vram_keys_reports_unknown_memory() -> None:
    gpus = amd.parse_rocm_smi_json(read("rocm_smi_showallinfo_rx6600.json"))
    assert [(g.index, g.name) for g in gpus] == [(0, "Navi 23 [Radeon RX 6600/6600 XT/6600M]")]
    assert (gpus[0].memory_total_bytes, gpus[0].memory_free_bytes) == (0, None)


@pytest.mark.parametrize("text", ["", "not json", "[]", "{}", '{"gpu_data": "N/A"}', "[1, 2]"])
def test_unreadable_amd_smi_gives_no_gpus(text: str) -> None:
    assert amd.parse_amd_smi(text, text) == []
    assert amd.parse_rocm_smi_json(text) == []


# ------------------------------------------------------------------------- telemetry

S = GpuSample


@pytest.mark.parametrize(
    ("fixture", "expected"),
    [
        (  # ROCm 6.4+ gpu_data shape, every reading present: the edge sensor is the die
            "amd_smi_metric_telemetry_2gpu.json",
            (
                S(index=0, utilization_percent=91, memory_used_bytes=20450 * MIB,
                  memory_total_bytes=30576 * MIB, temperature_celsius=54, power_watts=12.3),
                S(index=1, utilization_percent=1, memory_used_bytes=57 * MIB,
                  memory_total_bytes=32624 * MIB, temperature_celsius=31, power_watts=23.4),
            ),
        ),
        (  # MI300X: edge "N/A", so the hotspot; no mem_usage asked for in that capture
            "amd_smi_metric_mi300x.json",
            (S(index=0, utilization_percent=0, temperature_celsius=45, power_watts=158),),
        ),
        (  # ROCm 6.1 list shape, usage and memory only
            "amd_smi_metric_list_rx6600.json",
            (S(index=0, utilization_percent=1, memory_used_bytes=202 * MIB,
               memory_total_bytes=8176 * MIB),),
        ),
        (  # ROCm 6.0: bare MB integers
            "amd_smi_metric_rocm60_RECONSTRUCTED.json",
            (S(index=0, memory_used_bytes=202 * MIB, memory_total_bytes=8176 * MIB),),
        ),
    ],
)  # fmt: skip
def test_amd_smi_telemetry(fixture: str, expected: tuple[GpuSample, ...]) -> None:
    assert amd.parse_amd_smi_telemetry(read(fixture)) == expected


@pytest.mark.parametrize(
    ("fixture", "expected"),
    [
        (  # MI300X: current socket power, 750 W cap, junction temperature only
            "rocm_smi_mi300x.json",
            (S(index=0, utilization_percent=0, memory_used_bytes=299687936,
               memory_total_bytes=205822885888, temperature_celsius=45, power_watts=159,
               power_limit_watts=750),),
        ),
        (  # MI250, -a: edge sensor, average power, no VRAM keys
            "rocm_smi_showallinfo_mi250.json",
            (S(index=0, uuid="0x719d230578348e8c", name="AMD INSTINCT MI250 (MCM) OAM AC MBA",
               utilization_percent=0, temperature_celsius=32, power_watts=89,
               power_limit_watts=560),),
        ),
        (  # two MI250 dies: the secondary die's power is "N/A (Secondary die)"
            "rocm_smi_mi250_2card.json",
            (
                S(index=0, name="AMD INSTINCT MI250 (MCM) OAM AC MBA", utilization_percent=50,
                  memory_used_bytes=51527024640, memory_total_bytes=68702699520,
                  power_watts=102),
                S(index=1, name="AMD INSTINCT MI250 (MCM) OAM AC MBA", utilization_percent=0,
                  memory_used_bytes=11665408, memory_total_bytes=68702699520),
            ),
        ),
        (  # no readings asked for at all: the card is there, every reading None
            "rocm_smi_showallinfo_rx6600.json",
            (S(index=0, uuid="", name="Navi 23 [Radeon RX 6600/6600 XT/6600M]",
               utilization_percent=0),),
        ),
    ],
)  # fmt: skip
def test_rocm_smi_telemetry(fixture: str, expected: tuple[GpuSample, ...]) -> None:
    assert amd.parse_rocm_smi_telemetry(read(fixture)) == expected


@pytest.mark.parametrize("text", ["", "not json", "[1, 2]", '{"gpu_data": "N/A"}', "{}"])
def test_unreadable_telemetry_is_empty(text: str) -> None:
    assert amd.parse_amd_smi_telemetry(text) == ()
    assert amd.parse_rocm_smi_telemetry(text) == ()


def test_amd_smi_warning_lines_and_odd_values_are_skipped() -> None:
    text = (
        "WARNING: User is missing the following required groups: render, video\n"
        '[{"gpu": 0, "usage": {"gfx_activity": "37 %"}, "power": {"socket_power": "N/A"},'
        ' "temperature": {"edge": {"value": "nan"}, "hotspot": true},'
        ' "mem_usage": {"total_vram": {"value": 100, "unit": "MB"},'
        ' "free_vram": {"value": 25, "unit": "MB"}}}]'
    )
    [sample] = amd.parse_amd_smi_telemetry(text)
    assert sample == S(
        index=0,
        utilization_percent=37,
        memory_used_bytes=75 * MIB,  # total - free when used is not given
        memory_total_bytes=100 * MIB,
    )
