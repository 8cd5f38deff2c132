"""Apple Silicon: system_profiler JSON plus sysctl values, both recorded on M3 Max machines."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.hardware import apple, cpu
from shoal.hardware.profile import Accelerator

FIXTURES = Path(__file__).parent / "fixtures"
GIB = 1 << 30


def read(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def m3_sysctl() -> dict[str, str]:
    return cpu.parse_sysctl(read("sysctl_darwin_m3max.txt"))


def test_sysctl_values() -> None:
    values = m3_sysctl()
    assert values["hw.memsize"] == "38654705664"
    assert values["hw.optional.arm64"] == "1"
    assert values["machdep.cpu.brand_string"] == "Apple M3 Max"


def test_the_m3_max_is_one_unified_metal_gpu() -> None:
    gpus = apple.parse_apple_gpu(read("system_profiler_displays_m3max.json"), m3_sysctl(), 20 * GIB)
    assert len(gpus) == 1
    gpu = gpus[0]
    assert gpu.index == 0
    assert gpu.name == "Apple M3 Max (40-core GPU)"
    assert gpu.accelerator is Accelerator.METAL
    assert gpu.unified_memory
    assert gpu.memory_total_bytes == 24 * GIB  # 2/3 of 36 GiB
    assert gpu.memory_free_bytes == 20 * GIB  # capped by available RAM


def test_a_raised_wired_limit_is_the_budget() -> None:
    values = {**m3_sysctl(), "iogpu.wired_limit_mb": "32768"}
    gpus = apple.parse_apple_gpu(read("system_profiler_displays_m3max.json"), values)
    assert gpus[0].memory_total_bytes == 32 * GIB
    assert gpus[0].memory_free_bytes is None  # available RAM not given


@pytest.mark.parametrize(
    ("memsize", "wired_mb", "expected"),
    [
        (16 * GIB, 0, 16 * GIB * 2 // 3),
        (36 * GIB, 0, 24 * GIB),
        (64 * GIB, 0, 48 * GIB),
        (128 * GIB, 0, 96 * GIB),
        (128 * GIB, 114688, 112 * GIB),
        (16 * GIB, 65536, 16 * GIB),  # a limit above RAM cannot give more than RAM
    ],
)
def test_metal_working_set(memsize: int, wired_mb: int, expected: int) -> None:
    assert apple.metal_working_set(memsize, wired_mb) == expected


def test_intel_macs_are_not_apple_silicon() -> None:
    intel = cpu.parse_sysctl(read("sysctl_darwin_intel_skylake.txt"))
    assert apple.parse_apple_gpu(read("system_profiler_displays_m3max.json"), intel) == []


@pytest.mark.parametrize("text", ["", "not json", "[]", "{}", '{"SPDisplaysDataType": []}'])
def test_unreadable_system_profiler_gives_no_gpu(text: str) -> None:
    assert apple.parse_apple_gpu(text, m3_sysctl()) == []
