"""What a worker reports of its GPUs at each heartbeat (``Heartbeat.gpu_telemetry``).

One ``GpuSample`` per GPU of ``Hardware.gpus``, read from the vendor's tool just before the
heartbeat went out (NVML, ``nvidia-smi``, ``amd-smi`` or ``rocm-smi``). A reading the tool
cannot give is None, never a made-up 0. The router keeps the latest per worker for its
``shoal_gpu_*`` gauges, ``GET /api/v1/workers`` and the dashboard; it keeps no history.
"""

from __future__ import annotations

from shoal.protocol.base import Message


class GpuSample(Message):
    """One GPU's state when its worker last read it."""

    index: int
    """The vendor tool's device index, as in ``Hardware.gpus`` (and ``--gpu-devices``)."""
    uuid: str = ""
    name: str = ""
    utilization_percent: float | None = None
    """How busy its compute engine was, 0-100 (NVML's ``gpu`` utilization, amd-smi's
    ``gfx_activity``)."""
    memory_used_bytes: int | None = None
    memory_total_bytes: int | None = None
    temperature_celsius: float | None = None
    """The GPU die (NVIDIA's ``temperature.gpu``; AMD's edge sensor, else its hotspot)."""
    power_watts: float | None = None
    power_limit_watts: float | None = None
    """The power cap it is held to now (NVML's enforced limit, rocm-smi's max package power)."""

    @property
    def memory_free_bytes(self) -> int | None:
        """Total minus used, when both are known."""
        if self.memory_total_bytes is None or self.memory_used_bytes is None:
            return None
        return max(self.memory_total_bytes - self.memory_used_bytes, 0)
