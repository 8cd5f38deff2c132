"""A GPU machine running a CPU build of llama-server is said, with the fix, never silent.

``unused_gpus`` is pure; the last test asks Shoal's real cached CPU build for its devices.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from shoal.hardware.profile import Accelerator, GpuDevice
from shoal.llama_cpp.backend import BackendChoice
from shoal.llama_cpp.binaries import Binaries, BinariesSource, cached_build
from shoal.llama_cpp.coverage import unused_gpus
from shoal.llama_cpp.devices import ComputeDevice, list_devices
from shoal.settings import CommonSettings

H100 = GpuDevice(0, "NVIDIA H100 80GB HBM3", Accelerator.CUDA, 80 << 30, cuda_version="13.0")
CUDA0 = ComputeDevice("CUDA0", "NVIDIA H100 80GB HBM3", 80 << 30, 79 << 30)
SERVER = Path("/opt/llama/llama-server")
CUDA = BackendChoice("cuda", cuda_major=12)


def binaries(source: BinariesSource) -> Binaries:
    return Binaries(SERVER, None, source, "test")


def test_nothing_to_say_without_gpus_or_when_the_build_drives_them() -> None:
    assert unused_gpus((), (), binaries("cache"), CUDA) is None
    assert unused_gpus((H100,), (CUDA0,), binaries("cache"), CUDA) is None


@pytest.mark.parametrize(
    ("source", "choice", "fix"),
    [
        (
            "flag",
            None,
            "pass a GPU build of llama-server to --llama-server-path, or leave the flag out "
            "and run `shoal llama-cpp install`",
        ),
        (
            "path",
            CUDA,
            "run `shoal llama-cpp install` (it gets llama.cpp's cuda build); Shoal's cache "
            "comes before PATH",
        ),
        ("cache", CUDA, "/opt/llama/llama-server --list-devices` to see why its cuda backend"),
        (
            "cache",
            BackendChoice("cpu", idle_gpus="upgrade the NVIDIA driver to CUDA 12.8"),
            "upgrade the NVIDIA driver to CUDA 12.8",
        ),
    ],
)
def test_a_cpu_build_on_a_gpu_machine_says_what_to_run(
    source: BinariesSource, choice: BackendChoice | None, fix: str
) -> None:
    said = unused_gpus((H100, H100), (), binaries(source), choice)
    assert said is not None
    assert said.startswith("this machine has 2 GPUs (NVIDIA H100 80GB HBM3), but its llama-server")
    assert str(SERVER) in said and "drives none of them" in said
    assert fix in said


def test_shoals_cached_cpu_build_lists_no_gpu() -> None:
    """The real build: ``--list-devices`` of a CPU build lists none, so on a GPU machine it is
    reported."""
    found = cached_build(CommonSettings().cache_dir, "cpu")
    if found is None:
        pytest.fail("no cached CPU build of llama.cpp; run the set-up first (scripts/dev.sh)")
    listed = list_devices(found.llama_server)
    assert listed == ()
    assert unused_gpus((H100,), listed, found, CUDA) is not None
