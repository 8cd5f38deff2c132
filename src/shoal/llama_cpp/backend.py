"""Which llama.cpp backend to fetch or build for this machine.

:func:`choose_backend` is the decision, a pure function of a few facts about the machine;
:func:`detect_backend` gathers those facts (PATH, the NVIDIA driver, the Vulkan SDK) and
asks it. CUDA needs both the compiler and a GPU: a machine with ``nvcc`` but no NVIDIA
driver (a build box, a container without ``--gpus``) stays on the CPU.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from pathlib import Path

from shoal.llama_cpp.errors import LlamaCppError
from shoal.llama_cpp.source import BACKEND_CPU

logger = logging.getLogger(__name__)

BACKEND_CUDA = "cuda"
BACKEND_METAL = "metal"
BACKEND_VULKAN = "vulkan"
BACKEND_ROCM = "rocm"
BACKENDS: tuple[str, ...] = (BACKEND_CPU, BACKEND_CUDA, BACKEND_METAL, BACKEND_VULKAN, BACKEND_ROCM)
AUTO = "auto"
"""``requested`` value (like None) that lets the machine decide."""

NVIDIA_SMI_TIMEOUT_S = 5.0
"""``nvidia-smi -L`` only lists GPUs; a driver that takes longer is not usable anyway."""

NVIDIA_PROC_GPUS = Path("/proc/driver/nvidia/gpus")
VULKAN_HEADERS = (
    Path("/usr/include/vulkan/vulkan.h"),
    Path("/usr/local/include/vulkan/vulkan.h"),
    Path("/opt/homebrew/include/vulkan/vulkan.h"),
)
# Which operating systems each backend can run on (platform.system(), lower case).
_BACKEND_SYSTEMS: dict[str, frozenset[str]] = {
    BACKEND_CPU: frozenset({"linux", "darwin", "windows"}),
    BACKEND_CUDA: frozenset({"linux", "windows"}),
    BACKEND_METAL: frozenset({"darwin"}),
    BACKEND_VULKAN: frozenset({"linux", "darwin", "windows"}),
    BACKEND_ROCM: frozenset({"linux", "windows"}),
}


def normalize_machine(machine: str) -> str:
    """``platform.machine()`` in llama.cpp's release vocabulary: ``x64``, ``arm64``, ..."""
    lowered = machine.lower()
    if lowered in ("x86_64", "amd64", "x64"):
        return "x64"
    if lowered in ("aarch64", "arm64", "armv8", "armv8l"):
        return "arm64"
    return lowered


def choose_backend(
    system: str,
    machine: str,
    has_nvcc: bool,
    nvidia_gpu_present: bool,
    has_vulkan_sdk: bool,
    requested: str | None = None,
) -> str:
    """The backend to fetch or build: ``requested`` if given, else the best this machine has.

    Automatic order: CUDA (``nvcc`` and an NVIDIA GPU), Metal (macOS on Apple Silicon),
    Vulkan (its SDK is installed), else the CPU. An explicit ``requested`` backend wins,
    even without a GPU (e.g. to build on one machine for another); LlamaCppError if it is
    unknown or cannot run on this operating system at all.
    """
    system = system.lower()
    if requested is not None and requested.lower() != AUTO:
        return _check_requested(requested.lower(), system)
    if has_nvcc and nvidia_gpu_present and system in _BACKEND_SYSTEMS[BACKEND_CUDA]:
        return BACKEND_CUDA
    if system == "darwin" and normalize_machine(machine) == "arm64":
        return BACKEND_METAL
    if has_vulkan_sdk:
        return BACKEND_VULKAN
    return BACKEND_CPU


def _check_requested(requested: str, system: str) -> str:
    systems = _BACKEND_SYSTEMS.get(requested)
    if systems is None:
        raise LlamaCppError(
            f"unknown llama.cpp backend {requested!r}; choose one of "
            f"{', '.join((AUTO, *BACKENDS))}."
        )
    if system not in systems:
        raise LlamaCppError(
            f"the {requested} backend does not run on {system}; it needs "
            f"{' or '.join(sorted(systems))}. Leave the backend on {AUTO!r} to let Shoal choose."
        )
    return requested


def detect_backend(
    requested: str | None = None,
    *,
    system: str,
    machine: str,
    path_env: str | None,
    vulkan_sdk: str | None = None,
) -> str:
    """:func:`choose_backend` for this machine.

    ``path_env`` is the PATH to search for ``nvcc`` and ``glslc`` (None: this process's
    PATH); ``vulkan_sdk`` is the value of ``VULKAN_SDK`` in the caller's environment.
    """
    if requested is not None and requested.lower() != AUTO:
        return choose_backend(system, machine, False, False, False, requested)
    has_nvcc = shutil.which("nvcc", path=path_env) is not None
    gpu = nvidia_gpu_present(system, path_env) if has_nvcc else False
    vulkan = vulkan_sdk_present(path_env, vulkan_sdk)
    chosen = choose_backend(system, machine, has_nvcc, gpu, vulkan)
    logger.info(
        "llama.cpp backend: %s (nvcc: %s, NVIDIA GPU: %s, Vulkan SDK: %s)",
        chosen,
        "yes" if has_nvcc else "no",
        "yes" if gpu else "no",
        "yes" if vulkan else "no",
    )
    return chosen


def nvidia_gpu_present(
    system: str, path_env: str | None, *, proc_gpus: Path = NVIDIA_PROC_GPUS
) -> bool:
    """True if the NVIDIA driver is loaded and sees at least one GPU.

    On Linux the driver lists its GPUs in ``proc_gpus``; elsewhere, or when that is empty,
    ``nvidia-smi -L`` (from ``path_env``) is asked.
    """
    if system.lower() == "linux" and proc_gpus.is_dir() and any(proc_gpus.iterdir()):
        return True
    nvidia_smi = shutil.which("nvidia-smi", path=path_env)
    if nvidia_smi is None:
        return False
    try:
        result = subprocess.run(
            [nvidia_smi, "-L"],
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.info("nvidia-smi -L failed (%s); assuming no NVIDIA GPU", exc)
        return False
    return result.returncode == 0 and any(
        line.startswith("GPU ") for line in result.stdout.splitlines()
    )


def vulkan_sdk_present(
    path_env: str | None,
    vulkan_sdk: str | None,
    *,
    headers: tuple[Path, ...] = VULKAN_HEADERS,
) -> bool:
    """True if llama.cpp's Vulkan backend can be built: ``VULKAN_SDK``, or glslc and headers."""
    if vulkan_sdk and Path(vulkan_sdk).is_dir():
        return True
    has_glslc = shutil.which("glslc", path=path_env) is not None
    return has_glslc and any(header.is_file() for header in headers)
