"""NVIDIA's compatibility rules as ``llama_cpp.cuda`` states them, and its tables against the
pinned llama.cpp source (its CUDA CMake file and release workflow, in the cached sdist)."""

from __future__ import annotations

import re
import tarfile

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shoal.llama_cpp import cuda
from shoal.llama_cpp.cuda import Arch
from shoal.llama_cpp.source import SDIST_SOURCE_SUBDIR, sdist_path
from shoal.settings import CommonSettings

H100, A100, RTX_4090, RTX_3090, RTX_5090, V100, GTX_1080 = (
    (9, 0),
    (8, 0),
    (8, 9),
    (8, 6),
    (12, 0),
    (7, 0),
    (6, 1),
)


@pytest.mark.parametrize(
    "entry", ["90", "86-real", "90-virtual", "120a-real", "121a-real", "75-virtual"]
)
def test_arch_entries_read_and_write_back(entry: str) -> None:
    assert str(Arch.parse(entry)) == entry


def test_a_bad_arch_entry_is_refused() -> None:
    with pytest.raises(ValueError, match="not a CUDA architecture"):
        Arch.parse("sm_90")


@pytest.mark.parametrize(
    ("entry", "capability", "sass", "ptx"),
    [
        ("86-real", RTX_4090, True, False),  # sm_86 SASS runs on 8.9 (same major, newer)
        ("86-real", A100, False, False),  # ... not on an older minor
        ("86-real", H100, False, False),  # ... nor on another major
        ("90-virtual", H100, False, True),
        ("90-virtual", RTX_5090, False, True),  # PTX runs on anything newer, once compiled
        ("90-virtual", A100, False, False),
        ("90", H100, True, True),
        ("120a-real", RTX_5090, True, False),
        ("120a-real", (12, 1), False, False),  # arch-specific: its own capability only
    ],
)
def test_what_runs_where(entry: str, capability: tuple[int, int], sass: bool, ptx: bool) -> None:
    arch = Arch.parse(entry)
    assert arch.sass_runs_on(cuda.number(capability)) is sass
    assert arch.ptx_runs_on(cuda.number(capability)) is ptx


@pytest.mark.parametrize(
    ("toolkit", "capability", "driver", "why"),
    [
        ((12, 8), H100, (13, 0), None),  # PTX of 12.8, compiled by a 13.0 driver
        ((13, 4), H100, (13, 0), "needs a driver for CUDA 13.4 or newer"),
        ((12, 8), H100, (12, 2), "needs a driver for CUDA 12.8 or newer"),
        ((12, 8), RTX_4090, (12, 2), None),  # SASS: minor version compatibility suffices
        ((12, 8), RTX_5090, (12, 0), None),  # 120a-real SASS
        ((13, 4), V100, (13, 0), "carries no code that runs on compute capability 7.0"),
        ((12, 8), V100, (12, 8), None),
        ((12, 8), RTX_4090, (11, 8), "needs a driver for CUDA 12.0 or newer (R525)"),
        ((13, 4), RTX_3090, (12, 9), "needs a driver for CUDA 13.0 or newer (R580)"),
    ],
)
def test_why_a_release_build_does_not_run(
    toolkit: tuple[int, int],
    capability: tuple[int, int],
    driver: tuple[int, int],
    why: str | None,
) -> None:
    said = cuda.why_not_runs(toolkit, cuda.default_architectures(toolkit), capability, driver)
    if why is None:
        assert said is None
    else:
        assert said is not None and why in said


@given(
    toolkit=st.sampled_from([(12, 4), (12, 8), (12, 9), (13, 0), (13, 4)]),
    capability=st.sampled_from([V100, (7, 5), A100, RTX_3090, RTX_4090, H100, (10, 0), RTX_5090]),
    driver=st.tuples(st.integers(11, 14), st.integers(0, 9)),
)
def test_a_build_runs_exactly_from_the_driver_it_needs(
    toolkit: tuple[int, int], capability: tuple[int, int], driver: tuple[int, int]
) -> None:
    archs = cuda.default_architectures(toolkit)
    needed = cuda.needed_driver(toolkit, archs, capability)
    runs = cuda.why_not_runs(toolkit, archs, capability, driver) is None
    assert runs == (needed is not None and driver >= needed)


