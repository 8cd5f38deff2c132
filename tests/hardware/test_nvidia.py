"""NVIDIA: the nvidia-smi CSV parser against recorded outputs, and NVML through a FAKE pynvml."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from shoal.hardware import nvidia
from shoal.hardware.profile import Accelerator

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


class FakeNVMLError(Exception):
    """Stands in for pynvml.NVMLError."""


def fake_pynvml(
    *, fail_init: bool = False, memory: bool = True, cuda: int | Exception | None = 12040
) -> Any:
    """A FAKE of the ``pynvml`` module (nvidia-ml-py) for a machine with two GPUs.

    It imitates the calls ``from_nvml`` makes: init/shutdown, count, handle by index, name,
    UUID, memory info, driver version, the driver's CUDA version (``cuda``: NVML's integer,
    an error to raise, or None for bindings without the call) and compute capability; names
    come back as bytes the way old bindings return them.
    """
    calls: list[str] = []

    def cuda_version() -> int:
        if isinstance(cuda, Exception):
            raise cuda
        assert cuda is not None
        return cuda

    def init() -> None:
        calls.append("init")
        if fail_init:
            raise FakeNVMLError("NVML Shared Library Not Found")

    def memory_info(handle: int) -> SimpleNamespace:
        if not memory:
            raise FakeNVMLError("Not Supported")
        return SimpleNamespace(total=(24 << 30) * (handle + 1), free=(20 << 30) * (handle + 1))

    extra = {} if cuda is None else {"nvmlSystemGetCudaDriverVersion": cuda_version}
    return SimpleNamespace(
        **extra,
        calls=calls,
        NVMLError=FakeNVMLError,
        nvmlInit=init,
        nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlSystemGetDriverVersion=lambda: "550.54.15",
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: f"NVIDIA RTX {4090 - h * 10}".encode(),
        nvmlDeviceGetUUID=lambda h: f"GPU-{h}",
        nvmlDeviceGetMemoryInfo=memory_info,
        nvmlDeviceGetCudaComputeCapability=lambda h: (8, 9),
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


@pytest.mark.parametrize("cuda", [None, FakeNVMLError("Function Not Found"), 0])
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
