"""Vulkan devices from ``vulkaninfo --summary``, sized from the full ``vulkaninfo`` output.

The summary names each device (``GPU0:``, ``deviceType``, ``deviceName``, ``driverName``,
``apiVersion``, ``deviceUUID``) but no memory. The full output's
``VkPhysicalDeviceMemoryProperties`` section lists the memory heaps; like llama.cpp
(``ggml_backend_vk_get_device_memory``) the total is the sum of the ``DEVICE_LOCAL`` heaps
(every heap for an integrated GPU) and free is the sum of ``budget - usage`` when the driver
reports a budget (VK_EXT_memory_budget), else unknown. Without the full output the total is
0, meaning unknown.

Index mapping: llama.cpp's ``Vulkan<n>`` is the n-th discrete or integrated GPU in
enumeration order (``ggml_vk_instance_init``, with ``GGML_VK_VISIBLE_DEVICES`` unset); CPU
(llvmpipe/lavapipe) and other types are skipped, and a GPU listed twice through two drivers
(same ``deviceUUID``) counts once. ``GpuDevice.index`` is that llama.cpp number, not the
``GPU<k>`` number of vulkaninfo. (llama.cpp keeps the preferred driver of such a pair and may
move it to the end of the list; we keep the first one.)
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass

from shoal.hardware.profile import Accelerator, GpuDevice

log = logging.getLogger(__name__)

VULKANINFO_SUMMARY = ("vulkaninfo", "--summary")
VULKANINFO_FULL = ("vulkaninfo",)

GPU_TYPES = ("PHYSICAL_DEVICE_TYPE_DISCRETE_GPU", "PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU")
INTEGRATED = "PHYSICAL_DEVICE_TYPE_INTEGRATED_GPU"

_GPU_LINE = re.compile(r"^GPU(\d+):\s*$")
_FIELD = re.compile(r"^\s*(\w+)\s*=\s*(.*?)\s*$")
_HEAP = re.compile(r"^\s*memoryHeaps\[(\d+)\]:")
_HEAP_VALUE = re.compile(r"^\s*(size|budget|usage)\s*=\s*(\d+)")


@dataclass(frozen=True)
class VulkanDevice:
    """One ``GPU<k>:`` entry of vulkaninfo, whatever its type."""

    number: int
    """The ``k`` of ``GPU<k>`` (vulkaninfo's enumeration index)."""
    name: str
    device_type: str
    driver: str = ""
    api_version: str = ""
    uuid: str = ""

    @property
    def is_gpu(self) -> bool:
        """Discrete or integrated: what llama.cpp's Vulkan backend uses."""
        return self.device_type in GPU_TYPES


@dataclass(frozen=True)
class MemoryHeap:
    size: int
    device_local: bool
    budget: int | None = None
    usage: int | None = None


def _blocks(text: str) -> dict[int, list[str]]:
    """Lines under each ``GPU<k>:`` header (the first block per ``k``)."""
    blocks: dict[int, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        match = _GPU_LINE.match(line.strip())
        if match:
            number = int(match.group(1))
            current = None if number in blocks else blocks.setdefault(number, [])
        elif current is not None:
            current.append(line)
    return blocks


def _fields(lines: list[str]) -> dict[str, str]:
    fields: dict[str, str] = {}
    for line in lines:
        match = _FIELD.match(line)
        if match:
            fields.setdefault(match.group(1), match.group(2))
    return fields


def _api_version(value: str) -> str:
    """``1.3.289`` from ``1.3.289`` or from the full output's ``4194306 (1.0.2)``."""
    inner = re.search(r"\(([\d.]+)\)", value)
    return inner.group(1) if inner else value


def parse_vulkaninfo_summary(text: str) -> list[VulkanDevice]:
    """Every device of ``vulkaninfo --summary`` (also reads the full output's properties).

    Non-GPU devices are included (see :attr:`VulkanDevice.is_gpu`); garbage gives ``[]``.
    """
    devices = []
    for number, lines in sorted(_blocks(text).items()):
        fields = _fields(lines)
        if "deviceType" not in fields:
            continue
        devices.append(
            VulkanDevice(
                number=number,
                name=fields.get("deviceName", f"Vulkan device {number}"),
                device_type=fields["deviceType"],
                driver=fields.get("driverName", ""),
                api_version=_api_version(fields.get("apiVersion", "")),
                uuid=fields.get("deviceUUID", ""),
            )
        )
    return devices


def _heap(values: dict[str, int], flags: list[str]) -> MemoryHeap:
    return MemoryHeap(
        size=values.get("size", 0),
        device_local=any("MEMORY_HEAP_DEVICE_LOCAL_BIT" in f for f in flags),
        budget=values.get("budget"),
        usage=values.get("usage"),
    )


def parse_memory_heaps(text: str) -> list[MemoryHeap]:
    """The ``memoryHeaps[i]`` entries of one device's ``VkPhysicalDeviceMemoryProperties``."""
    heaps: list[MemoryHeap] = []
    values: dict[str, int] | None = None
    flags: list[str] = []
    for line in text.splitlines():
        if line.strip().startswith("memoryTypes"):
            break
        if _HEAP.match(line):
            if values is not None:
                heaps.append(_heap(values, flags))
            values, flags = {}, []
        elif values is not None:
            match = _HEAP_VALUE.match(line)
            if match:
                values[match.group(1)] = int(match.group(2))
            else:
                flags.append(line)
    if values is not None:
        heaps.append(_heap(values, flags))
    return heaps


def parse_vulkaninfo_heaps(full_text: str) -> dict[int, list[MemoryHeap]]:
    """``{k: heaps of GPU<k>}`` from the full ``vulkaninfo`` output."""
    return {
        number: parse_memory_heaps("\n".join(lines)) for number, lines in _blocks(full_text).items()
    }


def device_memory(heaps: list[MemoryHeap], integrated: bool) -> tuple[int, int | None]:
    """``(total, free)`` the way llama.cpp computes them; free is None without a budget."""
    counted = [h for h in heaps if integrated or h.device_local]
    total = sum(h.size for h in counted)
    budgets = [(h.budget, h.usage) for h in counted]
    if not counted or any(not b or u is None for b, u in budgets):
        return total, None
    return total, sum(max(0, b - u) for b, u in budgets if b is not None and u is not None)


def vulkan_gpus(summary_text: str, full_text: str = "") -> list[GpuDevice]:
    """The GPUs llama.cpp's Vulkan backend would use, numbered as it numbers them."""
    heaps: Mapping[int, list[MemoryHeap]] = parse_vulkaninfo_heaps(full_text) if full_text else {}
    devices = parse_vulkaninfo_summary(summary_text) or parse_vulkaninfo_summary(full_text)
    seen: set[str] = set()
    gpus: list[GpuDevice] = []
    for device in devices:
        if not device.is_gpu or (device.uuid and device.uuid in seen):
            log.debug("vulkan: not a GPU for llama.cpp: %s (%s)", device.name, device.device_type)
            continue
        seen.add(device.uuid)
        total, free = device_memory(heaps.get(device.number, []), device.device_type == INTEGRATED)
        gpus.append(
            GpuDevice(
                index=len(gpus),
                name=device.name,
                accelerator=Accelerator.VULKAN,
                memory_total_bytes=total,
                memory_free_bytes=free,
                uuid=device.uuid,
                driver=device.driver,
                compute_capability=device.api_version,
            )
        )
    return gpus
