"""split_args, tensor_split and parse_gpu_devices: pure decisions, tested with tables."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.hardware import amd, vulkan
from shoal.hardware.detect import (
    device_env,
    gpu_labels,
    parse_gpu_devices,
    split_args,
    tensor_split,
)
from shoal.hardware.profile import Accelerator, CpuInfo, GpuDevice, MachineProfile

FIXTURES = Path(__file__).parent / "fixtures"
GIB = 1 << 30


def gpu(
    index: int, free_gib: float | None, accelerator: Accelerator = Accelerator.CUDA
) -> GpuDevice:
    free = None if free_gib is None else int(free_gib * GIB)
    return GpuDevice(index, f"GPU {index}", accelerator, 24 * GIB, free)


def test_two_cuda_gpus_split_by_free_memory() -> None:
    assert split_args([gpu(0, 24), gpu(1, 8)]) == (
        "--device", "CUDA0,CUDA1", "--split-mode", "layer", "--tensor-split", "3,1",
    )  # fmt: skip


def test_the_order_given_is_the_order_used() -> None:
    assert split_args([gpu(1, 8), gpu(0, 24)], "row") == (
        "--device", "CUDA1,CUDA0", "--split-mode", "row", "--tensor-split", "1,3",
    )  # fmt: skip


def test_one_gpu_needs_no_split() -> None:
    assert split_args([gpu(1, 10)]) == (
        "--device", "CUDA1", "--split-mode", "none", "--main-gpu", "0",
    )  # fmt: skip


def test_split_mode_none_uses_the_first_device() -> None:
    assert split_args([gpu(0, 10), gpu(1, 10)], "none") == (
        "--device", "CUDA0,CUDA1", "--split-mode", "none", "--main-gpu", "0",
    )  # fmt: skip


def test_rocm_names_and_ratios_from_recorded_free_memory() -> None:
    gpus = amd.parse_rocm_smi_json((FIXTURES / "rocm_smi_mi250_2card.json").read_text())
    # free: 16380 MiB and 65508.875 MiB -> whole MiB 16380 = 12 * 1365 and 65508 = 12 * 5459.
    assert split_args(gpus) == (
        "--device", "ROCm0,ROCm1", "--split-mode", "layer", "--tensor-split", "1365,5459",
    )  # fmt: skip


def test_vulkan_device_names_follow_llama_cpp_numbering() -> None:
    gpus = [gpu(0, 12, Accelerator.VULKAN), gpu(1, 4, Accelerator.VULKAN)]
    assert split_args(gpus)[:2] == ("--device", "Vulkan0,Vulkan1")
    recorded = vulkan.vulkan_gpus(
        (FIXTURES / "vulkaninfo_summary_rtx4080_llvmpipe.txt").read_text()
    )
    assert split_args(recorded)[:2] == ("--device", "Vulkan0")


def test_metal() -> None:
    mac = GpuDevice(0, "Apple M3 Max", Accelerator.METAL, 24 * GIB, 20 * GIB, unified_memory=True)
    assert split_args([mac]) == ("--device", "MTL0", "--split-mode", "none", "--main-gpu", "0")


def test_unknown_memory_splits_evenly() -> None:
    unknown = GpuDevice(1, "GPU 1", Accelerator.VULKAN, 0, None)
    assert tensor_split([gpu(0, 16, Accelerator.VULKAN), unknown]) == (1, 1)


def test_no_gpus_means_no_offload() -> None:
    assert split_args([]) == ("--device", "none")


@pytest.mark.parametrize(
    ("gpus", "mode", "message"),
    [
        ([gpu(0, 8)], "tensor", "split mode 'tensor' is not one of none, layer, row"),
        ([gpu(0, 8), gpu(0, 8)], "layer", "listed twice"),
        ([gpu(0, 8, Accelerator.CPU)], "layer", "not a GPU backend"),
    ],
)
def test_invalid_requests(gpus: list[GpuDevice], mode: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        split_args(gpus, mode)


@given(st.lists(st.integers(min_value=1, max_value=200_000), min_size=2, max_size=8))
def test_tensor_split_is_proportional_and_reduced(free_mib: list[int]) -> None:
    gpus = [
        GpuDevice(i, f"GPU {i}", Accelerator.CUDA, m << 20, m << 20) for i, m in enumerate(free_mib)
    ]
    ratios = tensor_split(gpus)
    assert len(ratios) == len(free_mib)
    for i in range(len(free_mib)):
        for j in range(len(free_mib)):
            assert ratios[i] * free_mib[j] == ratios[j] * free_mib[i]
    assert min(ratios) >= 1


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0,1", (0, 1)),
        (" 2 , 0 ", (2, 0)),
        ("3", (3,)),
        ("10,11,12", (10, 11, 12)),
        ("none", ()),
        (" None ", ()),
    ],
)
def test_parse_gpu_devices(text: str, expected: tuple[int, ...]) -> None:
    assert parse_gpu_devices(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "--gpu-devices is empty"),
        ("  ", "--gpu-devices is empty"),
        ("0,,1", "'' is not a GPU index"),
        ("a", "'a' is not a GPU index"),
        ("-1", "'-1' is not a GPU index"),
        ("1.5", "'1.5' is not a GPU index"),
        ("0,1,0", "GPU 0 is listed twice"),
        ("none,0", "'none' is not a GPU index"),
    ],
)
def test_parse_gpu_devices_errors_say_what_to_write(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as info:
        parse_gpu_devices(text)
    assert "such as 0,1" in str(info.value) and "none for the CPU only" in str(info.value)


def test_no_gpus_selected_runs_llama_server_on_the_cpu() -> None:
    assert split_args(()) == ("--device", "none") and device_env(()) == {}


def test_cuda_needs_pci_bus_order() -> None:
    assert device_env([gpu(0, 8)]) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    assert device_env([gpu(0, 8, Accelerator.ROCM)]) == {}


def test_gpu_labels() -> None:
    cpu = CpuInfo("test CPU", 4)
    unknown = GpuDevice(1, "Radeon", Accelerator.ROCM, 0, None)
    total_only = GpuDevice(2, "Arc", Accelerator.VULKAN, 8 * GIB, None)
    profile = MachineProfile("h", "Linux", cpu, 1, 1, (gpu(0, 20), unknown, total_only))
    assert gpu_labels(profile) == (
        "CUDA0 GPU 0 (20.0 of 24.0 GiB free)",
        "ROCm1 Radeon (memory unknown)",
        "Vulkan2 Arc (8.0 GiB)",
    )
