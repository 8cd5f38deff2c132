"""The compute devices a llama.cpp build drives on this machine (``--list-devices``).

``llama-server --list-devices`` prints the non-CPU devices its backends found, with their
memory (llama.cpp's ``common_print_available_devices``)::

    Available devices:
      CUDA0: NVIDIA GeForce RTX 4090 (24080 MiB, 23654 MiB free)
      CUDA1: NVIDIA GeForce RTX 3090 (24124 MiB, 23900 MiB free)

or ``  (none)`` for a CPU-only build. ``ggml-rpc-server`` of the same build serves exactly
these devices (or those given with ``-d``), or the CPU when there are none: what a stage of a
split model computes on, and what its share of layers must fit.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from shoal.llama_cpp.errors import LlamaCppError

MIB = 1024 * 1024
LIST_TIMEOUT_S = 60.0
_DEVICE = re.compile(r"^\s+([^\s:]+): (.*) \((\d+) MiB, (\d+) MiB free\)\s*$")
_ACCELERATORS = ("BLAS", "AMX", "ZenDNN", "KleidiAI")
"""Devices llama.cpp lists that do not hold layers (it skips them when offloading)."""


@dataclass(frozen=True, slots=True)
class ComputeDevice:
    name: str
    """llama.cpp's device name: ``CUDA0``, ``Vulkan1``, ``MTL0``, ``ROCm0``."""
    description: str
    total_bytes: int
    free_bytes: int


def parse_devices(lines: Iterable[str]) -> tuple[ComputeDevice, ...]:
    """The devices in ``--list-devices`` output that can hold layers, in llama.cpp's order."""
    found = []
    for line in lines:
        if (m := _DEVICE.match(line)) and not m.group(1).startswith(_ACCELERATORS):
            name, description, total, free = m.groups()
            found.append(ComputeDevice(name, description, int(total) * MIB, int(free) * MIB))
    return tuple(found)


def list_devices(llama_server: Path) -> tuple[ComputeDevice, ...]:
    """Run ``llama-server --list-devices``; raises ``LlamaCppError`` when it cannot."""
    try:
        done = subprocess.run(
            [str(llama_server), "--list-devices"],
            capture_output=True,
            text=True,
            timeout=LIST_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LlamaCppError(f"{llama_server} --list-devices failed: {exc}") from None
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise LlamaCppError(
            f"{llama_server} --list-devices exited with code {done.returncode}: {tail[0]}"
        )
    return parse_devices(done.stdout.splitlines())


def stage_devices(
    available: tuple[ComputeDevice, ...], selected: tuple[str, ...] | None
) -> tuple[ComputeDevice, ...]:
    """The devices a stage computes on: ``selected`` names (``--gpu-devices``), else all.

    Empty: the stage computes on the CPU (a CPU-only build, or no device listed).
    """
    if selected is None:
        return available
    by_name = {d.name: d for d in available}
    missing = [n for n in selected if n not in by_name]
    if missing:
        listed = ", ".join(by_name) or "none"
        raise LlamaCppError(
            f"llama.cpp does not list the device(s) {', '.join(missing)} chosen with "
            f"--gpu-devices (it lists: {listed}); this build may not drive those GPUs"
        )
    return tuple(by_name[n] for n in selected)
