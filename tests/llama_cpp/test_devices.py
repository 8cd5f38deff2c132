"""The devices a llama.cpp build drives (``--list-devices``), and which a stage uses."""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.llama_cpp.devices import ComputeDevice, list_devices, parse_devices, stage_devices
from shoal.llama_cpp.errors import LlamaCppError

MIB = 2**20

# The shape llama.cpp b11434 prints (common/arg.cpp, common_print_available_devices:
# "  %s: %s (%zu MiB, %zu MiB free)\n"); the names and figures are made up for a CUDA build
# with two GPUs and BLAS, which lists an accelerator that holds no layers.
TWO_GPUS = """\
Available devices:
  CUDA0: NVIDIA GeForce RTX 4090 (24080 MiB, 23654 MiB free)
  CUDA1: NVIDIA GeForce RTX 3060 (12288 MiB, 8000 MiB free)
  BLAS: OpenBLAS (0 MiB, 0 MiB free)
"""


def test_gpus_are_read_with_their_memory_and_accelerators_left_out() -> None:
    devices = parse_devices(TWO_GPUS.splitlines())
    assert devices == (
        ComputeDevice("CUDA0", "NVIDIA GeForce RTX 4090", 24080 * MIB, 23654 * MIB),
        ComputeDevice("CUDA1", "NVIDIA GeForce RTX 3060", 12288 * MIB, 8000 * MIB),
    )


def test_this_cpu_build_lists_no_device(llama_server: Path) -> None:
    """The real llama-server built here: a stage computes on the CPU."""
    assert list_devices(llama_server) == ()


def test_a_broken_binary_is_a_clear_error(tmp_path: Path) -> None:
    script = tmp_path / "llama-server"
    script.write_text("#!/bin/sh\necho 'libcuda.so.1: cannot open shared object' >&2\nexit 127\n")
    script.chmod(0o755)
    with pytest.raises(LlamaCppError, match="exited with code 127: libcuda.so.1"):
        list_devices(script)
    with pytest.raises(LlamaCppError, match="--list-devices failed"):
        list_devices(tmp_path / "missing")


def test_gpu_devices_choose_among_the_listed_ones() -> None:
    devices = parse_devices(TWO_GPUS.splitlines())
    assert stage_devices(devices, None) == devices
    assert [d.name for d in stage_devices(devices, ("CUDA1",))] == ["CUDA1"]
    with pytest.raises(LlamaCppError, match=r"CUDA2 chosen with --gpu-devices .*CUDA0, CUDA1"):
        stage_devices(devices, ("CUDA2",))
