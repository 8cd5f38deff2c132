"""CPU model and llama.cpp-relevant instruction sets from recorded /proc/cpuinfo and sysctl."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.hardware import cpu

FIXTURES = Path(__file__).parent / "fixtures"


def read(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


@pytest.mark.parametrize(
    ("fixture", "model", "features"),
    [
        (
            "cpuinfo_x86_sapphirerapids.txt",
            "Intel(R) Xeon(R) Platinum 8480+",
            (
                "sse3", "ssse3", "avx", "avx2", "f16c", "fma", "avx_vnni", "avx512f",
                "avx512bw", "avx512vbmi", "avx512vnni", "avx512bf16",
                "amx_tile", "amx_int8", "amx_bf16",
            ),
        ),
        (
            "cpuinfo_x86_zen3.txt",
            "AMD Ryzen 9 5950X 16-Core Processor",
            ("sse3", "ssse3", "avx", "avx2", "f16c", "fma"),
        ),
        (
            "cpuinfo_aarch64_neoverse_v2.txt",
            "ARM CPU part 0xd4f",
            ("neon", "fp16", "dotprod", "i8mm", "bf16", "sve", "sve2"),
        ),
        (
            "cpuinfo_aarch64_asahi_m1.txt",
            "Apple CPU part 0x022",
            ("neon", "fp16", "dotprod"),
        ),
    ],
)  # fmt: skip
def test_proc_cpuinfo(fixture: str, model: str, features: tuple[str, ...]) -> None:
    assert cpu.parse_proc_cpuinfo(read(fixture)) == (model, features)


def test_darwin_apple_silicon() -> None:
    values = cpu.parse_sysctl(read("sysctl_darwin_m3max.txt"))
    assert cpu.parse_darwin_cpu(values) == (
        "Apple M3 Max",
        ("neon", "fp16", "dotprod", "i8mm", "bf16"),
    )


def test_darwin_intel() -> None:
    values = cpu.parse_sysctl(read("sysctl_darwin_intel_skylake.txt"))
    assert cpu.parse_darwin_cpu(values) == (
        "Intel(R) Core(TM) i7-6700K CPU @ 4.00GHz",
        ("sse3", "ssse3", "avx", "avx2", "f16c", "fma"),
    )


def test_only_known_features_in_a_fixed_order() -> None:
    assert cpu.ordered_features(["avx2", "sse3", "made-up", "avx2"]) == ("sse3", "avx2")


@pytest.mark.parametrize("text", ["", "\n\n", "garbage without colons"])
def test_unreadable_text_gives_nothing(text: str) -> None:
    assert cpu.parse_proc_cpuinfo(text) == ("", ())
    assert cpu.parse_darwin_cpu(cpu.parse_sysctl(text)) == ("", ())
