"""Vulkan: vulkaninfo --summary devices and the full output's memory heaps, from recordings."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.hardware import vulkan
from shoal.hardware.profile import Accelerator

FIXTURES = Path(__file__).parent / "fixtures"


def read(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def test_summary_lists_every_device_with_its_type() -> None:
    devices = vulkan.parse_vulkaninfo_summary(read("vulkaninfo_summary_rtx4080_llvmpipe.txt"))
    assert [(d.number, d.name, d.device_type, d.driver, d.api_version) for d in devices] == [
        (0, "NVIDIA GeForce RTX 4080", "PHYSICAL_DEVICE_TYPE_DISCRETE_GPU", "NVIDIA", "1.3.289"),
        (
            1,
            "llvmpipe (LLVM 19.1.0, 256 bits)",
            "PHYSICAL_DEVICE_TYPE_CPU",
            "llvmpipe",
            "1.3.289",
        ),
    ]
    assert devices[0].uuid == "3d28c8d2-dcc3-dcb6-1da6-5a521f0bcd6d"
    assert [d.is_gpu for d in devices] == [True, False]


def test_discrete_gpu_kept_and_llvmpipe_skipped() -> None:
    gpus = vulkan.vulkan_gpus(read("vulkaninfo_summary_rtx4080_llvmpipe.txt"))
    assert len(gpus) == 1
    gpu = gpus[0]
    assert (gpu.index, gpu.name, gpu.accelerator) == (
        0,
        "NVIDIA GeForce RTX 4080",
        Accelerator.VULKAN,
    )
    assert (gpu.memory_total_bytes, gpu.memory_free_bytes) == (0, None)  # summary only
    assert gpu.driver == "NVIDIA"


def test_integrated_gpu_is_a_gpu() -> None:
    gpus = vulkan.vulkan_gpus(read("vulkaninfo_summary_venus_m2_llvmpipe.txt"))
    assert [(g.index, g.name, g.driver) for g in gpus] == [
        (0, "Virtio-GPU Venus (Apple M2)", "venus")
    ]


def test_full_output_of_a_cpu_only_machine() -> None:
    full = read("vulkaninfo_full_llvmpipe_rpi.txt")
    devices = vulkan.parse_vulkaninfo_summary(full)
    assert [(d.number, d.device_type, d.api_version) for d in devices] == [
        (0, "PHYSICAL_DEVICE_TYPE_CPU", "1.0.2")
    ]
    assert vulkan.parse_vulkaninfo_heaps(full) == {
        0: [vulkan.MemoryHeap(size=2147483648, device_local=True, budget=0, usage=0)]
    }
    assert vulkan.vulkan_gpus(full, full) == []


def test_memory_heaps_of_an_rx580() -> None:
    heaps = vulkan.parse_memory_heaps(read("vulkaninfo_memory_heaps_rx580.txt"))
    assert heaps == [
        vulkan.MemoryHeap(8321499136, True, 8310034432, 0),
        vulkan.MemoryHeap(4133625856, False, 4124254208, 0),
        vulkan.MemoryHeap(268435456, True, 256970752, 0),
    ]
    # Like llama.cpp: device-local heaps only, free = budget - usage.
    assert vulkan.device_memory(heaps, integrated=False) == (
        8321499136 + 268435456,
        8310034432 + 256970752,
    )
    # An integrated GPU counts every heap.
    assert vulkan.device_memory(heaps, integrated=True)[0] == 8321499136 + 4133625856 + 268435456


def test_heaps_without_a_budget_leave_free_unknown() -> None:
    heaps = [vulkan.MemoryHeap(size=2147483648, device_local=True, budget=0, usage=0)]
    assert vulkan.device_memory(heaps, integrated=False) == (2147483648, None)
    assert vulkan.device_memory([], integrated=False) == (0, None)


def test_summary_and_heaps_are_joined_by_device_number() -> None:
    # The recorded RX580 heap section placed under the GPU0 of a recorded summary.
    full = "GPU0:\n" + read("vulkaninfo_memory_heaps_rx580.txt")
    gpus = vulkan.vulkan_gpus(read("vulkaninfo_summary_rtx4080_llvmpipe.txt"), full)
    assert [(g.memory_total_bytes, g.memory_free_bytes) for g in gpus] == [
        (8321499136 + 268435456, 8310034432 + 256970752)
    ]


def test_one_gpu_seen_through_two_drivers_counts_once() -> None:
    summary = read("vulkaninfo_summary_venus_m2_llvmpipe.txt")
    gpu0 = summary[summary.index("GPU0:") : summary.index("GPU1:")]
    doubled = summary + gpu0.replace("GPU0:", "GPU2:")  # same deviceUUID again
    assert len(vulkan.parse_vulkaninfo_summary(doubled)) == 3
    assert [g.index for g in vulkan.vulkan_gpus(doubled)] == [0]


@pytest.mark.parametrize(
    "text", ["", "Cannot create Vulkan instance.\n", "GPU0:\n\tgarbage\n", "Devices:\n========\n"]
)
def test_unreadable_vulkaninfo_gives_no_gpus(text: str) -> None:
    assert vulkan.parse_vulkaninfo_summary(text) == []
    assert vulkan.vulkan_gpus(text, text) == []
