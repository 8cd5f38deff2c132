"""GPU telemetry samplers: which one a machine gets, and what each reads.

NVML is a FAKE (``fakes.fake_pynvml``: no NVIDIA GPU here); the vendor tools are a FAKE that
replays recorded outputs (``fakes.tool_replay``, ``fixtures/``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from fakes.fake_pynvml.pynvml import FakeGpu, FakeNvml
from fakes.tool_replay import Replay
from shoal.hardware import amd, nvidia, telemetry
from shoal.hardware.detect import ToolResult
from shoal.hardware.profile import Accelerator, GpuDevice
from shoal.hardware.telemetry import (
    NO_GPUS,
    AmdSampler,
    DetectedGpus,
    NvidiaSmiSampler,
    NvmlSampler,
    sampler_for,
)
from shoal.protocol.telemetry import GpuSample

FIXTURES = Path(__file__).parent / "fixtures"
MIB = 1 << 20
GIB = 1 << 30
SMI_TELEMETRY = nvidia.smi_command(nvidia.SMI_TELEMETRY_FIELDS)


def read(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def gpu(index: int, accelerator: Accelerator, name: str = "", uuid: str = "") -> GpuDevice:
    return GpuDevice(index, name or f"GPU {index}", accelerator, 80 * GIB, uuid=uuid)


def fake_gpu(n: int) -> FakeGpu:
    return FakeGpu(f"NVIDIA H100 #{n}", f"GPU-{n}", 80 * GIB, n * GIB, n, 30 + n, 100_000, 700_000)


class Loads:
    """Counts how often NVML is initialised (``NvmlSampler``'s ``load``)."""

    def __init__(self, nvml: Any) -> None:
        self.nvml = nvml
        self.count = 0

    def __call__(self) -> Any:
        self.count += 1
        return self.nvml


class Counted(FakeNvml):
    """The FAKE NVML, counting the handle lookups."""

    handles = 0

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self.handles += 1
        return super().nvmlDeviceGetHandleByIndex(index)


# ------------------------------------------------------------------ which sampler


def test_a_machine_without_gpus_or_without_a_tool_samples_nothing_and_runs_nothing() -> None:
    run = Replay({})
    for gpus in ((), (gpu(0, Accelerator.METAL),), (gpu(0, Accelerator.VULKAN),)):
        sampler = sampler_for(gpus, run, load_nvml=lambda: FakeNvml([fake_gpu(0)]))
        assert sampler is NO_GPUS
        assert sampler.sample() == ()
    assert run.calls == []


def test_nvidia_gets_nvml_with_nvidia_smi_behind_it_and_nothing_runs_before_sampling() -> None:
    loads = Loads(FakeNvml([fake_gpu(0)]))
    sampler = sampler_for([gpu(0, Accelerator.CUDA)], Replay({}), loads)
    assert isinstance(sampler, DetectedGpus)
    assert isinstance(sampler.vendor, NvmlSampler)
    assert isinstance(sampler.vendor.fallback, NvidiaSmiSampler)
    assert loads.count == 0


def test_amd_gets_amd_smi_then_rocm_smi() -> None:
    sampler = sampler_for([gpu(0, Accelerator.ROCM)], Replay({}))
    assert isinstance(sampler, DetectedGpus)
    assert isinstance(sampler.vendor, AmdSampler)


# ------------------------------------------------------------------ NVML


def test_nvml_is_initialised_once_and_each_handle_looked_up_once() -> None:
    fake = Counted([fake_gpu(0), fake_gpu(1)])
    loads = Loads(fake)
    sampler = NvmlSampler([0, 1], NO_GPUS, loads)
    first = sampler.sample()
    second = sampler.sample()
    assert loads.count == 1 and fake.handles == 2
    assert first == second
    assert [(s.index, s.name, s.memory_used_bytes, s.power_limit_watts) for s in first] == [
        (0, "NVIDIA H100 #0", 0, 700.0),
        (1, "NVIDIA H100 #1", GIB, 700.0),
    ]


def test_a_gpu_nvml_cannot_open_gives_its_index_alone_and_is_asked_again() -> None:
    fake = Counted([fake_gpu(0)])
    sampler = NvmlSampler([0, 1], NO_GPUS, Loads(fake))
    assert sampler.sample()[1] == GpuSample(index=1)
    fake.gpus.append(fake_gpu(1))  # it answers now (e.g. after a reset)
    assert sampler.sample()[1].name == "NVIDIA H100 #1"
    assert fake.handles == 3  # GPU 0 once, GPU 1 twice (refused, then found)
    assert sampler.sample()[1].name == "NVIDIA H100 #1"
    assert fake.handles == 3  # both cached now


def test_a_gpu_that_fails_some_readings_keeps_the_others() -> None:
    broken = dataclasses.replace(fake_gpu(1), temperature=None, power_mw=None, utilization=None)
    sampler = NvmlSampler([0, 1], NO_GPUS, Loads(FakeNvml([fake_gpu(0), broken])))
    [ok, partial] = sampler.sample()
    assert ok.temperature_celsius == 30
    assert (partial.temperature_celsius, partial.power_watts, partial.utilization_percent) == (
        None,
        None,
        None,
    )
    assert (partial.memory_used_bytes, partial.power_limit_watts) == (GIB, 700.0)


def test_without_nvml_nvidia_smi_answers_and_nvml_is_not_tried_again() -> None:
    # Shoal's query, as nvidia-smi prints it (constructed values: no recording of this query).
    csv = (
        "index, uuid, name, utilization.gpu [%], memory.used [MiB], memory.total [MiB], "
        "temperature.gpu, power.draw [W], power.limit [W]\n"
        "0, GPU-x, Tesla T4, 12 %, 100 MiB, 15360 MiB, 44, 27.50 W, 70.00 W\n"
    )
    run = Replay({SMI_TELEMETRY: csv})
    loads = Loads(None)
    sampler = NvmlSampler([0], NvidiaSmiSampler(run), loads)
    for _ in range(2):
        [sample] = sampler.sample()
        assert (sample.name, sample.utilization_percent, sample.power_watts) == (
            "Tesla T4",
            12,
            27.5,
        )
    assert loads.count == 1
    assert run.calls == [SMI_TELEMETRY, SMI_TELEMETRY]


def test_a_failing_nvidia_smi_gives_nothing() -> None:
    run = Replay({SMI_TELEMETRY: ToolResult(9, "NVIDIA-SMI has failed", "")})
    assert NvidiaSmiSampler(run).sample() == ()
    assert NvidiaSmiSampler(Replay({})).sample() == ()  # not installed


# ------------------------------------------------------------------ AMD


def test_amd_smi_answers_first() -> None:
    run = Replay({amd.AMD_SMI_TELEMETRY: read("amd_smi_metric_telemetry_2gpu.json")})
    samples = AmdSampler(run).sample()
    assert [(s.index, s.utilization_percent, s.power_watts) for s in samples] == [
        (0, 91, 12.3),
        (1, 1, 23.4),
    ]
    assert run.calls == [amd.AMD_SMI_TELEMETRY]


def test_rocm_smi_when_amd_smi_is_missing_and_it_goes_first_from_then_on() -> None:
    run = Replay({amd.ROCM_SMI_TELEMETRY: read("rocm_smi_mi300x.json")})
    sampler = AmdSampler(run)
    assert [s.power_limit_watts for s in sampler.sample()] == [750]
    assert [s.power_limit_watts for s in sampler.sample()] == [750]
    assert run.calls == [amd.AMD_SMI_TELEMETRY, amd.ROCM_SMI_TELEMETRY, amd.ROCM_SMI_TELEMETRY]


def test_no_amd_tool_gives_nothing() -> None:
    run = Replay({})
    assert AmdSampler(run).sample() == ()
    assert run.calls == [amd.AMD_SMI_TELEMETRY, amd.ROCM_SMI_TELEMETRY]


# ------------------------------------------------------------------ the detected GPUs


def test_samples_cover_the_detected_gpus_in_order_named_as_detected() -> None:
    """amd-smi's metric names no GPU: the detected name and UUID fill in; a GPU the tool
    reports but detection did not list is left out; one the tool misses has no sample."""
    run = Replay({amd.AMD_SMI_TELEMETRY: read("amd_smi_metric_telemetry_2gpu.json")})
    detected = [gpu(1, Accelerator.ROCM, "Radeon PRO W7800", "0xabc"), gpu(7, Accelerator.ROCM)]
    samples = sampler_for(detected, run).sample()
    assert [(s.index, s.name, s.uuid, s.utilization_percent) for s in samples] == [
        (1, "Radeon PRO W7800", "0xabc", 1)
    ]


def test_a_name_the_tool_gives_is_kept() -> None:
    loads = Loads(FakeNvml([fake_gpu(0)]))
    [sample] = sampler_for([gpu(0, Accelerator.CUDA, "detected name")], Replay({}), loads).sample()
    assert (sample.name, sample.uuid) == ("NVIDIA H100 #0", "GPU-0")


def test_free_bytes_where_known() -> None:
    samples = (
        GpuSample(index=0, memory_used_bytes=MIB, memory_total_bytes=3 * MIB),
        GpuSample(index=1, memory_total_bytes=3 * MIB),
        GpuSample(index=2, memory_used_bytes=5 * MIB, memory_total_bytes=3 * MIB),  # odd tool
    )
    assert telemetry.free_bytes(samples) == {0: 2 * MIB, 2: 0}
