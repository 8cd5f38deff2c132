"""A FAKE of ``pynvml`` (nvidia-ml-py) for machines without an NVIDIA GPU or driver.

No machine here has an NVIDIA GPU, so NVML cannot run; this stands in for it with the calls
Shoal makes (``hardware.nvidia``): init and shutdown, the driver version and the CUDA version
it supports (``nvmlSystemGetCudaDriverVersion``, absent from old bindings), the device count,
handles by index, name, UUID, memory, compute capability, utilization, temperature, power
and the enforced power limit. A reading given as None raises ``NVMLError`` ("Not
Supported"), as NVML does for a field a GPU lacks.

Two ways to use it:

* In process: ``FakeNvml(gpus, ...)`` is a stand-in module object;
  ``monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(...))``.
* In a real worker process: put this folder first on its ``PYTHONPATH`` (``worker_env`` in
  this package's ``__init__``); its ``import pynvml`` then finds this file, whose module-level
  functions answer from the machine in ``FAKE_NVML_MACHINE`` (a JSON file; by default
  ``h100x2.json`` beside this file, values transcribed from a recorded ``nvidia-smi``, see
  ``tests/hardware/fixtures/SOURCES.md``).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

DEFAULT_MACHINE = Path(__file__).parent / "h100x2.json"
MIB = 1 << 20

NVML_TEMPERATURE_GPU = 0


class NVMLError(Exception):
    """Stands in for ``pynvml.NVMLError``."""


@dataclass
class FakeGpu:
    """One GPU's answers; None: NVML says "Not Supported" for it."""

    name: str
    uuid: str
    memory_total: int | None
    memory_used: int | None
    utilization: int | None = None
    temperature: int | None = None
    power_mw: int | None = None
    power_limit_mw: int | None = None
    compute_capability: tuple[int, int] = (9, 0)


def _known(value: Any) -> Any:
    if value is None:
        raise NVMLError("Not Supported")
    return value


class FakeNvml:
    """A machine's NVML: a stand-in for the ``pynvml`` module. ``calls`` records init and
    shutdown; ``bytes_names``: names and UUIDs come back as bytes (old bindings);
    ``cuda_driver_version``: what ``nvmlSystemGetCudaDriverVersion`` answers (NVML's integer,
    ``12040`` for 12.4) or raises (an exception), or None for bindings without that call (the
    attribute is then absent, as in nvidia-ml-py before it)."""

    NVMLError = NVMLError
    NVML_TEMPERATURE_GPU = NVML_TEMPERATURE_GPU

    def __init__(
        self,
        gpus: list[FakeGpu],
        driver: str = "550.90.07",
        *,
        fail_init: bool = False,
        bytes_names: bool = False,
        cuda_driver_version: int | Exception | None = None,
    ) -> None:
        self.gpus = gpus
        self.driver = driver
        self.fail_init = fail_init
        self.bytes_names = bytes_names
        self.calls: list[str] = []
        self.cuda_driver_version = cuda_driver_version
        if cuda_driver_version is not None:
            self.nvmlSystemGetCudaDriverVersion = self._cuda_driver_version

    @classmethod
    def from_file(cls, path: Path) -> FakeNvml:
        machine = json.loads(path.read_text(encoding="utf-8"))
        gpus = [_gpu(g) for g in machine["gpus"]]
        return cls(gpus, machine["driver"], cuda_driver_version=machine.get("cuda_driver_version"))

    def _text(self, text: str) -> str | bytes:
        return text.encode() if self.bytes_names else text

    def _gpu(self, handle: int) -> FakeGpu:
        if not 0 <= handle < len(self.gpus):
            raise NVMLError("Invalid Argument")
        return self.gpus[handle]

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.fail_init:
            raise NVMLError("NVML Shared Library Not Found")

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlSystemGetDriverVersion(self) -> str | bytes:
        return self._text(self.driver)

    def _cuda_driver_version(self) -> int:
        version = self.cuda_driver_version
        if isinstance(version, Exception):
            raise version
        assert version is not None  # the call exists only with a version
        return version

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self._gpu(index)
        return index

    def nvmlDeviceGetName(self, handle: int) -> str | bytes:
        return self._text(self._gpu(handle).name)

    def nvmlDeviceGetUUID(self, handle: int) -> str | bytes:
        return self._text(self._gpu(handle).uuid)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        gpu = self._gpu(handle)
        total, used = _known(gpu.memory_total), _known(gpu.memory_used)
        return SimpleNamespace(total=total, used=used, free=total - used)

    def nvmlDeviceGetCudaComputeCapability(self, handle: int) -> tuple[int, int]:
        return self._gpu(handle).compute_capability

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(gpu=_known(self._gpu(handle).utilization), memory=0)

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        if sensor != NVML_TEMPERATURE_GPU:
            raise NVMLError("Invalid Argument")
        return int(_known(self._gpu(handle).temperature))

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        return int(_known(self._gpu(handle).power_mw))

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: int) -> int:
        return int(_known(self._gpu(handle).power_limit_mw))


def _gpu(entry: dict[str, Any]) -> FakeGpu:
    """A GPU of a machine file (MiB, watts, as nvidia-smi shows them) in NVML's units."""
    return FakeGpu(
        name=entry["name"],
        uuid=entry["uuid"],
        memory_total=entry["memory_total_mib"] * MIB,
        memory_used=entry["memory_used_mib"] * MIB,
        utilization=entry["utilization_percent"],
        temperature=entry["temperature_celsius"],
        power_mw=entry["power_watts"] * 1000,
        power_limit_mw=entry["power_limit_watts"] * 1000,
        compute_capability=(entry["compute_capability"][0], entry["compute_capability"][1]),
    )


def load_machine() -> FakeNvml:
    """The machine a worker process given this fake sees (``FAKE_NVML_MACHINE``)."""
    return FakeNvml.from_file(Path(os.environ.get("FAKE_NVML_MACHINE", DEFAULT_MACHINE)))


# The module-level API ``import pynvml`` finds in a worker process given this folder.
_machine = load_machine()
nvmlInit = _machine.nvmlInit
nvmlShutdown = _machine.nvmlShutdown
nvmlSystemGetDriverVersion = _machine.nvmlSystemGetDriverVersion
if hasattr(_machine, "nvmlSystemGetCudaDriverVersion"):  # absent: a machine of old bindings
    nvmlSystemGetCudaDriverVersion = _machine.nvmlSystemGetCudaDriverVersion
nvmlDeviceGetCount = _machine.nvmlDeviceGetCount
nvmlDeviceGetHandleByIndex = _machine.nvmlDeviceGetHandleByIndex
nvmlDeviceGetName = _machine.nvmlDeviceGetName
nvmlDeviceGetUUID = _machine.nvmlDeviceGetUUID
nvmlDeviceGetMemoryInfo = _machine.nvmlDeviceGetMemoryInfo
nvmlDeviceGetCudaComputeCapability = _machine.nvmlDeviceGetCudaComputeCapability
nvmlDeviceGetUtilizationRates = _machine.nvmlDeviceGetUtilizationRates
nvmlDeviceGetTemperature = _machine.nvmlDeviceGetTemperature
nvmlDeviceGetPowerUsage = _machine.nvmlDeviceGetPowerUsage
nvmlDeviceGetEnforcedPowerLimit = _machine.nvmlDeviceGetEnforcedPowerLimit
