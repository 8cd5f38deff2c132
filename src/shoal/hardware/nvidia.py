"""NVIDIA GPUs: NVML through ``nvidia-ml-py`` first, ``nvidia-smi`` CSV when NVML is absent.

Index mapping: NVML and ``nvidia-smi`` both number GPUs in PCI bus order. CUDA numbers them
fastest-first unless ``CUDA_DEVICE_ORDER=PCI_BUS_ID``; llama-server must run with that
variable set (and ``CUDA_VISIBLE_DEVICES`` unset) for ``CUDA<n>`` to be the GPU this module
calls index ``n`` (see ``detect.device_env``).

The ``nvidia-smi`` query keeps its CSV header (``--format=csv,nounits``): the parser maps
columns by name, so the same parser reads the full query, the retry without ``compute_cap``
(drivers before 510 reject that field), the cheap free-memory query, and any recorded output
whatever its column order. Text without a header is read with the caller's field list.
Unknown values (``[N/A]``, ``[Not Supported]``, ...) become 0 for totals (0 means unknown, as
everywhere in ``shoal.hardware``) and None for free memory.

The CUDA version the driver supports is not a query field: NVML answers
``nvmlSystemGetCudaDriverVersion``, ``nvidia-smi`` prints it in its banner, ``CUDA Version:
13.0`` up to driver 580 and ``CUDA UMD Version: 13.3`` from driver 610 on (the R610 release
renamed it; ``nvidia-smi -q`` prints both spellings with spaces before the colon).

Telemetry (``hardware.telemetry``): ``nvml_sample`` reads one GPU through a handle NVML gave
once (``nvml_gpu``), each reading on its own, so one NVML refuses (``NotSupported``, a GPU
lost) is None and the others stay; ``parse_nvidia_smi_telemetry`` reads the same from
``nvidia-smi`` CSV when NVML is unusable.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shoal.hardware.profile import Accelerator, GpuDevice
from shoal.protocol.telemetry import GpuSample

log = logging.getLogger(__name__)

MIB = 1024 * 1024

SMI_FIELDS = (
    "index",
    "name",
    "uuid",
    "memory.total",
    "memory.free",
    "driver_version",
    "compute_cap",
)
"""What ``nvidia-smi`` is asked for; ``compute_cap`` needs driver 510 or newer."""

SMI_FIELDS_LEGACY = SMI_FIELDS[:-1]
"""The retry for older drivers, which answer ``Field "compute_cap" is not a valid field``."""

SMI_FREE_FIELDS = ("index", "memory.free")

SMI_BANNER = ("nvidia-smi",)
"""``nvidia-smi`` alone: its banner names the driver and the CUDA version it supports."""

_CUDA_VERSION = re.compile(r"CUDA(?: UMD)? Version\s*:\s*(\d+)\.(\d+)")

SMI_TELEMETRY_FIELDS = (
    "index",
    "uuid",
    "name",
    "utilization.gpu",
    "memory.used",
    "memory.total",
    "temperature.gpu",
    "power.draw",
    "power.limit",
)
"""What ``nvidia-smi`` is asked for heartbeats when NVML is unusable (every driver knows them)."""

_ALIASES = {"gpu_name": "name", "gpu_uuid": "uuid", "gpu_index": "index"}
_UNKNOWN_PREFIX = ("[", "N/A")


def smi_command(fields: Sequence[str] = SMI_FIELDS) -> tuple[str, ...]:
    """The ``nvidia-smi`` command line that queries ``fields`` (CSV with header, no units)."""
    return ("nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,nounits")


def rejects_field(output: str) -> bool:
    """True when ``nvidia-smi`` refused a query field (old driver): retry without it."""
    return "is not a valid field to query" in output


def _column(header_cell: str) -> str:
    name = header_cell.strip().split(" [", 1)[0].strip()
    return _ALIASES.get(name, name)


def _header(cells: Sequence[str]) -> list[str] | None:
    columns = [_column(c) for c in cells]
    return columns if "name" in columns or "index" in columns else None


def _unknown(cell: str) -> bool:
    return not cell or cell.startswith(_UNKNOWN_PREFIX)


def _mib(cell: str) -> int | None:
    """MiB as bytes; None for ``[N/A]`` and other placeholders or garbage."""
    cell = cell.strip().removesuffix("MiB").strip()
    if _unknown(cell):
        return None
    try:
        mib = float(cell)
    except ValueError:
        return None
    return int(mib * MIB) if math.isfinite(mib) else None


def _text(row: Mapping[str, str], key: str) -> str:
    value = row.get(key, "").strip()
    return "" if _unknown(value) else value


def _free(row: Mapping[str, str], total: int | None) -> int | None:
    free = _mib(row.get("memory.free", ""))
    if free is not None:
        return free
    used = _mib(row.get("memory.used", ""))
    return total - used if total is not None and used is not None else None


def _index(row: Mapping[str, str], position: int) -> int:
    text = _text(row, "index")
    return int(text) if text.isdigit() else position


def _device(row: Mapping[str, str], position: int) -> GpuDevice:
    total = _mib(row.get("memory.total", ""))
    return GpuDevice(
        index=_index(row, position),
        name=_text(row, "name") or f"NVIDIA GPU {position}",
        accelerator=Accelerator.CUDA,
        memory_total_bytes=total or 0,
        memory_free_bytes=_free(row, total),
        uuid=_text(row, "uuid"),
        driver=_text(row, "driver_version"),
        compute_capability=_text(row, "compute_cap"),
    )


def _rows(text: str, fields: Sequence[str]) -> list[tuple[int, dict[str, str]]]:
    """``(position, column -> cell)`` per row of ``--format=csv`` output; a header line, when
    present, names the columns, otherwise ``fields`` does. Rows whose cell count does not
    match are skipped (logged at debug)."""
    lines = [line for line in text.splitlines() if line.strip()]
    if not lines:
        return []
    columns = _header(lines[0].split(","))
    if columns is None:
        columns = [_column(f) for f in fields]
    else:
        lines = lines[1:]
    rows = []
    for position, line in enumerate(lines):
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(columns):
            log.debug("nvidia-smi: skipping row %r (expected %d columns)", line, len(columns))
            continue
        rows.append((position, dict(zip(columns, cells, strict=True))))
    return rows


def parse_nvidia_smi_csv(text: str, fields: Sequence[str] = SMI_FIELDS) -> list[GpuDevice]:
    """GPUs in ``nvidia-smi --query-gpu=... --format=csv[,noheader][,nounits]`` output.

    A header line, when present, names the columns; otherwise ``fields`` does (the query's
    field list, in order). Rows whose cell count does not match are skipped (logged at
    debug), so error text, empty output and garbage give ``[]``. Sorted by index.
    """
    devices = [_device(row, position) for position, row in _rows(text, fields)]
    return sorted(devices, key=lambda d: d.index)


def parse_cuda_version(text: str) -> str:
    """The CUDA version in ``nvidia-smi``'s banner (or ``-q``), as ``13.0``; "" if none."""
    match = _CUDA_VERSION.search(text)
    return f"{int(match.group(1))}.{int(match.group(2))}" if match else ""


