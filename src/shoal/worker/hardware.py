"""The worker's view of its machine: detected once, reported at registration, memory and GPU
telemetry refreshed for heartbeats, and turned into llama-server's device arguments."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
from dataclasses import dataclass

from shoal.hardware import telemetry
from shoal.hardware.detect import (
    detect_machine,
    device_env,
    device_name,
    parse_gpu_devices,
    refresh_free_memory,
    split_args,
)
from shoal.hardware.profile import MachineProfile
from shoal.hardware.telemetry import GpuSampler, sampler_for
from shoal.llama_cpp.backend import BackendChoice
from shoal.llama_cpp.binaries import Binaries
from shoal.llama_cpp.coverage import unused_gpus
from shoal.llama_cpp.devices import ComputeDevice, list_devices
from shoal.llama_cpp.errors import LlamaCppError
from shoal.protocol.messages import GpuInfo, Hardware, ShardDevice
from shoal.protocol.telemetry import GpuSample

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


def gpus_unused(
    profile: MachineProfile, found: Binaries, choice: BackendChoice | None
) -> str | None:
    """Why the GPUs here sit idle under ``found`` (its ``--list-devices`` lists none), with
    the fix, logged as a warning; None when it drives them or there are none."""
    if not profile.gpus:
        return None
    try:
        listed = list_devices(found.llama_server)
    except LlamaCppError as exc:  # it will fail to start too, and say why then
        log.warning("could not ask llama-server which GPUs it drives: %s", exc)
        return None
    message = unused_gpus(profile.gpus, listed, found, choice)
    if message is not None:
        log.warning("%s", message)
    return message


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


def device_names(profile: MachineProfile, gpu_devices: str | None) -> tuple[str, ...] | None:
    """llama.cpp's names for the ``--gpu-devices`` GPUs (None: the flag is not given)."""
    if gpu_devices is None:
        return None
    return tuple(device_name(g) for g in selected(profile, gpu_devices).gpus)


def device_environment(profile: MachineProfile, gpu_devices: str | None) -> dict[str, str]:
    """Environment llama-server needs for ``device_args`` names to mean those GPUs."""
    if gpu_devices is None:
        return {}
    return device_env(selected(profile, gpu_devices).gpus)


def _used(profile: MachineProfile, gpu_devices: str | None) -> MachineProfile:
    """``selected`` for the heartbeat's readings: every GPU when ``--gpu-devices`` is wrong
    (the worker's plan refuses it, naming the flag; a reading need not fail first)."""
    try:
        return selected(profile, gpu_devices)
    except HardwareError:
        return profile


def _with_fresh(profile: MachineProfile, fresh: MachineProfile) -> MachineProfile:
    """``profile`` with the free RAM and the GPUs that ``fresh`` (a part of it) read anew."""
    by_index = {g.index: g for g in fresh.gpus}
    return dataclasses.replace(
        profile,
        ram_available_bytes=fresh.ram_available_bytes,
        gpus=tuple(by_index.get(g.index, g) for g in profile.gpus),
    )


def shard_devices(
    profile: MachineProfile, gpu_devices: str | None, listed: tuple[ComputeDevice, ...]
) -> tuple[ShardDevice, ...]:
    """The GPUs split models' shards may use here (``listed``: llama.cpp's, after
    ``--gpu-devices``), with their free memory: fresh from the vendor tool when it reports
    every one of them, else as llama.cpp listed it."""
    gpus = selected(profile, gpu_devices).gpus
    fresh = {device_name(g): g for g in gpus if g.memory_free_bytes is not None}
    use_fresh = bool(gpus) and len(fresh) == len(gpus) == len(listed)
    return tuple(
        ShardDevice(
            name=d.name,
            free_bytes=fresh[d.name].usable_bytes
            if use_fresh and d.name in fresh
            else d.free_bytes,
            unified_memory=d.name in fresh and fresh[d.name].unified_memory,
        )
        for d in listed
    )


def stage_memory(
    profile: MachineProfile, gpu_devices: str | None, listed: tuple[ComputeDevice, ...]
) -> int | None:
    """What a split model's stage may hold on its GPUs here: None when it computes on the
    CPU (llama.cpp lists no device), else the free memory of ``shard_devices``."""
    if not listed:
        return None
    return sum(d.free_bytes for d in shard_devices(profile, gpu_devices, listed))


@dataclass(frozen=True)
class Reading:
    """What a heartbeat reports of the machine, read at once."""

    ram_available_bytes: int
    gpu_free_bytes: tuple[int | None, ...]
    """Free memory per GPU of ``Hardware.gpus``, in order (None where unknown)."""
    gpus: tuple[GpuSample, ...]
    """Each GPU's telemetry (``Heartbeat.gpu_telemetry``); () with no GPU to read."""


class MemoryProbe:
    """Free RAM, per-GPU free memory and GPU telemetry for heartbeats, read off the event
    loop: one thread hop per heartbeat, and the telemetry's memory readings are the free
    memory (the vendor tool is not asked twice)."""

    def __init__(
        self,
        profile: MachineProfile,
        gpu_devices: str | None = None,
        stage_devices: tuple[ComputeDevice, ...] = (),
        sampler: GpuSampler | None = None,
    ) -> None:
        """``gpu_devices``: ``--gpu-devices``; ``stage_devices``: the devices a split model's
        stage here computes on (``llama_cpp.devices``; () for the CPU, or no stages here);
        ``sampler``: reads the GPUs' telemetry (default: the one for this machine's GPUs,
        ``hardware.telemetry.sampler_for``)."""
        self.profile = profile
        self.gpu_devices = gpu_devices
        self.stage_devices = stage_devices
        used = _used(profile, gpu_devices).gpus  # --gpu-devices none: no GPU to read
        self.sampler = sampler if sampler is not None else sampler_for(used)
        self._lock = threading.Lock()  # a heartbeat and a worker-list write may overlap

    def stage_memory(self) -> int | None:
        """``stage_memory`` on the latest profile (``Register``/``Heartbeat``)."""
        return stage_memory(self.profile, self.gpu_devices, self.stage_devices)

    def shard_devices(self) -> tuple[ShardDevice, ...]:
        """``shard_devices`` on the latest profile (``Register``/``Heartbeat``)."""
        return shard_devices(self.profile, self.gpu_devices, self.stage_devices)

    async def read(self) -> Reading:
        profile, gpus = await asyncio.to_thread(self._measure, self.profile)
        self.profile = profile
        return Reading(
            profile.ram_available_bytes, tuple(g.memory_free_bytes for g in profile.gpus), gpus
        )

    def _measure(self, profile: MachineProfile) -> tuple[MachineProfile, tuple[GpuSample, ...]]:
        with self._lock:
            gpus = self.sampler.sample()
            used = _used(profile, self.gpu_devices)  # the others' tools are not asked
            fresh = refresh_free_memory(used, measured=telemetry.free_bytes(gpus))
        return _with_fresh(profile, fresh), gpus
