"""AMD: amd-smi JSON in each shape it has had, and rocm-smi JSON, from recorded outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.hardware import amd
from shoal.hardware.profile import Accelerator

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