@pytest.mark.parametrize(
    ("capability", "arch"),
    [(H100, "90"), (RTX_3090, "86"), (V100, "70"), (RTX_5090, "120a-real"), ((12, 1), "121a-real")],
)
def test_a_local_build_targets_the_gpu_it_runs_on(capability: tuple[int, int], arch: str) -> None:
    built = cuda.build_arch(capability)
    assert str(built) == arch
    assert built.sass_runs_on(cuda.number(capability))  # nothing compiled at start


@pytest.mark.parametrize(
    ("nvcc", "capability", "why"),
    [
        ((13, 0), H100, None),
        ((12, 4), RTX_5090, "needs CUDA 12.8 or newer"),
        ((13, 0), V100, "CUDA 13 starts at 7.5"),
        ((13, 0), GTX_1080, "CUDA 13 starts at 7.5"),
        ((12, 2), V100, None),
        ((11, 7), H100, "needs CUDA 11.8 or newer"),
    ],
)
def test_what_an_nvcc_compiles_for(
    nvcc: tuple[int, int], capability: tuple[int, int], why: str | None
) -> None:
    said = cuda.why_nvcc_cannot(nvcc, capability)
    assert (said is None) if why is None else (said is not None and why in said)


@pytest.mark.parametrize(
    ("driver", "floor"),
    [("580.126.09", (13, 0)), ("535.129.03", (12, 0)), ("470.256.02", (11, 0)), ("", None)],
)
def test_a_drivers_version_gives_the_least_cuda_it_supports(
    driver: str, floor: tuple[int, int] | None
) -> None:
    assert cuda.driver_floor(driver) == floor


# ------------------------------------------------------------ against the pinned source


def _pinned_file(name: str) -> str:
    sdist = sdist_path(CommonSettings().cache_dir)
    if not sdist.is_file():
        pytest.skip(f"the pinned sdist is not cached at {sdist} (`scripts/dev.sh setup`)")
    with tarfile.open(sdist, "r:gz") as tar:
        member = tar.extractfile(f"{SDIST_SOURCE_SUBDIR}/{name}")
        assert member is not None
        return member.read().decode()


def test_the_default_architectures_are_llama_cpps() -> None:
    cmake = _pinned_file("ggml/src/ggml-cuda/CMakeLists.txt")
    appended = {
        entry
        for line in re.findall(r"list\(APPEND CMAKE_CUDA_ARCHITECTURES ([^)]*)\)", cmake)
        for entry in line.split()
    }
    newest = {str(a) for a in cuda.default_architectures((12, 9))}
    assert appended == newest
    assert 'CUDAToolkit_VERSION VERSION_LESS "13"' in cmake  # 50/61/70 only before CUDA 13
    assert {str(a) for a in cuda.default_architectures((13, 4))} == newest - {
        "50-virtual",
        "61-virtual",
        "70-virtual",
    }


def test_the_release_toolkits_are_those_of_the_release_workflow() -> None:
    workflow = _pinned_file(".github/workflows/release.yml")
    ubuntu = workflow.split("ubuntu-cuda:", 1)[1].split("steps:", 1)[0]
    labels = re.findall(
        r"build: '(\w+)'\s+os: [\w.-]+\s+cuda: '[\d.]+'\s+label: '([\d.]+)'", ubuntu
    )
    assert sorted(labels) == sorted(
        (arch, toolkit)
        for (system, arch), builds in cuda.RELEASE_CUDA.items()
        if system == "linux"
        for toolkit in builds.values()
    )
    windows = workflow.split("windows-cuda:", 1)[1].split("steps:", 1)[0]
    assert sorted(set(re.findall(r"- cuda: '([\d.]+)'", windows))) == sorted(
        set(cuda.RELEASE_CUDA[("windows", "x64")].values())
    )
