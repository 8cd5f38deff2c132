"""Gathering the backend decision's facts from files and tools, in temporary folders.

``Places`` points every read at a temporary tree laid out as the real one (ICD files, DRM
cards, device files, /opt/rocm, WSL's driver folder); tools are stand-in scripts on a PATH of
their own, printing recorded output.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from shoal.hardware.profile import Accelerator, GpuDevice
from shoal.llama_cpp.backend import MachineFacts, choose_backend
from shoal.llama_cpp.facts import Places, gather, parse_nvcc_version, vulkan_sdk_present

NVCC_13_0 = """nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2025 NVIDIA Corporation
Built on Wed_Aug_20_01:58:59_PM_PDT_2025
Cuda compilation tools, release 13.0, V13.0.88
Build cuda_13.0.r13.0/compiler.36424714_0
"""
"""``nvcc --version`` of the CUDA 13.0 toolkit on Shoal's development machine."""
NVCC_12_8 = """nvcc: NVIDIA (R) Cuda compiler driver
Copyright (c) 2005-2025 NVIDIA Corporation
Built on Fri_Feb_21_20:23:50_PST_2025
Cuda compilation tools, release 12.8, V12.8.93
Build cuda_12.8.r12.8/compiler.35583870_0
"""
"""From https://github.com/abetlen/llama-cpp-python/issues/2001 (AleefBilal, 2025-04-14)."""


def make_exe(folder: Path, name: str, body: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def places(root: Path) -> Places:
    return Places(
        icd_dirs=(root / "usr/share/vulkan/icd.d", root / "etc/vulkan/icd.d"),
        drm=root / "sys/class/drm",
        dev=root / "dev",
        rocm=root / "opt/rocm",
        wsl_lib=root / "usr/lib/wsl/lib",
        vulkan_headers=(root / "usr/include/vulkan/vulkan.h",),
    )


def card(root: Path, name: str, vendor: str) -> None:
    device = root / "sys/class/drm" / name / "device"
    device.mkdir(parents=True)
    (device / "vendor").write_text(f"{vendor}\n")


def icd(root: Path, name: str) -> Path:
    folder = root / "usr/share/vulkan/icd.d"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text('{"file_format_version": "1.0.0", "ICD": {"library_path": "x.so"}}\n')
    return path


def facts_of(
    root: Path, *, path: Path | None = None, kernel: str = "6.8.0-45-generic"
) -> MachineFacts:
    return gather(
        (),
        path_env=str(path or root / "empty-bin"),
        system="Linux",
        machine="x86_64",
        kernel=kernel,
        places=places(root),
    )


def test_nothing_here_is_nothing(tmp_path: Path) -> None:
    facts = facts_of(tmp_path)
    assert (facts.nvcc, facts.vulkan_driver, facts.rocm) == ("", "", "")
    assert not (facts.nvidia_device_nodes or facts.wsl or facts.vulkan_sdk or facts.hip_sdk)
    assert choose_backend(facts).backend == "cpu"


@pytest.mark.parametrize("text, version", [(NVCC_13_0, "13.0"), (NVCC_12_8, "12.8"), ("", "")])
def test_nvcc_version_from_recorded_output(text: str, version: str) -> None:
    assert parse_nvcc_version(text) == version


def test_nvcc_is_asked_on_the_path_given(tmp_path: Path) -> None:
    bin_dir = tmp_path / "cuda-bin"
    make_exe(bin_dir, "nvcc", f"#!/bin/sh\ncat <<'EOF'\n{NVCC_12_8}EOF\n")
    assert facts_of(tmp_path, path=bin_dir).nvcc == "12.8"
    make_exe(bin_dir, "nvcc", "#!/bin/sh\necho 'nvcc: broken' >&2\nexit 1\n")
    assert facts_of(tmp_path, path=bin_dir).nvcc == ""


def test_an_amd_gpu_with_mesas_icds_has_a_vulkan_driver(tmp_path: Path) -> None:
    card(tmp_path, "card0", "0x1002")
    for name in ("intel_icd.x86_64.json", "lvp_icd.x86_64.json", "radeon_icd.x86_64.json"):
        icd(tmp_path, name)
    facts = facts_of(tmp_path)
    assert facts.vulkan_driver.endswith("radeon_icd.x86_64.json for the AMD GPU")
    assert choose_backend(facts).backend == "vulkan"


def test_icd_files_without_a_gpu_of_their_vendor_are_no_driver(tmp_path: Path) -> None:
    """Mesa installs every vendor's ICD at once; a server's BMC display is no GPU."""
    card(tmp_path, "card0", "0x1a03")  # ASPEED
    for name in ("intel_icd.x86_64.json", "radeon_icd.x86_64.json", "lvp_icd.x86_64.json"):
        icd(tmp_path, name)
    assert facts_of(tmp_path).vulkan_driver == ""


def test_only_lavapipe_is_no_driver(tmp_path: Path) -> None:
    card(tmp_path, "card0", "0x8086")
    icd(tmp_path, "lvp_icd.x86_64.json")
    assert facts_of(tmp_path).vulkan_driver == ""


def test_vulkaninfos_gpus_are_a_driver() -> None:
    gpu = GpuDevice(0, "AMD Radeon RX 7900 XT (RADV NAVI31)", Accelerator.VULKAN, 20 << 30)
    facts = gather((gpu,), path_env="", system="Linux", machine="x86_64", kernel="6.8")
    assert facts.vulkan_driver == "vulkaninfo lists AMD Radeon RX 7900 XT (RADV NAVI31)"


def test_nvidia_device_files_without_a_listed_gpu_are_a_container_without_libraries(
    tmp_path: Path,
) -> None:
    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("nvidia0", "nvidiactl", "nvidia-uvm"):
        (dev / name).write_text("")
    facts = facts_of(tmp_path)
    assert facts.nvidia_device_nodes
    assert "--gpus all" in (choose_backend(facts).idle_gpus or "")


def test_only_nvidiactl_is_not_a_gpu(tmp_path: Path) -> None:
    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvidiactl").write_text("")
    assert not facts_of(tmp_path).nvidia_device_nodes


@pytest.mark.parametrize(
    "kernel, libcuda, wsl",
    [
        ("5.15.167.4-microsoft-standard-WSL2", False, True),
        ("6.8.0-45-generic", True, True),  # the Windows driver's libcuda in /usr/lib/wsl/lib
        ("6.8.0-45-generic", False, False),
    ],
)
def test_wsl_by_its_kernel_or_its_driver_folder(
    tmp_path: Path, kernel: str, libcuda: bool, wsl: bool
) -> None:
    if libcuda:
        lib = tmp_path / "usr/lib/wsl/lib"
        lib.mkdir(parents=True)
        (lib / "libcuda.so.1").write_text("")
    assert facts_of(tmp_path, kernel=kernel).wsl is wsl


def test_rocm_by_its_folder_or_its_tools(tmp_path: Path) -> None:
    tools = tmp_path / "rocm-bin"
    make_exe(tools, "rocminfo", "#!/bin/sh\n")
    assert facts_of(tmp_path, path=tools).rocm == "rocminfo on PATH"
    assert not facts_of(tmp_path, path=tools).hip_sdk
    make_exe(tools, "hipconfig", "#!/bin/sh\n")
    assert facts_of(tmp_path, path=tools).hip_sdk
    (tmp_path / "opt/rocm").mkdir(parents=True)
    assert facts_of(tmp_path).rocm == str(tmp_path / "opt/rocm")


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
