"""Detect this machine's hardware, refresh its free memory, and turn GPUs into llama-server flags.

``detect_machine`` tries, in order: NVML, ``nvidia-smi``, ``amd-smi``, ``rocm-smi``, Apple
(on macOS), ``vulkaninfo``; the first that finds a GPU wins, otherwise the machine is CPU
only. Every external tool goes through an injectable :class:`CommandRunner` with a
:data:`TOOL_TIMEOUT_S` timeout; a missing, failing or hanging tool is logged at debug and
skipped, never raised.

``split_args`` is the pure decision of which llama-server arguments run a model on exactly
the chosen devices (``--device``, ``--split-mode``, ``--tensor-split``, ``--main-gpu``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import platform
import shutil
import socket
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psutil

from shoal.hardware import amd, apple, cpu, nvidia, vulkan
from shoal.hardware.profile import Accelerator, CpuInfo, GpuDevice, MachineProfile

log = logging.getLogger(__name__)

TOOL_TIMEOUT_S = 5.0
"""How long one vendor tool may run before it counts as failed."""

PROC_CPUINFO = Path("/proc/cpuinfo")
WSL_LIB = Path("/usr/lib/wsl/lib")
"""WSL 2's copy of the Windows NVIDIA driver: ``libcuda.so`` and ``nvidia-smi``, which is
often not on PATH there."""

SPLIT_MODES = ("none", "layer", "row")

DEVICE_PREFIX = {
    Accelerator.CUDA: "CUDA",
    Accelerator.ROCM: "ROCm",
    Accelerator.VULKAN: "Vulkan",
    Accelerator.METAL: "MTL",
}
"""llama.cpp backend device names: ``GGML_CUDA_NAME`` (``CUDA``, or ``ROCm`` in HIP builds),
``GGML_VK_NAME`` (``Vulkan``), and ``MTL`` + index in ``ggml-metal-device.m``; ``--device``
matches them case-insensitively (``ggml_backend_dev_by_name``)."""


@dataclass(frozen=True)
class ToolResult:
    """What a finished tool printed."""

    returncode: int
    stdout: str
    stderr: str = ""

    @property
    def ok(self) -> bool:
        return self.returncode == 0


class CommandRunner(Protocol):
    """Runs one tool; None when it is not installed, could not start, or timed out."""

    def __call__(self, argv: Sequence[str]) -> ToolResult | None: ...


def find_tool(name: str) -> str | None:
    """``name`` on PATH, else in WSL's driver folder (where WSL 2 keeps ``nvidia-smi``)."""
    found = shutil.which(name)
    if found is None and (WSL_LIB / name).is_file():
        found = str(WSL_LIB / name)
    return found


def run_tool(argv: Sequence[str]) -> ToolResult | None:
    """Run ``argv`` with :data:`TOOL_TIMEOUT_S`; None if missing, unstartable or too slow."""
    tool = find_tool(argv[0])
    if tool is None:
        log.debug("%s: not installed", argv[0])
        return None
    try:
        done = subprocess.run(
            [tool, *argv[1:]],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=TOOL_TIMEOUT_S,
            check=False,
        )
    except subprocess.TimeoutExpired:
        log.debug("%s: no answer within %.0f s", argv[0], TOOL_TIMEOUT_S)
        return None
    except OSError as exc:
        log.debug("%s: could not run: %s", argv[0], exc)
        return None
    if done.returncode != 0:
        log.debug("%s exited %d: %s", argv[0], done.returncode, done.stderr.strip()[:300])
    return ToolResult(done.returncode, done.stdout, done.stderr)


def _output(run: CommandRunner, argv: Sequence[str]) -> str:
    """stdout of a successful run, else ``""``."""
    result = run(argv)
    return result.stdout if result is not None and result.ok else ""


# ------------------------------------------------------------------------------ GPUs


