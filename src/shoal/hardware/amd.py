"""AMD GPUs from ``amd-smi`` JSON, falling back to ``rocm-smi`` JSON.

``amd-smi`` changed its JSON shape twice (read from the amdsmi CLI source at the ROCm tags):

* ROCm 6.0: a list of ``{"gpu": n, "asic": {...}, "vram": {"vram_size_mb": 8176}}``;
  ``metric`` memory values are bare MB integers (``"total_vram": 8176``).
* ROCm 6.1 - 6.3: the same list, but values carry units:
  ``"vram": {"size": {"value": 8176, "unit": "MB"}}`` and
  ``"total_vram": {"value": 8176, "unit": "MB"}``.
* Later releases wrap the list: ``{"gpu_data": [...]}``.

A single-GPU query (``-g 0``) may print one object instead of a list; that is accepted too.
amd-smi's "MB" is MiB (it divides bytes by 1024*1024). ``rocm-smi --json`` prints strings of
bytes under keys such as ``"VRAM Total Memory (B)"``.

Index mapping: the ``gpu`` number of amd-smi and the ``cardN`` key of rocm-smi (its device
index, not the DRM card number) follow the KFD/PCI enumeration that HIP uses when
``HIP_VISIBLE_DEVICES``/``ROCR_VISIBLE_DEVICES`` are unset, so index ``n`` is ``ROCm<n>`` in
llama.cpp. An APU whose iGPU is enumerated by HIP shifts that numbering; we assume it is not.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Mapping
from typing import Any

from shoal.hardware.profile import Accelerator, GpuDevice
from shoal.protocol.telemetry import GpuSample

log = logging.getLogger(__name__)

AMD_SMI_STATIC = ("amd-smi", "static", "--asic", "--vram", "--driver", "--json")
AMD_SMI_METRIC = ("amd-smi", "metric", "--mem-usage", "--json")
ROCM_SMI = ("rocm-smi", "--showproductname", "--showmeminfo", "vram", "--json")
AMD_SMI_TELEMETRY = (
    "amd-smi",
    "metric",
    "--usage",
    "--power",
    "--temperature",
    "--mem-usage",
    "--json",
)
ROCM_SMI_TELEMETRY = (
    "rocm-smi",
    "--showuse",
    "--showpower",
    "--showmaxpower",
    "--showtemp",
    "--showmeminfo",
    "vram",
    "--json",
)

_UNITS = {"B": 1, "KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40}
_UNITS.update({"KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30, "TIB": 1 << 40})
_CARD = re.compile(r"^card:?(\d+)$")
_ROCM_NAME_KEYS = ("Card Series", "Card series", "Device Name", "Card SKU")


def _json(text: str) -> Any:
    """The JSON document in ``text``, skipping warning lines printed before it; None if none."""
    lines = text.splitlines()
    for start, line in enumerate(lines):
        if line.lstrip().startswith(("{", "[")):
            try:
                return json.loads("\n".join(lines[start:]))
            except json.JSONDecodeError as exc:
                log.debug("not JSON from line %d: %s", start + 1, exc)
    return None


def _rows(document: Any) -> list[dict[str, Any]]:
    """The per-GPU objects of any amd-smi JSON shape."""
    if isinstance(document, dict):
        document = document.get("gpu_data", [document] if "gpu" in document else [])
    if not isinstance(document, list):
        return []
    return [row for row in document if isinstance(row, dict) and isinstance(row.get("gpu"), int)]


def _number(value: Any) -> float | None:
    """A finite number from an int, float or numeric string; None for "N/A" and the like."""
    if isinstance(value, bool) or value is None:
        return None
    try:
        number = float(value) if isinstance(value, int | float) else float(str(value))
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def amd_bytes(value: Any, unit: str = "MB") -> int | None:
    """Bytes from ``8176``, ``"8176 MB"`` or ``{"value": 8176, "unit": "MB"}``; None if N/A."""
    if isinstance(value, dict):
        return amd_bytes(value.get("value"), str(value.get("unit") or unit))
    if isinstance(value, str) and " " in value.strip():
        number, _, unit = value.strip().partition(" ")
        value = number
    amount = _number(value)
    scale = _UNITS.get(unit.strip().upper())
    if amount is None or scale is None:
        return None
    return int(amount * scale)


def _section(row: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = row.get(key)
    return value if isinstance(value, dict) else {}


def _vram_total(row: Mapping[str, Any]) -> int | None:
    vram = _section(row, "vram")
    if "vram_size_mb" in vram:  # ROCm 6.0
        return amd_bytes(vram["vram_size_mb"], "MB")
    return amd_bytes(vram.get("size", vram.get("vram_size")), "MB")


def _memory(row: Mapping[str, Any]) -> tuple[int | None, int | None]:
    """``(total, free)`` from a ``metric`` row's ``mem_usage``."""
    usage = _section(row, "mem_usage")
    total = amd_bytes(usage.get("total_vram"))
    free = amd_bytes(usage.get("free_vram"))
    used = amd_bytes(usage.get("used_vram"))
    if free is None and total is not None and used is not None:
        free = total - used
    return total, free


