"""What ``backend.choose_backend`` needs to know of this machine, gathered; never raises.

The GPUs come from ``hardware.detect`` (NVML, else ``nvidia-smi``, with the driver's CUDA
version; ``amd-smi``; ``vulkaninfo``), passed in by the caller that detected them. The rest
is read here from files and one short ``nvcc --version``:

* NVIDIA device files (``/dev/nvidia0``...): the kernel driver has GPUs even when NVML and
  ``nvidia-smi`` cannot answer, as in a container started without the driver's libraries;
* WSL 2: ``microsoft`` in the kernel's release, or the Windows driver's ``libcuda.so`` in
  ``/usr/lib/wsl/lib``;
* a Vulkan driver for a GPU: ``vulkaninfo`` listed one, else an installable client driver
  (an ICD file in ``/usr/share/vulkan/icd.d`` or ``/etc/vulkan/icd.d``) of the vendor of a
  GPU in ``/sys/class/drm`` (Mesa installs the ICDs of every vendor at once, so the file
  alone proves nothing); software rasterizers (lavapipe) do not count;
* the Vulkan SDK a build needs (``VULKAN_SDK``, or ``glslc`` and the headers); ROCm
  (``/opt/rocm``, or its tools on PATH) and ``hipconfig`` for a ROCm build.
"""

from __future__ import annotations

import logging
import platform
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shoal.hardware.profile import Accelerator, GpuDevice
from shoal.llama_cpp import cuda
from shoal.llama_cpp.backend import MachineFacts

log = logging.getLogger(__name__)

NVCC_TIMEOUT_S = 10.0
"""``nvcc --version`` prints four lines; one that takes longer is not a usable toolkit."""

VENDOR_ICDS: dict[str, tuple[str, tuple[str, ...]]] = {
    "0x1002": ("AMD", ("radeon", "amd")),
    "0x8086": ("Intel", ("intel",)),
    "0x10de": ("NVIDIA", ("nvidia",)),
}
"""PCI vendor id -> (vendor, the words its ICD files are named with: Mesa's radeon_icd and
intel_icd, AMD's amd_icd64, NVIDIA's nvidia_icd)."""
SOFTWARE_ICDS = ("lvp", "llvmpipe", "swiftshader")
ROCM_TOOLS = ("hipconfig", "rocminfo", "amd-smi")


@dataclass(frozen=True)
class Places:
    """Where the facts are read from; tests point them at temporary folders."""

    icd_dirs: tuple[Path, ...] = (
        Path("/usr/share/vulkan/icd.d"),
        Path("/etc/vulkan/icd.d"),
        Path("/usr/local/share/vulkan/icd.d"),
    )
    drm: Path = Path("/sys/class/drm")
    dev: Path = Path("/dev")
    rocm: Path = Path("/opt/rocm")
    wsl_lib: Path = Path("/usr/lib/wsl/lib")
    vulkan_headers: tuple[Path, ...] = (
        Path("/usr/include/vulkan/vulkan.h"),
        Path("/usr/local/include/vulkan/vulkan.h"),
        Path("/opt/homebrew/include/vulkan/vulkan.h"),
    )


def gather(
    gpus: Sequence[GpuDevice],
    *,
    path_env: str | None,
    vulkan_sdk: str | None = None,
    system: str | None = None,
    machine: str | None = None,
    kernel: str | None = None,
    places: Places = Places(),
) -> MachineFacts:
    """This machine's facts. ``path_env`` is the PATH to search for tools (None: this
    process's); ``vulkan_sdk`` the caller's ``VULKAN_SDK``; ``kernel`` the kernel's release
    (``platform.release()`` by default)."""
    gpus = tuple(gpus)
    return MachineFacts(
        system=system or platform.system(),
        machine=machine or platform.machine(),
        gpus=gpus,
        nvidia_device_nodes=any(places.dev.glob("nvidia[0-9]*")),
        wsl=is_wsl(kernel if kernel is not None else platform.release(), places.wsl_lib),
        nvcc=nvcc_version(path_env),
        vulkan_driver=vulkan_driver(gpus, places),
        vulkan_sdk=vulkan_sdk_present(path_env, vulkan_sdk, headers=places.vulkan_headers),
        rocm=rocm_installed(path_env, places.rocm),
        hip_sdk=shutil.which("hipconfig", path=path_env) is not None,
    )


def is_wsl(kernel: str, wsl_lib: Path) -> bool:
    """WSL 2: its kernels are named ``...-microsoft-standard-WSL2``; its driver folder."""
    return "microsoft" in kernel.lower() or any(wsl_lib.glob("libcuda.so*"))


def nvcc_version(path_env: str | None) -> str:
    """The CUDA toolkit's version from ``nvcc --version`` (``13.0``); "" without one."""
    nvcc = shutil.which("nvcc", path=path_env)
    if nvcc is None:
        return ""
    try:
        done = subprocess.run(
            [nvcc, "--version"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=NVCC_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.info("%s --version failed (%s); taking it for no CUDA toolkit", nvcc, exc)
        return ""
    return parse_nvcc_version(done.stdout) if done.returncode == 0 else ""


def parse_nvcc_version(text: str) -> str:
    """``13.0`` from nvcc's ``Cuda compilation tools, release 13.0, V13.0.88``; "" if none."""
    for line in text.splitlines():
        if "release" in line:
            version = cuda.parse_version(line.split("release", 1)[1])
            if version is not None:
                return cuda.text(version)
    return ""


def vulkan_driver(gpus: Sequence[GpuDevice], places: Places) -> str:
    """What shows a Vulkan driver for a GPU here; "" when nothing does."""
    listed = [g.name for g in gpus if g.accelerator is Accelerator.VULKAN]
    if listed:
        return f"vulkaninfo lists {', '.join(listed)}"
    icds = [
        p
        for d in places.icd_dirs
        if d.is_dir()
        for p in sorted(d.glob("*.json"))
        if not any(word in p.name.lower() for word in SOFTWARE_ICDS)
    ]
    for vendor_id in _gpu_vendors(places.drm):
        vendor, words = VENDOR_ICDS[vendor_id]
        icd = next((p for p in icds if any(w in p.name.lower() for w in words)), None)
        if icd is not None:
            return f"{icd} for the {vendor} GPU"
    return ""


def _gpu_vendors(drm: Path) -> list[str]:
    """The PCI vendor ids of the GPUs the kernel's DRM drivers hold, known vendors only."""
    vendors: list[str] = []
    for card in sorted(drm.glob("card[0-9]*")):
        try:
            vendor = (card / "device" / "vendor").read_text().strip().lower()
        except OSError:
            continue
        if vendor in VENDOR_ICDS and vendor not in vendors:
            vendors.append(vendor)
    return vendors


def vulkan_sdk_present(
    path_env: str | None, vulkan_sdk: str | None, *, headers: tuple[Path, ...]
) -> bool:
    """True if llama.cpp's Vulkan backend can be built: ``VULKAN_SDK``, or glslc and headers."""
    if vulkan_sdk and Path(vulkan_sdk).is_dir():
        return True
    has_glslc = shutil.which("glslc", path=path_env) is not None
    return has_glslc and any(header.is_file() for header in headers)


def rocm_installed(path_env: str | None, rocm: Path) -> str:
    """Where ROCm is: its folder, or one of its tools on PATH; "" when it is not installed."""
    if rocm.is_dir():
        return str(rocm)
    tool = next((t for t in ROCM_TOOLS if shutil.which(t, path=path_env)), None)
    return f"{tool} on PATH" if tool else ""