def _nvidia_smi(run: CommandRunner) -> list[GpuDevice]:
    """The GPUs ``nvidia-smi`` lists, with the driver's CUDA version from its banner."""
    gpus = _nvidia_smi_query(run)
    if not gpus:
        return []
    return nvidia.with_cuda_version(
        gpus, nvidia.parse_cuda_version(_output(run, nvidia.SMI_BANNER))
    )


def _nvidia_smi_query(run: CommandRunner) -> list[GpuDevice]:
    result = run(nvidia.smi_command(nvidia.SMI_FIELDS))
    if result is None:
        return []
    if not result.ok and nvidia.rejects_field(result.stdout + result.stderr):
        log.debug("nvidia-smi: old driver without compute_cap; asking again without it")
        return nvidia.parse_nvidia_smi_csv(
            _output(run, nvidia.smi_command(nvidia.SMI_FIELDS_LEGACY)), nvidia.SMI_FIELDS_LEGACY
        )
    return nvidia.parse_nvidia_smi_csv(result.stdout) if result.ok else []


def _amd(run: CommandRunner) -> list[GpuDevice]:
    static = _output(run, amd.AMD_SMI_STATIC)
    if static:
        devices = amd.parse_amd_smi(static, _output(run, amd.AMD_SMI_METRIC))
        if devices:
            return devices
    return amd.parse_rocm_smi_json(_output(run, amd.ROCM_SMI))


def _darwin_sysctl(run: CommandRunner) -> dict[str, str]:
    values = cpu.parse_sysctl(_output(run, apple.SYSCTL))
    values.update(cpu.parse_sysctl(_output(run, apple.SYSCTL_WIRED_LIMIT)))
    return values


def _apple(run: CommandRunner, sysctl: Mapping[str, str]) -> list[GpuDevice]:
    displays = _output(run, apple.SYSTEM_PROFILER)
    if not displays:
        return []
    return apple.parse_apple_gpu(displays, sysctl, int(psutil.virtual_memory().available))


def _vulkan(run: CommandRunner) -> list[GpuDevice]:
    summary = _output(run, vulkan.VULKANINFO_SUMMARY)
    if not summary:
        return []
    return vulkan.vulkan_gpus(summary, _output(run, vulkan.VULKANINFO_FULL))


def _detect_gpus(
    run: CommandRunner,
    system: str,
    sysctl: Mapping[str, str],
    nvml: Callable[[], list[GpuDevice] | None],
) -> tuple[GpuDevice, ...]:
    probes: list[tuple[str, Callable[[], list[GpuDevice] | None]]] = [
        ("NVML", nvml),
        ("nvidia-smi", lambda: _nvidia_smi(run)),
        ("amd-smi/rocm-smi", lambda: _amd(run)),
    ]
    if system == "Darwin":
        probes.append(("Apple", lambda: _apple(run, sysctl)))
    probes.append(("vulkaninfo", lambda: _vulkan(run)))
    for source, probe in probes:
        gpus = probe()
        if gpus:
            log.info("found %d GPU(s) with %s: %s", len(gpus), source, [g.name for g in gpus])
            return tuple(gpus)
    log.info("no GPU found; this worker runs on the CPU")
    return ()


# ------------------------------------------------------------------------------- CPU


def _cpu(system: str, sysctl: Mapping[str, str], cpuinfo_path: Path) -> CpuInfo:
    if system == "Darwin":
        model, features = cpu.parse_darwin_cpu(sysctl)
    else:
        try:
            text = cpuinfo_path.read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            log.debug("%s: unreadable: %s", cpuinfo_path, exc)
            text = ""
        model, features = cpu.parse_proc_cpuinfo(text)
    return CpuInfo(
        model=model or platform.processor() or platform.machine() or "unknown CPU",
        logical_cores=psutil.cpu_count() or os.cpu_count() or 1,
        physical_cores=psutil.cpu_count(logical=False),
        arch=platform.machine(),
        features=features,
    )