def _driver(row: Mapping[str, Any]) -> str:
    driver = _section(row, "driver")
    return str(driver.get("version") or driver.get("driver_version") or "")


def _name(asic: Mapping[str, Any], index: int) -> str:
    name = str(asic.get("market_name") or "").strip()
    return name if name and name != "N/A" else f"AMD GPU {index}"


def parse_amd_smi_memory(metric_text: str) -> dict[int, tuple[int | None, int | None]]:
    """``{gpu: (total, free)}`` from ``amd-smi metric --mem-usage --json``; ``{}`` if unreadable."""
    return {row["gpu"]: _memory(row) for row in _rows(_json(metric_text))}


def parse_amd_smi(static_text: str, metric_text: str = "") -> list[GpuDevice]:
    """GPUs from ``amd-smi static --json`` plus, when given, ``amd-smi metric --json``.

    The metric output supplies free memory (and the total when ``static`` lacks it). Any of
    the shapes in the module docstring is accepted; unreadable input gives ``[]``.
    """
    memory = parse_amd_smi_memory(metric_text)
    static = {row["gpu"]: row for row in _rows(_json(static_text))}
    devices = []
    for index in sorted(static.keys() | memory.keys()):
        row = static.get(index, {})
        metric_total, free = memory.get(index, (None, None))
        total = _vram_total(row) or metric_total
        devices.append(
            GpuDevice(
                index=index,
                name=_name(_section(row, "asic"), index),
                accelerator=Accelerator.ROCM,
                memory_total_bytes=total or 0,
                memory_free_bytes=free,
                driver=_driver(row),
            )
        )
    return devices


def _rocm_int(card: Mapping[str, Any], key: str) -> int | None:
    value = _number(card.get(key))
    return None if value is None else int(value)


def _rocm_device(index: int, card: Mapping[str, Any]) -> GpuDevice:
    total = _rocm_int(card, "VRAM Total Memory (B)")
    used = _rocm_int(card, "VRAM Total Used Memory (B)")
    name = next((str(card[k]) for k in _ROCM_NAME_KEYS if card.get(k)), f"AMD GPU {index}")
    return GpuDevice(
        index=index,
        name=name,
        accelerator=Accelerator.ROCM,
        memory_total_bytes=total or 0,
        memory_free_bytes=total - used if total is not None and used is not None else None,
        uuid=str(card.get("Unique ID", "")).replace("N/A", ""),
    )


def _cards(text: str) -> list[tuple[int, dict[str, Any]]]:
    """``(index, card)`` for each ``cardN`` of ``rocm-smi --json`` output, by index."""
    document = _json(text)
    if not isinstance(document, dict):
        return []
    cards = []
    for key, card in document.items():
        match = _CARD.match(key)
        if match and isinstance(card, dict):
            cards.append((int(match.group(1)), card))
    return sorted(cards, key=lambda c: c[0])


