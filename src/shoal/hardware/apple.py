"""Apple Silicon: one Metal GPU sharing the machine's unified memory.

Sources: ``system_profiler SPDisplaysDataType -json`` (chip name and GPU core count) and
``sysctl`` values (``hw.memsize``, ``hw.optional.arm64``, ``iogpu.wired_limit_mb``).

Memory. llama.cpp's Metal backend reports ``recommendedMaxWorkingSetSize`` as the device's
total and that minus what it has allocated as free (``ggml-metal-device.m``). That value is
only available through the Metal API, so it is estimated here:

* ``iogpu.wired_limit_mb`` when the operator raised it (non-zero), since macOS then reports it;
* otherwise 2/3 of RAM up to 36 GiB and 3/4 above. Reported values: 10.67 GB on a 16 GB M4
  (2/3), about 48 GB on 64 GB M1/M2 Max (3/4), 107.5 GiB on 128 GiB (84 %, so 3/4 is on the
  safe side for the largest machines).

Free memory is that budget capped by the RAM macOS reports available, since weights, KV cache
and every other process share the same memory. Intel Macs (``hw.optional.arm64`` absent) are
not handled here; they fall through to Vulkan (MoltenVK) or the CPU.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from shoal.hardware.profile import Accelerator, GpuDevice

log = logging.getLogger(__name__)

SYSTEM_PROFILER = ("system_profiler", "SPDisplaysDataType", "-json")
SYSCTL = ("sysctl", "hw", "machdep")
SYSCTL_WIRED_LIMIT = ("sysctl", "iogpu.wired_limit_mb")

GIB = 1 << 30
SMALL_MACHINE_BYTES = 36 * GIB
"""Up to this much RAM Metal's working set is about 2/3 of it, above about 3/4."""

_METAL = {
    "spdisplays_metal4": "Metal 4",
    "spdisplays_metal3": "Metal 3",
    "spdisplays_supported": "Metal",
}


def metal_working_set(memsize: int, wired_limit_mb: int = 0) -> int:
    """Estimated ``recommendedMaxWorkingSetSize`` for a Mac with ``memsize`` bytes of RAM."""
    if wired_limit_mb > 0:
        return min(memsize, wired_limit_mb << 20)
    if memsize <= SMALL_MACHINE_BYTES:
        return memsize * 2 // 3
    return memsize * 3 // 4


def _apple_entries(document: Any) -> list[dict[str, Any]]:
    if not isinstance(document, dict):
        return []
    entries = document.get("SPDisplaysDataType")
    if not isinstance(entries, list):
        return []
    return [
        e
        for e in entries
        if isinstance(e, dict)
        and (
            e.get("spdisplays_vendor") == "sppci_vendor_Apple"
            or str(e.get("sppci_model", "")).startswith("Apple")
        )
    ]


def _gpu_name(entry: Mapping[str, Any]) -> str:
    # "_name" can be a localisation key such as "kHW_AppleM1Item"; sppci_model is the chip.
    model = str(entry.get("sppci_model") or entry.get("_name") or "Apple GPU")
    cores = str(entry.get("sppci_cores", "")).strip()
    return f"{model} ({cores}-core GPU)" if cores.isdigit() else model


def _metal(entry: Mapping[str, Any]) -> str:
    support = entry.get("spdisplays_mtlgpufamilysupport") or entry.get("spdisplays_metal")
    return _METAL.get(str(support), "Metal")


def _int(value: str | None) -> int:
    try:
        return int(value or 0)
    except ValueError:
        return 0


def parse_apple_gpu(
    displays_json: str, sysctl: Mapping[str, str], ram_available_bytes: int | None = None
) -> list[GpuDevice]:
    """The Apple Silicon GPU as ``MTL0``, or ``[]`` on Intel Macs and unreadable input.

    ``sysctl`` holds parsed ``sysctl`` values (``cpu.parse_sysctl``). Without ``hw.memsize``
    the memory is unknown (0).
    """
    if sysctl.get("hw.optional.arm64") != "1":
        return []
    try:
        entries = _apple_entries(json.loads(displays_json))
    except json.JSONDecodeError as exc:
        log.debug("system_profiler: not JSON: %s", exc)
        return []
    if not entries:
        return []
    total = metal_working_set(
        _int(sysctl.get("hw.memsize")), _int(sysctl.get("iogpu.wired_limit_mb"))
    )
    free = None if ram_available_bytes is None or not total else min(total, ram_available_bytes)
    return [
        GpuDevice(
            index=0,
            name=_gpu_name(entries[0]),
            accelerator=Accelerator.METAL,
            memory_total_bytes=total,
            memory_free_bytes=free,
            driver=_metal(entries[0]),
            unified_memory=True,
        )
    ]
