"""``worker/text/residency/budget.py``: the models' budget per pool, and first-load
estimates (against the real default model's GGUF)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.hardware.profile import Accelerator, CpuInfo, GpuDevice, MachineProfile
from shoal.models.budget import ram_reserve
from shoal.models.gguf_info import inspect_cached, memory_estimate
from shoal.models.residency import Footprint
from shoal.units import GIB
from shoal.worker.text.residency.budget import estimate, estimate_file, model_budget

CPU = CpuInfo(model="Test CPU", logical_cores=8, arch="x86_64")


def machine(ram_available_gib: float, *gpus: GpuDevice) -> MachineProfile:
    return MachineProfile("h", "linux", CPU, 64 * GIB, int(ram_available_gib * GIB), gpus)


def cuda(index: int, free_gib: float) -> GpuDevice:
    return GpuDevice(index, "NVIDIA", Accelerator.CUDA, 80 * GIB, int(free_gib * GIB))


RESERVE = ram_reserve(machine(0))  # 10 % of 64 GiB


def test_cpu_only_is_ram_less_the_reserve() -> None:
    assert model_budget(machine(32), None) == Footprint(32 * GIB - RESERVE)
    assert model_budget(machine(32), None, cap_bytes=4 * GIB) == Footprint(4 * GIB)


def test_each_gpu_at_its_tool_index() -> None:
    box = machine(32, cuda(0, 70), cuda(1, 10), cuda(2, 40))
    assert model_budget(box, None) == Footprint(32 * GIB - RESERVE, (70 * GIB, 10 * GIB, 40 * GIB))
    # --gpu-devices 2: GPU 0 and 1 hold nothing of ours
    assert model_budget(box, (2,)) == Footprint(32 * GIB - RESERVE, (0, 0, 40 * GIB))
    # --gpu-devices none: the CPU only
    assert model_budget(box, ()) == Footprint(32 * GIB - RESERVE)


def test_the_cap_shares_the_gpus_by_free_memory() -> None:
    box = machine(32, cuda(0, 60), cuda(1, 20))
    assert model_budget(box, None, cap_bytes=40 * GIB) == Footprint(
        32 * GIB - RESERVE, (30 * GIB, 10 * GIB)
    )


def test_unified_memory_counts_as_ram() -> None:
    apple = GpuDevice(0, "Apple M3", Accelerator.METAL, 32 * GIB, None, unified_memory=True)
    assert model_budget(machine(24, apple), None) == Footprint(24 * GIB - RESERVE, (0,))


def test_estimate_on_the_cpu_is_the_whole_need_in_ram(model_path: Path) -> None:
    info = inspect_cached(model_path)
    whole = memory_estimate(info, range(info.n_layers), 8192, with_head=True, with_tail=True)
    assert estimate_file(model_path, 8192, Footprint(8 * GIB)) == Footprint(whole.total_bytes)


@pytest.mark.parametrize("free", [(30, 10), (10, 30), (0, 40)])
def test_estimate_on_gpus_keeps_the_input_layer_in_ram(
    model_path: Path, free: tuple[int, int]
) -> None:
    info = inspect_cached(model_path)
    whole = memory_estimate(info, range(info.n_layers), 4096, with_head=True, with_tail=True)
    got = estimate(info, 4096, Footprint(4 * GIB, tuple(f * GIB for f in free)))
    assert got.ram == info.head_bytes
    assert got.total == whole.total_bytes  # every byte placed once
    for share, f in zip(got.gpus, free, strict=True):  # in proportion, to a byte
        assert abs(share - (whole.total_bytes - info.head_bytes) * f // sum(free)) <= 1