def detect_machine(
    run: CommandRunner = run_tool,
    *,
    system: str | None = None,
    nvml: Callable[[], list[GpuDevice] | None] = nvidia.from_nvml,
    cpuinfo_path: Path = PROC_CPUINFO,
) -> MachineProfile:
    """This machine's CPU, RAM and GPUs. Never raises for a missing or broken tool.

    ``system`` (``platform.system()`` by default), ``nvml`` and ``cpuinfo_path`` exist so
    tests can replay recorded outputs of another kind of machine.
    """
    system = system or platform.system()
    sysctl = _darwin_sysctl(run) if system == "Darwin" else {}
    memory = psutil.virtual_memory()
    return MachineProfile(
        hostname=socket.gethostname(),
        os=f"{system} {platform.release()} {platform.machine()}",
        cpu=_cpu(system, sysctl, cpuinfo_path),
        ram_total_bytes=int(memory.total),
        ram_available_bytes=int(memory.available),
        gpus=_detect_gpus(run, system, sysctl, nvml),
    )


# ---------------------------------------------------------------------- free memory


def _cuda_free(
    run: CommandRunner, nvml_free: Callable[[], dict[int, int] | None]
) -> dict[int, int]:
    free = nvml_free()
    if free is not None:
        return free
    rows = nvidia.parse_nvidia_smi_csv(
        _output(run, nvidia.smi_command(nvidia.SMI_FREE_FIELDS)), nvidia.SMI_FREE_FIELDS
    )
    return {g.index: g.memory_free_bytes for g in rows if g.memory_free_bytes is not None}


def _rocm_free(run: CommandRunner) -> dict[int, int]:
    memory = amd.parse_amd_smi_memory(_output(run, amd.AMD_SMI_METRIC))
    free = {index: f for index, (_, f) in memory.items() if f is not None}
    if free:
        return free
    devices = amd.parse_rocm_smi_json(_output(run, amd.ROCM_SMI))
    return {g.index: g.memory_free_bytes for g in devices if g.memory_free_bytes is not None}


def _free_by_index(
    profile: MachineProfile,
    run: CommandRunner,
    ram_available: int,
    nvml_free: Callable[[], dict[int, int] | None],
) -> dict[int, int]:
    accelerator = profile.accelerator
    if accelerator is Accelerator.CUDA:
        return _cuda_free(run, nvml_free)
    if accelerator is Accelerator.ROCM:
        return _rocm_free(run)
    if accelerator is Accelerator.METAL:
        return {g.index: min(g.memory_total_bytes, ram_available) for g in profile.gpus}
    return {}  # Vulkan: the heaps' budget needs the full vulkaninfo; keep the last value


def refresh_free_memory(
    profile: MachineProfile,
    run: CommandRunner = run_tool,
    *,
    nvml_free: Callable[[], dict[int, int] | None] = nvidia.nvidia_free_bytes,
    measured: Mapping[int, int] | None = None,
) -> MachineProfile:
    """``profile`` with current available RAM and GPU free memory (cheap; for heartbeats).

    ``measured``: free memory per GPU index the caller just read (GPU telemetry); when it
    covers every GPU no tool is asked again. GPUs the tools no longer report keep their
    previous free value.
    """
    ram_available = int(psutil.virtual_memory().available)
    indices = {g.index for g in profile.gpus}
    if measured is not None and indices and indices <= measured.keys():
        free = dict(measured)
    else:
        free = _free_by_index(profile, run, ram_available, nvml_free) if profile.gpus else {}
    gpus = tuple(
        dataclasses.replace(g, memory_free_bytes=free.get(g.index, g.memory_free_bytes))
        for g in profile.gpus
    )
    return dataclasses.replace(profile, ram_available_bytes=ram_available, gpus=gpus)


# ------------------------------------------------------------------- --gpu-devices


NO_GPUS = "none"
"""``--gpu-devices none``: this worker uses no GPU of its machine."""