def with_cuda_version(devices: list[GpuDevice], cuda_version: str) -> list[GpuDevice]:
    """``devices`` with the driver's CUDA version filled in (it is the same for every GPU)."""
    return [dataclasses.replace(d, cuda_version=cuda_version) for d in devices]


def _quantity(cell: str) -> float | None:
    """``"61"``, ``"100 %"``, ``"120.50 W"`` as a finite number; None for placeholders."""
    number = cell.strip().split(" ", 1)[0]
    if _unknown(number):
        return None
    try:
        value = float(number)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def _telemetry(row: Mapping[str, str], position: int) -> GpuSample:
    return GpuSample(
        index=_index(row, position),
        uuid=_text(row, "uuid"),
        name=_text(row, "name"),
        utilization_percent=_quantity(row.get("utilization.gpu", "")),
        memory_used_bytes=_mib(row.get("memory.used", "")),
        memory_total_bytes=_mib(row.get("memory.total", "")),
        temperature_celsius=_quantity(row.get("temperature.gpu", "")),
        power_watts=_quantity(row.get("power.draw", "")),
        power_limit_watts=_quantity(row.get("power.limit", "")),
    )


def parse_nvidia_smi_telemetry(
    text: str, fields: Sequence[str] = SMI_TELEMETRY_FIELDS
) -> tuple[GpuSample, ...]:
    """Each GPU's telemetry in ``nvidia-smi --query-gpu=...`` CSV (any column order, with or
    without header and units, as ``parse_nvidia_smi_csv``); a column the query lacks, or a
    ``[N/A]`` cell, is None. Sorted by index; ``()`` for error text or garbage."""
    samples = [_telemetry(row, position) for position, row in _rows(text, fields)]
    return tuple(sorted(samples, key=lambda s: s.index))


# ----------------------------------------------------------------------------- NVML


def _decode(value: Any) -> str:
    """NVML strings are ``bytes`` in old bindings and ``str`` in new ones."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _nvml_memory(nvml: Any, handle: Any) -> tuple[int, int | None]:
    try:
        info = nvml.nvmlDeviceGetMemoryInfo(handle)
    except nvml.NVMLError as exc:  # e.g. NotSupported on unified-memory parts (GB10)
        log.debug("NVML: no memory info: %s", exc)
        return 0, None
    return int(info.total), int(info.free)


def _nvml_capability(nvml: Any, handle: Any) -> str:
    try:
        major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
    except nvml.NVMLError:
        return ""
    return f"{int(major)}.{int(minor)}"


def _nvml_cuda_version(nvml: Any) -> str:
    """The driver's CUDA version (``13000`` is ``13.0``); "" when NVML cannot say."""
    try:
        version = int(nvml.nvmlSystemGetCudaDriverVersion())
    except (nvml.NVMLError, AttributeError) as exc:  # AttributeError: bindings without it
        log.debug("NVML: no CUDA driver version: %s", exc)
        return ""
    return f"{version // 1000}.{version % 1000 // 10}" if version > 0 else ""


