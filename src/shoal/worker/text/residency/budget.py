"""The memory a worker's text models may hold together, and what one needs before its first
load: pure functions of the machine, the flags and the GGUF file.

The budget is a ``Footprint`` (``shoal.models.residency``): available RAM minus the reserve
kept for the OS (``models.budget.ram_reserve``), and the free VRAM of each GPU the worker may
use (``--gpu-devices``), at the tool's index. On Apple unified memory the GPU draws on RAM, so
only RAM counts. ``--memory-budget`` caps it: RAM to the cap, and the GPUs together to the cap
(each in proportion to its free memory), so an operator (or a benchmark) can leave room for
other work or force evictions on a big machine.

A model's first-load estimate is ``models.gguf_info.memory_estimate`` over all its layers at
its whole context (per-slot context × slots): on the CPU all of it is RAM; with GPUs the input
layer stays in RAM (llama.cpp keeps ``token_embd`` on the host) and the rest is shared across
the GPUs in proportion to their free memory, as llama.cpp's default tensor split does. Once
loaded, what llama-server reported (``measured.py``) replaces it.
"""

from __future__ import annotations

from pathlib import Path

from shoal.hardware.profile import MachineProfile
from shoal.models.budget import ram_reserve
from shoal.models.gguf_info import GGUFInfo, inspect_cached, memory_estimate
from shoal.models.residency import Footprint


def model_budget(
    machine: MachineProfile, gpu_indices: tuple[int, ...] | None, cap_bytes: int | None = None
) -> Footprint:
    """What the worker's text models may hold together. ``gpu_indices``: the GPUs it may use
    (None: all; ``()``: none, the CPU only). ``cap_bytes``: ``--memory-budget``."""
    selected = machine.select(gpu_indices)
    ram = max(0, machine.ram_available_bytes - ram_reserve(machine))
    gpus = [0] * (max((g.index for g in selected.gpus), default=-1) + 1)
    for g in selected.gpus:
        if not g.unified_memory:
            gpus[g.index] = g.usable_bytes
    if cap_bytes is not None:
        ram = min(ram, cap_bytes)
        total = sum(gpus)
        if total > cap_bytes:
            gpus = [b * cap_bytes // total for b in gpus]
    return Footprint(ram, tuple(gpus))


def estimate(info: GGUFInfo, ctx_total: int, budget: Footprint) -> Footprint:
    """What the model ``info`` needs at ``ctx_total`` tokens of context (all slots), placed
    as llama-server would place it on the GPUs ``budget`` gives memory to (module docstring)."""
    need = memory_estimate(
        info, range(info.n_layers), ctx_total, with_head=True, with_tail=True
    ).total_bytes
    free = sum(budget.gpus)
    if not free:
        return Footprint(ram=need)
    on_gpus = max(0, need - info.head_bytes)
    shares = [on_gpus * b // free for b in budget.gpus]
    shares[max(range(len(shares)), key=lambda i: budget.gpus[i])] += on_gpus - sum(shares)
    return Footprint(ram=need - on_gpus, gpus=tuple(shares))


def estimate_file(path: Path, ctx_total: int, budget: Footprint) -> Footprint:
    """``estimate`` for the GGUF file at ``path`` (its header is read once, then cached)."""
    return estimate(inspect_cached(path), ctx_total, budget)