def parse_gpu_devices(text: str) -> tuple[int, ...]:
    """GPU indices from a ``--gpu-devices 0,1`` value, in the order given; ``none``: no GPU
    (the worker computes on the CPU, as on a machine without one).

    Raises ValueError with a message that says what a valid value looks like.
    """
    hint = (
        "give comma-separated GPU indices such as 0,1 (the worker log lists this machine's), "
        "or none for the CPU only"
    )
    if text.strip().lower() == NO_GPUS:
        return ()
    parts = [p.strip() for p in text.split(",")]
    if not text.strip():
        raise ValueError(f"--gpu-devices is empty; {hint}")
    indices: list[int] = []
    for part in parts:
        if not part.isdigit():
            raise ValueError(f"--gpu-devices {text!r}: {part!r} is not a GPU index; {hint}")
        index = int(part)
        if index in indices:
            raise ValueError(f"--gpu-devices {text!r}: GPU {index} is listed twice; {hint}")
        indices.append(index)
    return tuple(indices)


def device_name(gpu: GpuDevice) -> str:
    """llama.cpp's name for ``gpu`` (``CUDA0``, ``ROCm1``, ``Vulkan0``, ``MTL0``)."""
    prefix = DEVICE_PREFIX.get(gpu.accelerator)
    if prefix is None:
        raise ValueError(f"{gpu.name} is driven by {gpu.accelerator}, which is not a GPU backend")
    return f"{prefix}{gpu.index}"


def tensor_split(gpus: Sequence[GpuDevice]) -> tuple[int, ...]:
    """Whole-number proportions of each GPU's usable memory (MiB), reduced: 24G/8G -> (3, 1).

    When any GPU's memory is unknown (0) the split is even, since no proportion is known.
    """
    mib = [g.usable_bytes >> 20 for g in gpus]
    if any(m <= 0 for m in mib):
        log.warning("GPU memory unknown for some of %s; splitting evenly", [g.name for g in gpus])
        return tuple(1 for _ in gpus)
    divisor = math.gcd(*mib)
    return tuple(m // divisor for m in mib)


def split_args(gpus: Sequence[GpuDevice], split_mode: str = "layer") -> tuple[str, ...]:
    """llama-server arguments that run the model on exactly ``gpus``, in that order.

    One GPU: ``--device X --split-mode none --main-gpu 0``. Several: ``--device X,Y
    --split-mode <mode>`` plus ``--tensor-split`` in proportion to usable (free) memory (or
    ``--main-gpu 0`` for ``none``, which uses the first only). No GPUs: ``--device none``.
    """
    if split_mode not in SPLIT_MODES:
        raise ValueError(f"split mode {split_mode!r} is not one of {', '.join(SPLIT_MODES)}")
    if not gpus:
        return ("--device", "none")
    names = [device_name(g) for g in gpus]
    if len(set(names)) != len(names):
        raise ValueError(f"a GPU is listed twice: {', '.join(names)}")
    devices = ("--device", ",".join(names))
    if len(gpus) == 1 or split_mode == "none":
        return (*devices, "--split-mode", "none", "--main-gpu", "0")
    ratios = ",".join(str(r) for r in tensor_split(gpus))
    return (*devices, "--split-mode", split_mode, "--tensor-split", ratios)


def device_env(gpus: Sequence[GpuDevice]) -> dict[str, str]:
    """Environment llama-server needs for ``split_args`` names to mean these GPUs.

    CUDA numbers devices fastest-first by default; PCI bus order matches NVML/nvidia-smi.
    """
    if any(g.accelerator is Accelerator.CUDA for g in gpus):
        return {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}
    return {}


def gpu_labels(profile: MachineProfile) -> tuple[str, ...]:
    """One line per GPU for operators, e.g. ``CUDA0 NVIDIA A10 (22.5 of 23.9 GiB free)``."""
    labels = []
    for g in profile.gpus:
        total = g.memory_total_bytes / (1 << 30)
        if not g.memory_total_bytes:
            memory = "memory unknown"
        elif g.memory_free_bytes is None:
            memory = f"{total:.1f} GiB"
        else:
            memory = f"{g.memory_free_bytes / (1 << 30):.1f} of {total:.1f} GiB free"
        labels.append(f"{device_name(g)} {g.name} ({memory})")
    return tuple(labels)