def parse_rocm_smi_json(text: str) -> list[GpuDevice]:
    """GPUs from ``rocm-smi --showproductname --showmeminfo vram --json``; ``[]`` if unreadable.

    Cards without VRAM keys (other ``--show`` options) get total 0 (unknown).
    """
    return [_rocm_device(index, card) for index, card in _cards(text)]


# ------------------------------------------------------------------------- telemetry

_ROCM_POWER_KEYS = (
    "Current Socket Graphics Package Power (W)",
    "Average Graphics Package Power (W)",
)
"""MI300 and later report the current socket power; older GPUs an average."""
_ROCM_TEMPERATURE_KEYS = ("Temperature (Sensor edge) (C)", "Temperature (Sensor junction) (C)")
"""The edge sensor, as NVIDIA's die temperature; MI300 has none and reports the junction."""


def _reading(value: Any) -> float | None:
    """A number from ``{"value": 45, "unit": "%"}``, ``45``, ``"45"`` or ``"45 %"``; None for
    ``"N/A"`` (and ``"N/A (Secondary die)"``) and the like."""
    if isinstance(value, dict):
        return _reading(value.get("value"))
    if isinstance(value, str):
        value = value.strip().split(" ", 1)[0]
    return _number(value)


def _first(values: Any) -> float | None:
    return next((v for v in values if v is not None), None)


def _amd_sample(row: Mapping[str, Any]) -> GpuSample:
    total, free = _memory(row)
    used = amd_bytes(_section(row, "mem_usage").get("used_vram"))
    if used is None and total is not None and free is not None:
        used = total - free
    temperature = _section(row, "temperature")
    return GpuSample(
        index=row["gpu"],
        utilization_percent=_reading(_section(row, "usage").get("gfx_activity")),
        memory_used_bytes=used,
        memory_total_bytes=total,
        temperature_celsius=_first(_reading(temperature.get(k)) for k in ("edge", "hotspot")),
        power_watts=_reading(_section(row, "power").get("socket_power")),
    )


def parse_amd_smi_telemetry(text: str) -> tuple[GpuSample, ...]:
    """Each GPU's telemetry in ``amd-smi metric --usage --power --temperature --mem-usage
    --json`` output (any shape of the module docstring); sorted by index, ``()`` if unreadable.
    amd-smi's ``metric`` gives no power cap (``static --limit`` does): that stays None."""
    rows = sorted(_rows(_json(text)), key=lambda row: int(row["gpu"]))
    return tuple(_amd_sample(row) for row in rows)


def _rocm_sample(index: int, card: Mapping[str, Any]) -> GpuSample:
    total = _rocm_int(card, "VRAM Total Memory (B)")
    return GpuSample(
        index=index,
        uuid=str(card.get("Unique ID", "")).replace("N/A", ""),
        name=str(card.get("Card Series") or card.get("Card series") or ""),
        utilization_percent=_reading(card.get("GPU use (%)")),
        memory_used_bytes=_rocm_int(card, "VRAM Total Used Memory (B)"),
        memory_total_bytes=total,
        temperature_celsius=_first(_reading(card.get(k)) for k in _ROCM_TEMPERATURE_KEYS),
        power_watts=_first(_reading(card.get(k)) for k in _ROCM_POWER_KEYS),
        power_limit_watts=_reading(card.get("Max Graphics Package Power (W)")),
    )


def parse_rocm_smi_telemetry(text: str) -> tuple[GpuSample, ...]:
    """Each card's telemetry in ``rocm-smi --showuse --showpower --showmaxpower --showtemp
    --showmeminfo vram --json`` output (or ``--showallinfo``); ``()`` if unreadable."""
    return tuple(_rocm_sample(index, card) for index, card in _cards(text))
