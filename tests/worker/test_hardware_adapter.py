"""The worker's use of the detected hardware: wire form, --gpu-devices, llama-server devices,
and what its heartbeats read."""

from __future__ import annotations

import re

import pytest

from fakes.fake_pynvml.pynvml import FakeGpu, FakeNvml
from shoal.hardware import detect
from shoal.hardware.profile import Accelerator, CpuInfo, GpuDevice, MachineProfile
from shoal.hardware.telemetry import NO_GPUS, sampler_for
from shoal.llama_cpp.devices import ComputeDevice
from shoal.worker.hardware import (
    HardwareError,
    MemoryProbe,
    device_args,
    device_environment,
    device_names,
    shard_devices,
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


def test_each_gpu_is_reported_by_llama_cpps_name_with_its_free_memory() -> None:
    assert shard_devices(TWO_CUDA, None, ()) == ()  # a CPU build
    fresh = shard_devices(TWO_CUDA, None, LISTED)  # the vendor tool's figures, by name
    assert [(d.name, d.free_bytes) for d in fresh] == [("CUDA0", 24 * GIB), ("CUDA1", 8 * GIB)]
    assert [d.name for d in shard_devices(TWO_CUDA, "1", LISTED[1:])] == ["CUDA1"]
    no_tool = MachineProfile("rig", "Linux", TWO_CUDA.cpu, 64 * GIB, 60 * GIB)
    listed = shard_devices(no_tool, None, LISTED)  # as llama.cpp listed them
    assert [(d.name, d.free_bytes) for d in listed] == [("CUDA0", 23 * GIB), ("CUDA1", 7 * GIB)]
    mac = MachineProfile(
        "mac",
        "Darwin",
        TWO_CUDA.cpu,
        64 * GIB,
        40 * GIB,
        gpus=(GpuDevice(0, "M2 Max", Accelerator.METAL, 48 * GIB, 40 * GIB, unified_memory=True),),
    )
    [mtl] = shard_devices(mac, None, (ComputeDevice("MTL0", "Apple M2 Max", 48 * GIB, 30 * GIB),))
    assert (mtl.name, mtl.free_bytes, mtl.unified_memory) == ("MTL0", 40 * GIB, True)


# ------------------------------------------------------------------ heartbeats' readings


async def test_a_reading_carries_telemetry_and_takes_free_memory_from_it() -> None:
    """The GPUs' telemetry (NVML: a FAKE, there is no NVIDIA GPU here) is read once per
    heartbeat and its memory figures are the free memory the heartbeat reports."""
    fake = FakeNvml(
        [
            FakeGpu("NVIDIA RTX 4090", "GPU-a", 24 * GIB, 20 * GIB, 97, 71, 430_000, 450_000),
            FakeGpu("NVIDIA RTX 3060", "GPU-b", 12 * GIB, 1 * GIB, 3, 40, 20_000, 170_000),
        ]
    )
    loads: list[int] = []

    def load() -> FakeNvml:
        loads.append(1)
        return fake

    probe = MemoryProbe(TWO_CUDA, sampler=sampler_for(TWO_CUDA.gpus, load_nvml=load))
    for _ in range(2):
        reading = await probe.read()
        assert reading.gpu_free_bytes == (4 * GIB, 11 * GIB)  # not the profile's 24 and 8
        assert [(g.index, g.name, g.utilization_percent, g.power_watts) for g in reading.gpus] == [
            (0, "NVIDIA RTX 4090", 97, 430.0),
            (1, "NVIDIA RTX 3060", 3, 20.0),
        ]
        assert reading.ram_available_bytes > 0
    assert [g.memory_free_bytes for g in probe.profile.gpus] == [4 * GIB, 11 * GIB]
    assert loads == [1]  # NVML initialised once for the life of the probe


async def test_a_machine_without_gpus_reads_no_telemetry() -> None:
    cpu_only = MachineProfile("box", "Linux", TWO_CUDA.cpu, 8 * GIB, 4 * GIB)
    probe = MemoryProbe(cpu_only)
    assert probe.sampler is NO_GPUS
    reading = await probe.read()
    assert (reading.gpus, reading.gpu_free_bytes) == ((), ())


@pytest.mark.parametrize(("gpu_devices", "read"), [("1", (1,)), ("none", ())])
async def test_a_reading_asks_only_for_the_gpus_the_worker_uses(
    gpu_devices: str, read: tuple[int, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--gpu-devices``: only those GPUs are sampled, and no tool is asked again for the
    others (each ask may take the tool's timeout); theirs keep the free memory they had."""
    fake = FakeNvml(
        [
            FakeGpu("NVIDIA RTX 4090", "GPU-a", 24 * GIB, 20 * GIB, 97, 71, 430_000, 450_000),
            FakeGpu("NVIDIA RTX 3060", "GPU-b", 12 * GIB, 1 * GIB, 3, 40, 20_000, 170_000),
        ]
    )
    used = tuple(g for g in TWO_CUDA.gpus if g.index in read)
    asked: list[object] = []
    monkeypatch.setattr(detect, "_free_by_index", lambda *a: asked.append(a) or {})
    probe = MemoryProbe(TWO_CUDA, gpu_devices, sampler=sampler_for(used, load_nvml=lambda: fake))
    reading = await probe.read()
    assert [g.index for g in reading.gpus] == list(read)
    fresh = {0: 4 * GIB, 1: 11 * GIB}
    expected = tuple(
        fresh[g.index] if g.index in read else g.memory_free_bytes for g in TWO_CUDA.gpus
    )
    assert reading.gpu_free_bytes == expected and asked == []
    assert MemoryProbe(TWO_CUDA, "none").sampler is NO_GPUS