def _nvml_device(nvml: Any, index: int, driver: str, cuda_version: str) -> GpuDevice:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    total, free = _nvml_memory(nvml, handle)
    return GpuDevice(
        index=index,
        name=_decode(nvml.nvmlDeviceGetName(handle)),
        accelerator=Accelerator.CUDA,
        memory_total_bytes=total,
        memory_free_bytes=free,
        uuid=_decode(nvml.nvmlDeviceGetUUID(handle)),
        driver=driver,
        compute_capability=_nvml_capability(nvml, handle),
        cuda_version=cuda_version,
    )


def load_nvml() -> Any:
    """The initialised ``pynvml`` module, or None when the library or the driver is absent."""
    try:
        import pynvml
    except ImportError:
        log.debug("NVML: nvidia-ml-py is not installed")
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:  # no libnvidia-ml.so, no driver, no device
        log.debug("NVML: not available: %s", exc)
        return None
    return pynvml


def _shutdown(nvml: Any) -> None:
    try:
        nvml.nvmlShutdown()
    except nvml.NVMLError as exc:
        log.debug("NVML: shutdown failed: %s", exc)


def from_nvml() -> list[GpuDevice] | None:
    """Every NVIDIA GPU as NVML sees it; None when NVML is unusable (then try nvidia-smi)."""
    nvml = load_nvml()
    if nvml is None:
        return None
    try:
        driver = _decode(nvml.nvmlSystemGetDriverVersion())
        cuda = _nvml_cuda_version(nvml)
        count = int(nvml.nvmlDeviceGetCount())
        return [_nvml_device(nvml, i, driver, cuda) for i in range(count)]
    except nvml.NVMLError as exc:
        log.debug("NVML: query failed: %s", exc)
        return None
    finally:
        _shutdown(nvml)


def nvidia_free_bytes() -> dict[int, int] | None:
    """Free memory per GPU index through NVML (cheap, for heartbeats); None without NVML."""
    devices = from_nvml()
    if devices is None:
        return None
    return {d.index: d.memory_free_bytes for d in devices if d.memory_free_bytes is not None}


# ------------------------------------------------------------------ NVML telemetry

MW_PER_W = 1000


@dataclass(frozen=True)
class NvmlGpu:
    """A GPU's NVML handle and identity, looked up once and kept (they do not change)."""

    handle: Any
    name: str
    uuid: str


def _nvml_read(nvml: Any, call: Callable[..., Any], *args: Any) -> Any:
    """``call(*args)``, or None when NVML cannot say (NotSupported, GPU lost, ...)."""
    try:
        return call(*args)
    except nvml.NVMLError as exc:
        log.debug("NVML: %s failed: %s", getattr(call, "__name__", call), exc)
        return None


def _nvml_text(nvml: Any, call: Callable[..., Any], handle: Any) -> str:
    value = _nvml_read(nvml, call, handle)
    return "" if value is None else _decode(value)


def nvml_gpu(nvml: Any, index: int) -> NvmlGpu | None:
    """GPU ``index``'s handle, name and UUID; None when NVML cannot give its handle."""
    handle = _nvml_read(nvml, nvml.nvmlDeviceGetHandleByIndex, index)
    if handle is None:
        return None
    return NvmlGpu(
        handle=handle,
        name=_nvml_text(nvml, nvml.nvmlDeviceGetName, handle),
        uuid=_nvml_text(nvml, nvml.nvmlDeviceGetUUID, handle),
    )


def _watts(milliwatts: Any) -> float | None:
    return None if milliwatts is None else int(milliwatts) / MW_PER_W


def nvml_sample(nvml: Any, index: int, gpu: NvmlGpu) -> GpuSample:
    """GPU ``index`` now, through its cached handle; a reading NVML refuses is None."""
    handle = gpu.handle
    memory = _nvml_read(nvml, nvml.nvmlDeviceGetMemoryInfo, handle)
    rates = _nvml_read(nvml, nvml.nvmlDeviceGetUtilizationRates, handle)
    celsius = _nvml_read(nvml, nvml.nvmlDeviceGetTemperature, handle, nvml.NVML_TEMPERATURE_GPU)
    return GpuSample(
        index=index,
        uuid=gpu.uuid,
        name=gpu.name,
        utilization_percent=None if rates is None else float(rates.gpu),
        memory_used_bytes=None if memory is None else int(memory.used),
        memory_total_bytes=None if memory is None else int(memory.total),
        temperature_celsius=None if celsius is None else float(celsius),
        power_watts=_watts(_nvml_read(nvml, nvml.nvmlDeviceGetPowerUsage, handle)),
        power_limit_watts=_watts(_nvml_read(nvml, nvml.nvmlDeviceGetEnforcedPowerLimit, handle)),
    )
