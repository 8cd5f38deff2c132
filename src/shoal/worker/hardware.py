"""The worker's view of its machine: detected once, reported at registration, memory refreshed
for heartbeats, and turned into llama-server's device arguments."""

from __future__ import annotations

import asyncio
import logging

from shoal.hardware.detect import (
    detect_machine,
    device_env,
    parse_gpu_devices,
    refresh_free_memory,
    split_args,
)
from shoal.hardware.profile import MachineProfile
from shoal.protocol.messages import GpuInfo, Hardware

log = logging.getLogger(__name__)


class HardwareError(ValueError):
    """A device flag that does not match this machine."""


def detect_profile() -> MachineProfile:
    profile = detect_machine()
    gpus = ", ".join(f"{g.index}: {g.name} ({g.accelerator})" for g in profile.gpus) or "none"
    log.info(
        "hardware: %s, %d CPU threads, %.1f GiB RAM available, GPUs: %s",
        profile.cpu.model or "unknown CPU",
        profile.cpu.logical_cores,
        profile.ram_available_bytes / 2**30,
        gpus,
    )
    return profile


def to_wire(profile: MachineProfile) -> Hardware:
    return Hardware(
        hostname=profile.hostname,
        os=profile.os,
        cpu_count=profile.cpu.logical_cores,
        cpu_model=profile.cpu.model,
        cpu_features=profile.cpu.features,
        ram_total_bytes=profile.ram_total_bytes,
        ram_available_bytes=profile.ram_available_bytes,
        accelerator=profile.accelerator.value,
        gpus=tuple(
            GpuInfo(
                index=g.index,
                name=g.name,
                accelerator=g.accelerator.value,
                memory_total_bytes=g.memory_total_bytes,
                memory_free_bytes=g.memory_free_bytes,
                unified_memory=g.unified_memory,
            )
            for g in profile.gpus
        ),
    )


def selected(profile: MachineProfile, gpu_devices: str | None) -> MachineProfile:
    """``profile`` restricted to ``--gpu-devices`` (all GPUs when not given)."""
    if gpu_devices is None:
        return profile
    try:
        indices = parse_gpu_devices(gpu_devices)
    except ValueError as exc:  # its message names the flag already
        raise HardwareError(str(exc)) from None
    try:
        return profile.select(indices)
    except ValueError as exc:
        raise HardwareError(f"--gpu-devices {gpu_devices!r}: {exc}") from None


def device_args(
    profile: MachineProfile, gpu_devices: str | None, split_mode: str
) -> tuple[str, ...]:
    """llama-server's ``--device``/``--split-mode``/``--tensor-split`` for ``--gpu-devices``.

    Without the flag llama.cpp uses every GPU it sees, splitting by free memory itself.
    """
    if gpu_devices is None:
        return ()
    return split_args(selected(profile, gpu_devices).gpus, split_mode)


def device_environment(profile: MachineProfile, gpu_devices: str | None) -> dict[str, str]:
    """Environment llama-server needs for ``device_args`` names to mean those GPUs."""
    if gpu_devices is None:
        return {}
    return device_env(selected(profile, gpu_devices).gpus)


class MemoryProbe:
    """Free RAM and per-GPU free memory for heartbeats, read off the event loop."""

    def __init__(self, profile: MachineProfile | None) -> None:
        self.profile = profile

    async def free(self) -> tuple[int, tuple[int | None, ...]]:
        if self.profile is None:
            profile = await asyncio.to_thread(detect_machine)
        else:
            profile = await asyncio.to_thread(refresh_free_memory, self.profile)
            self.profile = profile
        return profile.ram_available_bytes, tuple(g.memory_free_bytes for g in profile.gpus)
