"""The hardware vocabulary: what detectors produce and decisions (fit, splits) consume.

Plain frozen dataclasses, no I/O. ``protocol.messages.Hardware`` is the wire form.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Accelerator(enum.StrEnum):
    """The llama.cpp backend a device is driven by."""

    CUDA = "cuda"
    ROCM = "rocm"
    METAL = "metal"
    VULKAN = "vulkan"
    CPU = "cpu"


@dataclass(frozen=True)
class GpuDevice:
    """One GPU as its vendor tool reports it.

    ``index`` is the tool's device index (what ``--gpu-devices`` names). ``memory_free_bytes``
    is None when the tool cannot say (e.g. ``vulkaninfo --summary``); decisions then use the
    total. ``unified_memory`` is True when the GPU shares system RAM (Apple Silicon).
    """

    index: int
    name: str
    accelerator: Accelerator
    memory_total_bytes: int
    memory_free_bytes: int | None = None
    uuid: str = ""
    driver: str = ""
    compute_capability: str = ""
    cuda_version: str = ""
    """NVIDIA: the newest CUDA version the driver supports (``13.0``; NVML, else the banner
    of ``nvidia-smi``), which decides the llama.cpp CUDA builds that run here; "" unknown."""
    unified_memory: bool = False

    @property
    def usable_bytes(self) -> int:
        """Free memory when known, else the total."""
        return self.memory_total_bytes if self.memory_free_bytes is None else self.memory_free_bytes


@dataclass(frozen=True)
class CpuInfo:
    """The CPU: model name, cores and the instruction sets llama.cpp cares about."""

    model: str
    logical_cores: int
    physical_cores: int | None = None
    arch: str = ""
    """``x86_64``, ``aarch64``, ``arm64``."""
    features: tuple[str, ...] = ()
    """Lower-case flags such as ``avx2``, ``avx512f``, ``f16c``, ``fma``, ``neon``, ``sve``."""


@dataclass(frozen=True)
class MachineProfile:
    """Everything the fit and split decisions need to know about one machine."""

    hostname: str
    os: str
    cpu: CpuInfo
    ram_total_bytes: int
    ram_available_bytes: int
    gpus: tuple[GpuDevice, ...] = ()

    @property
    def accelerator(self) -> Accelerator:
        """The backend of the first GPU (all of a machine's GPUs normally share one), or CPU."""
        return self.gpus[0].accelerator if self.gpus else Accelerator.CPU

    def select(self, indices: tuple[int, ...] | None) -> MachineProfile:
        """This machine restricted to the GPUs with these tool indices (None: all)."""
        if indices is None:
            return self
        by_index = {g.index: g for g in self.gpus}
        missing = [i for i in indices if i not in by_index]
        if missing:
            have = ", ".join(str(g.index) for g in self.gpus) or "none"
            raise ValueError(
                f"GPU device(s) {', '.join(map(str, missing))} not found; this machine has: {have}"
            )
        return MachineProfile(
            hostname=self.hostname,
            os=self.os,
            cpu=self.cpu,
            ram_total_bytes=self.ram_total_bytes,
            ram_available_bytes=self.ram_available_bytes,
            gpus=tuple(by_index[i] for i in indices),
        )
