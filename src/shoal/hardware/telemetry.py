"""GPU telemetry for heartbeats: each GPU's utilization, memory, temperature and power.

``sampler_for`` chooses one sampler per vendor, once, from the GPUs detection found:

* NVIDIA: NVML (``nvidia-ml-py``), initialised on the first sample and kept for the life of
  the process, each GPU's handle looked up once; ``nvidia-smi``'s CSV when NVML is unusable.
* AMD: ``amd-smi metric`` JSON, else ``rocm-smi`` JSON (the one that answered is asked first
  next time), as subprocesses with ``detect.TOOL_TIMEOUT_S``.
* Apple, Vulkan, and a machine with no GPU: nothing is sampled and nothing runs.

``sample()`` blocks (NVML calls, subprocesses): the worker calls it in a thread. It does not
raise for a missing or failing tool or GPU: a GPU NVML cannot read gives the readings it
could get (the rest None), a tool that fails gives ``()``. The samples cover exactly the
detected GPUs, in their order, with the detected name and UUID where the tool gives none.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from shoal.hardware import amd, nvidia
from shoal.hardware.detect import CommandRunner, run_tool
from shoal.hardware.profile import Accelerator, GpuDevice
from shoal.protocol.telemetry import GpuSample

log = logging.getLogger(__name__)


class GpuSampler(Protocol):
    def sample(self) -> tuple[GpuSample, ...]:
        """Each GPU now; blocking, so call it in a thread. Never raises for a broken tool."""
        ...


class NoGpus:
    """No GPU, or none with a telemetry tool here (Apple, Vulkan): nothing to read."""

    def sample(self) -> tuple[GpuSample, ...]:
        return ()


NO_GPUS = NoGpus()


def _stdout(run: CommandRunner, argv: Sequence[str]) -> str:
    result = run(argv)
    return result.stdout if result is not None and result.ok else ""


class NvidiaSmiSampler:
    """``nvidia-smi --query-gpu=...`` CSV, for machines where NVML is unusable."""

    def __init__(self, run: CommandRunner = run_tool) -> None:
        self.run = run

    def sample(self) -> tuple[GpuSample, ...]:
        command = nvidia.smi_command(nvidia.SMI_TELEMETRY_FIELDS)
        return nvidia.parse_nvidia_smi_telemetry(_stdout(self.run, command))


class NvmlSampler:
    """NVML, initialised once and kept; each GPU's handle and identity cached."""

    def __init__(
        self,
        indices: Sequence[int],
        fallback: GpuSampler,
        load: Callable[[], Any] = nvidia.load_nvml,
    ) -> None:
        """``indices``: NVML's indices of the GPUs to read; ``fallback``: what to read when
        NVML cannot be initialised (``load`` returns None)."""
        self.indices = tuple(indices)
        self.fallback = fallback
        self._load = load
        self._nvml: Any = None
        self._loaded = False
        self._gpus: dict[int, nvidia.NvmlGpu] = {}

    def sample(self) -> tuple[GpuSample, ...]:
        if not self._loaded:
            self._loaded = True
            self._nvml = self._load()
            if self._nvml is None:
                log.info("NVML is unusable here; GPU telemetry comes from nvidia-smi")
        if self._nvml is None:
            return self.fallback.sample()
        return tuple(self._one(self._nvml, index) for index in self.indices)

    def _one(self, nvml: Any, index: int) -> GpuSample:
        gpu = self._gpus.get(index)
        if gpu is None:
            gpu = nvidia.nvml_gpu(nvml, index)
            if gpu is None:  # no handle (yet): asked again next time
                return GpuSample(index=index)
            self._gpus[index] = gpu
        return nvidia.nvml_sample(nvml, index, gpu)


class AmdSampler:
    """``amd-smi metric`` JSON, else ``rocm-smi`` JSON; whichever answered goes first next."""

    def __init__(self, run: CommandRunner = run_tool) -> None:
        self.run = run
        self._tools: list[tuple[tuple[str, ...], Callable[[str], tuple[GpuSample, ...]]]] = [
            (amd.AMD_SMI_TELEMETRY, amd.parse_amd_smi_telemetry),
            (amd.ROCM_SMI_TELEMETRY, amd.parse_rocm_smi_telemetry),
        ]

    def sample(self) -> tuple[GpuSample, ...]:
        for position, (command, parse) in enumerate(self._tools):
            samples = parse(_stdout(self.run, command))
            if samples:
                if position:
                    self._tools.insert(0, self._tools.pop(position))
                return samples
        return ()


class DetectedGpus:
    """A vendor sampler's readings for exactly the detected GPUs, in their order, named as
    detection named them when the tool gives no name or UUID."""

    def __init__(self, vendor: GpuSampler, gpus: Sequence[GpuDevice]) -> None:
        self.vendor = vendor
        self.gpus = tuple(gpus)

    def sample(self) -> tuple[GpuSample, ...]:
        read = {s.index: s for s in self.vendor.sample()}
        return tuple(_identified(read[g.index], g) for g in self.gpus if g.index in read)


def _identified(sample: GpuSample, gpu: GpuDevice) -> GpuSample:
    missing = {k: v for k, v in (("name", gpu.name), ("uuid", gpu.uuid)) if not getattr(sample, k)}
    return sample.model_copy(update=missing) if missing else sample


def sampler_for(
    gpus: Sequence[GpuDevice],
    run: CommandRunner = run_tool,
    load_nvml: Callable[[], Any] = nvidia.load_nvml,
) -> GpuSampler:
    """The sampler for these GPUs (a machine's, all driven by one backend): NVML with
    ``nvidia-smi`` behind it for CUDA, amd-smi/rocm-smi for ROCm, nothing otherwise.
    Nothing runs until the first ``sample()``."""
    accelerator = gpus[0].accelerator if gpus else Accelerator.CPU
    vendor: GpuSampler
    if accelerator is Accelerator.CUDA:
        indices = [g.index for g in gpus]
        vendor = NvmlSampler(indices, NvidiaSmiSampler(run), load_nvml)
    elif accelerator is Accelerator.ROCM:
        vendor = AmdSampler(run)
    else:
        return NO_GPUS
    return DetectedGpus(vendor, gpus)


def free_bytes(samples: Sequence[GpuSample]) -> dict[int, int]:
    """Free memory per GPU index, where a sample knows it (``detect.refresh_free_memory``)."""
    return {s.index: free for s in samples if (free := s.memory_free_bytes) is not None}
