"""The worker's use of the detected hardware: wire form, --gpu-devices, llama-server devices."""

from __future__ import annotations

import re

import pytest

from shoal.hardware.profile import Accelerator, CpuInfo, GpuDevice, MachineProfile
from shoal.llama_cpp.devices import ComputeDevice
from shoal.worker.hardware import (
    HardwareError,
    device_args,
    device_environment,
    device_names,
    stage_memory,
    to_wire,
)

GIB = 1 << 30

TWO_CUDA = MachineProfile(
    hostname="rig",
    os="Linux",
    cpu=CpuInfo(model="EPYC", logical_cores=16, features=("avx2",)),
    ram_total_bytes=64 * GIB,
    ram_available_bytes=60 * GIB,
    gpus=(
        GpuDevice(0, "RTX 4090", Accelerator.CUDA, 24 * GIB, 24 * GIB),
        GpuDevice(1, "RTX 3060", Accelerator.CUDA, 12 * GIB, 8 * GIB),
    ),
)


def test_wire_form_carries_gpus_and_their_free_memory() -> None:
    wire = to_wire(TWO_CUDA)
    assert wire.accelerator == "cuda" and wire.cpu_model == "EPYC"
    assert [(g.index, g.name, g.memory_free_bytes) for g in wire.gpus] == [
        (0, "RTX 4090", 24 * GIB),
        (1, "RTX 3060", 8 * GIB),
    ]


def test_gpu_devices_select_and_split_by_free_memory() -> None:
    args = device_args(TWO_CUDA, "0,1", "layer")
    assert args[args.index("--device") + 1] == "CUDA0,CUDA1"
    assert args[args.index("--split-mode") + 1] == "layer"
    assert args[args.index("--tensor-split") + 1] == "3,1"  # 24 GiB : 8 GiB free
    assert device_environment(TWO_CUDA, "0,1") == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    one = device_args(TWO_CUDA, "1", "layer")
    assert one[one.index("--device") + 1] == "CUDA1" and "--tensor-split" not in one


def test_no_flag_leaves_devices_to_llama_cpp() -> None:
    assert device_args(TWO_CUDA, None, "layer") == ()
    assert device_environment(TWO_CUDA, None) == {}


@pytest.mark.parametrize(
    ("value", "message"),
    [("2", "GPU device(s) 2 not found; this machine has: 0, 1"), ("a", "not a GPU index")],
)
def test_bad_gpu_devices_are_clear(value: str, message: str) -> None:
    with pytest.raises(HardwareError, match=re.escape(message)) as caught:
        device_args(TWO_CUDA, value, "layer")
    assert str(caught.value).count("--gpu-devices") == 1


LISTED = (
    ComputeDevice("CUDA0", "RTX 4090", 24 * GIB, 23 * GIB),
    ComputeDevice("CUDA1", "RTX 3060", 12 * GIB, 7 * GIB),
)


def test_a_stage_offers_its_gpus_free_memory_or_none_on_the_cpu() -> None:
    assert stage_memory(TWO_CUDA, None, ()) is None  # a CPU build: the router uses RAM
    assert stage_memory(TWO_CUDA, None, LISTED) == 32 * GIB  # fresh from the vendor tool
    assert stage_memory(TWO_CUDA, "1", LISTED[1:]) == 8 * GIB
    no_tool = MachineProfile("rig", "Linux", TWO_CUDA.cpu, 64 * GIB, 60 * GIB)
    assert stage_memory(no_tool, None, LISTED) == 30 * GIB  # as llama.cpp listed it
    assert device_names(TWO_CUDA, "1,0") == ("CUDA1", "CUDA0")
    assert device_names(TWO_CUDA, None) is None
