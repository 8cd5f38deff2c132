"""NVIDIA: the nvidia-smi CSV parser against recorded outputs, and NVML through a FAKE pynvml."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from fakes.fake_pynvml.pynvml import FakeGpu, FakeNvml, NVMLError
from shoal.hardware import nvidia
from shoal.hardware.profile import Accelerator
from shoal.protocol.telemetry import GpuSample

FIXTURES = Path(__file__).parent / "fixtures"
MIB = 1 << 20


def read(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def test_eight_v100s_with_a_header_and_units() -> None:
    gpus = nvidia.parse_nvidia_smi_csv(read("nvidia_smi_v100x8.csv"))
    assert [g.index for g in gpus] == list(range(8))
    assert {g.name for g in gpus} == {"Tesla V100-SXM2-32GB"}
    assert all(g.accelerator is Accelerator.CUDA for g in gpus)
    assert gpus[0].memory_total_bytes == 32768 * MIB
    assert gpus[5].memory_total_bytes == 32764 * MIB
    # This query has memory.used, not memory.free: free is total - used.
    assert gpus[0].memory_free_bytes == (32768 - 4) * MIB
    assert gpus[6].memory_free_bytes == (32768 - 13928) * MIB


def test_unified_memory_gb10_reports_na_so_memory_is_unknown() -> None:
    gpus = nvidia.parse_nvidia_smi_csv(
        read("nvidia_smi_gb10_noheader.csv"), ("name", "memory.total", "driver_version")
    )
    assert len(gpus) == 1
    gb10 = gpus[0]
    assert (gb10.index, gb10.name, gb10.driver) == (0, "NVIDIA GB10", "580.126.09")
    assert gb10.memory_total_bytes == 0
    assert gb10.memory_free_bytes is None


def test_columns_are_mapped_by_header_in_any_order() -> None:
    gpus = nvidia.parse_nvidia_smi_csv(read("nvidia_smi_compute_cap_2gpu.csv"))
    assert [(g.index, g.name, g.compute_capability, g.driver) for g in gpus] == [
        (0, "NVIDIA TITAN V", "7.0", "570.86.15"),
        (1, "NVIDIA RTX 5880 Ada Generation", "8.9", "570.86.15"),
    ]
    assert all(g.memory_total_bytes == 0 for g in gpus)  # not queried: unknown


def test_noheader_rows_use_the_query_fields() -> None:
    # Constructed rows in the default query's column order, without header and units.
    text = (
        "1, NVIDIA A10, GPU-abc, 23028, 22500, 550.54.15, 8.6\n"
        "0, NVIDIA A10, GPU-def, 23028, [N/A], 550.54.15, [Not Supported]\n"
    )
    gpus = nvidia.parse_nvidia_smi_csv(text)
    assert [g.index for g in gpus] == [0, 1]  # sorted by index
    assert gpus[1].uuid == "GPU-abc"
    assert gpus[1].memory_free_bytes == 22500 * MIB
    assert gpus[0].memory_free_bytes is None
    assert gpus[0].compute_capability == ""


def test_non_numbers_in_memory_columns_are_unknown() -> None:
    gpus = nvidia.parse_nvidia_smi_csv("index, name, memory.total [MiB]\n0, X, nan\n1, Y, inf\n")
    assert [g.memory_total_bytes for g in gpus] == [0, 0]


def test_an_old_driver_rejects_compute_cap() -> None:
    output = read("nvidia_smi_no_compute_cap.txt")
    assert nvidia.rejects_field(output)
    assert nvidia.parse_nvidia_smi_csv(output) == []
    assert not nvidia.rejects_field(read("nvidia_smi_v100x8.csv"))


@pytest.mark.parametrize(
    "text", ["", "\n\n", "garbage", "1, 2", "No devices were found\n", "index, name\n0"]
)
def test_unreadable_output_gives_no_gpus(text: str) -> None:
    assert nvidia.parse_nvidia_smi_csv(text) == []


def test_query_commands_keep_the_header() -> None:
    assert nvidia.smi_command() == (
        "nvidia-smi",
        "--query-gpu=index,name,uuid,memory.total,memory.free,driver_version,compute_cap",
        "--format=csv,nounits",
    )
    assert "compute_cap" not in nvidia.smi_command(nvidia.SMI_FIELDS_LEGACY)[1]


# ------------------------------------------------------------------------------ NVML


def fake_pynvml(
    *, fail_init: bool = False, memory: bool = True, cuda: int | Exception | None = 12040
) -> FakeNvml:
    """A FAKE NVML (``fakes.fake_pynvml``) for a machine with two GPUs whose names come back
    as bytes, the way old bindings return them; ``memory=False``: no memory info; ``cuda``:
    the driver's CUDA version as NVML gives it, an error to raise, or None for bindings
    without ``nvmlSystemGetCudaDriverVersion``."""
    gpus = [
        FakeGpu(
            name=f"NVIDIA RTX {4090 - h * 10}",
            uuid=f"GPU-{h}",
            memory_total=(24 << 30) * (h + 1) if memory else None,
            memory_used=(4 << 30) * (h + 1) if memory else None,
            compute_capability=(8, 9),
        )
        for h in range(2)
    ]
    return FakeNvml(
        gpus, "550.54.15", fail_init=fail_init, bytes_names=True, cuda_driver_version=cuda
    )


def test_nvml_lists_every_gpu_and_shuts_down(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = fake_pynvml()
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    gpus = nvidia.from_nvml()
    assert gpus is not None
    assert [(g.index, g.name, g.uuid) for g in gpus] == [
        (0, "NVIDIA RTX 4090", "GPU-0"),
        (1, "NVIDIA RTX 4080", "GPU-1"),
    ]
    assert gpus[1].memory_total_bytes == 48 << 30
    assert gpus[1].memory_free_bytes == 40 << 30
    assert gpus[0].compute_capability == "8.9"
    assert gpus[0].driver == "550.54.15"
    assert {g.cuda_version for g in gpus} == {"12.4"}  # NVML's 12040
    assert fake.calls == ["init", "shutdown"]
    assert nvidia.nvidia_free_bytes() == {0: 20 << 30, 1: 40 << 30}


def test_nvml_without_memory_info_reports_unknown_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(memory=False))
    gpus = nvidia.from_nvml()
    assert gpus is not None
    assert [(g.memory_total_bytes, g.memory_free_bytes) for g in gpus] == [(0, None), (0, None)]


def test_nvml_without_a_driver_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(fail_init=True))
    assert nvidia.from_nvml() is None
    assert nvidia.nvidia_free_bytes() is None


def test_nvml_without_the_library_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    assert nvidia.from_nvml() is None


@pytest.mark.parametrize("cuda", [None, NVMLError("Function Not Found"), 0])
def test_nvml_that_cannot_say_the_cuda_version_leaves_it_unknown(
    monkeypatch: pytest.MonkeyPatch, cuda: int | Exception | None
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(cuda=cuda))
    gpus = nvidia.from_nvml()
    assert gpus is not None and len(gpus) == 2
    assert {g.cuda_version for g in gpus} == {""}


# ------------------------------------------------------------------- the driver's CUDA


@pytest.mark.parametrize(
    ("fixture", "expected"),
    [
        ("nvidia_smi_banner_h100_535.txt", "12.2"),
        ("nvidia_smi_banner_v100x2_535.txt", "12.2"),
        ("nvidia_smi_banner_a100x2_580.txt", "13.0"),
        ("nvidia_smi_banner_b200_r610.txt", "13.3"),  # "CUDA UMD Version" since R610
        ("nvidia_smi_v100x8.csv", ""),  # a query answer has no banner
    ],
)
def test_cuda_version_from_recorded_banners(fixture: str, expected: str) -> None:
    assert nvidia.parse_cuda_version(read(fixture)) == expected


def test_cuda_version_from_the_q_report_and_garbage() -> None:
    # nvidia-smi -q aligns its values after the colon (constructed line of that layout)
    assert nvidia.parse_cuda_version("CUDA Version                              : 11.7") == "11.7"
    assert nvidia.parse_cuda_version("No devices were found") == ""
    assert nvidia.parse_cuda_version("") == ""


# ------------------------------------------------------------------------- telemetry

S = GpuSample
RTX2080_FIELDS = (
    "power.limit", "power.min_limit", "power.max_limit", "memory.total", "vbios_version",
    "driver_version", "name", "gpu_uuid", "power.draw", "temperature.gpu", "temperature.memory",
    "clocks.current.graphics", "clocks.sm", "clocks.mem", "utilization.gpu",
    "utilization.memory", "fan.speed", "pcie.link.width.current", "pstate",
)  # fmt: skip


def test_telemetry_from_the_recorded_v100_query() -> None:
    """Header with units, no power columns (None), GPU 6 busy."""
    samples = nvidia.parse_nvidia_smi_telemetry(read("nvidia_smi_v100x8.csv"))
    assert [s.index for s in samples] == list(range(8))
    assert samples[6] == S(
        index=6,
        name="Tesla V100-SXM2-32GB",
        utilization_percent=100,
        memory_used_bytes=13928 * MIB,
        memory_total_bytes=32768 * MIB,
        temperature_celsius=51,
    )
    assert samples[5].memory_total_bytes == 32764 * MIB
    assert samples[0].memory_free_bytes == (32768 - 4) * MIB


def test_telemetry_from_a_recorded_noheader_query_with_power() -> None:
    """No header (the query's field list names the columns), gpu_uuid, no index or used."""
    [sample] = nvidia.parse_nvidia_smi_telemetry(
        read("nvidia_smi_power_rtx2080_noheader.csv"), RTX2080_FIELDS
    )
    assert sample == S(
        index=0,
        uuid="GPU-22b2c6ac-2d49-4863-197c-9c469071178a",
        name="GeForce RTX 2080",
        utilization_percent=86,
        memory_total_bytes=7979 * MIB,
        temperature_celsius=45,
        power_watts=176.98,
        power_limit_watts=200,
    )


def test_telemetry_of_shoals_own_query_with_placeholders() -> None:
    # Constructed in the form nvidia-smi prints Shoal's query (SMI_TELEMETRY_FIELDS, header,
    # nounits); GPU 1 is a unified-memory part that knows neither its memory nor its cap.
    text = (
        "index, uuid, name, utilization.gpu [%], memory.used [MiB], memory.total [MiB], "
        "temperature.gpu, power.draw [W], power.limit [W]\n"
        "0, GPU-a, NVIDIA H100 80GB HBM3, 37, 72790, 81559, 39, 145.21, 700.00\n"
        "1, GPU-b, NVIDIA GB10, 0, [N/A], [N/A], 41, 5.04, [N/A]\n"
    )
    assert nvidia.parse_nvidia_smi_telemetry(text) == (
        S(index=0, uuid="GPU-a", name="NVIDIA H100 80GB HBM3", utilization_percent=37,
          memory_used_bytes=72790 * MIB, memory_total_bytes=81559 * MIB,
          temperature_celsius=39, power_watts=145.21, power_limit_watts=700),
        S(index=1, uuid="GPU-b", name="NVIDIA GB10", utilization_percent=0,
          temperature_celsius=41, power_watts=5.04),
    )  # fmt: skip
    assert nvidia.smi_command(nvidia.SMI_TELEMETRY_FIELDS)[1] == (
        "--query-gpu=index,uuid,name,utilization.gpu,memory.used,memory.total,"
        "temperature.gpu,power.draw,power.limit"
    )


@pytest.mark.parametrize(
    "text", ["", "NVIDIA-SMI has failed because it couldn't communicate with the driver.", "a,b"]
)
def test_telemetry_of_error_text_is_empty(text: str) -> None:
    assert nvidia.parse_nvidia_smi_telemetry(text) == ()


H100 = FakeGpu(
    "NVIDIA H100 80GB HBM3",
    "GPU-h100",
    memory_total=81559 * MIB,
    memory_used=72790 * MIB,
    utilization=37,
    temperature=39,
    power_mw=145_210,
    power_limit_mw=700_000,
)


def h100(**unsupported: None) -> FakeGpu:
    """``H100`` with the readings named here unsupported."""
    return dataclasses.replace(H100, **unsupported)


def test_nvml_sample_reads_each_gpu_through_its_handle() -> None:
    fake = FakeNvml([h100()], bytes_names=True)
    gpu = nvidia.nvml_gpu(fake, 0)
    assert gpu == nvidia.NvmlGpu(handle=0, name="NVIDIA H100 80GB HBM3", uuid="GPU-h100")
    assert nvidia.nvml_sample(fake, 0, gpu) == S(
        index=0,
        uuid="GPU-h100",
        name="NVIDIA H100 80GB HBM3",
        utilization_percent=37,
        memory_used_bytes=72790 * MIB,
        memory_total_bytes=81559 * MIB,
        temperature_celsius=39,
        power_watts=145.21,  # NVML's milliwatts
        power_limit_watts=700,
    )


def test_a_reading_nvml_does_not_support_is_none_and_the_rest_stay() -> None:
    fake = FakeNvml([h100(memory_total=None, memory_used=None, power_limit_mw=None)])
    gpu = nvidia.nvml_gpu(fake, 0)
    assert gpu is not None
    sample = nvidia.nvml_sample(fake, 0, gpu)
    assert (sample.memory_used_bytes, sample.memory_total_bytes) == (None, None)
    assert sample.power_limit_watts is None
    assert (sample.utilization_percent, sample.temperature_celsius) == (37, 39)
    assert sample.power_watts == 145.21


def test_a_gpu_without_a_handle_has_none() -> None:
    assert nvidia.nvml_gpu(FakeNvml([h100()]), 1) is None
