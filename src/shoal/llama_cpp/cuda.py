"""Which CUDA builds of llama.cpp run on which GPUs and drivers: NVIDIA's rules, pure.

A CUDA build carries, for each entry of ``CMAKE_CUDA_ARCHITECTURES``, machine code (SASS,
``90-real``), PTX (``90-virtual``) or both (``90``). SASS for ``sm_XY`` runs on compute
capability X.Z with Z >= Y; an arch-specific target (``120a``) only on its own capability.
PTX for ``compute_XY`` runs on any capability >= X.Y once the driver has compiled it (at the
first start, cached in ``~/.nv/ComputeCache``), and only a driver that supports the toolkit
that wrote it can: an older one fails with CUDA_ERROR_UNSUPPORTED_PTX_VERSION ("the provided
PTX was compiled with an unsupported toolchain"; NVIDIA/nvbandwidth#61 shows a 13.2 build on
an H100 with driver 580, whose CUDA is 13.0).

Minor version compatibility (docs.nvidia.com/deploy/cuda-compatibility): a build of CUDA
M.x runs on any driver that supports M.0, R525 for 12.x and R580 for 13.x, as long as it
needs no PTX compiled.

So the CUDA 13.4 release, which carries only PTX for an H100 (``90-virtual``), does not run on
driver 580 (CUDA 13.0), while the CUDA 12.8 release does (13.0 >= 12.8). On driver 535 (CUDA
12.2) neither does: an H100 there needs the driver upgraded, or a build with SASS for it.

The architecture lists are llama.cpp's own (``ggml/src/ggml-cuda/CMakeLists.txt`` of the
pinned sdist, ``GGML_NATIVE=OFF`` and no ``CMAKE_CUDA_ARCHITECTURES``, which is how its release
workflow builds), and the release toolkits those of ``.github/workflows/release.yml``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

CudaVersion = tuple[int, int]
"""``(13, 0)``: a CUDA version, or a compute capability (``(9, 0)``)."""

RELEASE_CUDA: dict[tuple[str, str], dict[int, str]] = {
    ("linux", "x64"): {12: "12.8", 13: "13.4"},
    ("linux", "arm64"): {13: "13.4"},
    ("windows", "x64"): {12: "12.4", 13: "13.4"},
    ("windows", "arm64"): {13: "13.4"},
}
"""(system, arch) -> {CUDA major: the toolkit the release was built with, as its asset names
it}: ``ubuntu-cuda`` 12.8.2 and 13.4.1 on x64, 13.4.1 on arm64; ``windows-cuda`` 12.4 and
13.4."""
DEFAULT_CUDA_MAJOR = {"x64": 12, "arm64": 13}
"""The release to take when nothing is known of the driver: 12 runs on more drivers."""

MIN_DRIVER = {13: "R580", 12: "R525", 11: "R450"}
"""The oldest driver branch that supports each CUDA major (minor version compatibility)."""
_DRIVER_FLOOR = ((580, (13, 0)), (525, (12, 0)), (450, (11, 0)))

_ARCH = re.compile(r"^(\d+)(a?)(?:-(real|virtual))?$")
_VERSION = re.compile(r"(\d+)\.(\d+)")

NVCC_ARCHS: dict[int, CudaVersion] = {
    86: (11, 1),
    87: (11, 4),
    89: (11, 8),
    90: (11, 8),
    100: (12, 8),
    101: (12, 8),
    103: (12, 9),
    110: (13, 0),
    120: (12, 8),
    121: (12, 9),
}
"""The first toolkit whose nvcc compiles for each architecture newer than Ampere's 8.0."""
NVCC_13_OLDEST = 75
"""CUDA 13 compiles for Turing (7.5) and newer only."""


def parse_version(text: str) -> CudaVersion | None:
    """``(13, 0)`` from ``13.0``, ``13.0.88`` or ``release 13.0, V13.0.88``; None if none."""
    match = _VERSION.search(text)
    return (int(match.group(1)), int(match.group(2))) if match else None


def text(version: CudaVersion) -> str:
    return f"{version[0]}.{version[1]}"


def driver_floor(driver: str) -> CudaVersion | None:
    """The least CUDA version a driver of this version supports (its branch's major.0)."""
    match = re.match(r"(\d+)", driver.strip())
    if match is None:
        return None
    branch = int(match.group(1))
    return next((cuda for least, cuda in _DRIVER_FLOOR if branch >= least), None)


@dataclass(frozen=True)
class Arch:
    """One entry of ``CMAKE_CUDA_ARCHITECTURES``: ``90``, ``86-real``, ``120a-real``."""

    number: int
    specific: bool = False
    code: str = ""
    """``real`` (SASS only), ``virtual`` (PTX only) or "" (both)."""

    @classmethod
    def parse(cls, entry: str) -> Arch:
        match = _ARCH.match(entry.strip())
        if match is None:
            raise ValueError(f"not a CUDA architecture: {entry!r}")
        return cls(int(match.group(1)), bool(match.group(2)), match.group(3) or "")

    def __str__(self) -> str:
        suffix = f"-{self.code}" if self.code else ""
        return f"{self.number}{'a' if self.specific else ''}{suffix}"

    def sass_runs_on(self, capability: int) -> bool:
        if self.code == "virtual":
            return False
        if self.specific:
            return capability == self.number
        return capability // 10 == self.number // 10 and capability >= self.number

    def ptx_runs_on(self, capability: int) -> bool:
        if self.code == "real":
            return False
        return capability == self.number if self.specific else capability >= self.number


def number(capability: CudaVersion) -> int:
    """A compute capability as architectures number it: (9, 0) -> 90, (12, 0) -> 120."""
    return capability[0] * 10 + capability[1]


def default_architectures(toolkit: CudaVersion) -> tuple[Arch, ...]:
    """What llama.cpp compiles for when no architecture is given (its release binaries)."""
    entries = [] if toolkit >= (13, 0) else ["50-virtual", "61-virtual", "70-virtual"]
    entries += ["75-virtual", "80-virtual", "86-real"]
    if toolkit >= (11, 8):
        entries += ["89-real", "90-virtual"]
    if toolkit >= (12, 8):
        entries += ["120a-real"]
    if toolkit >= (12, 9):
        entries += ["121a-real"]
    return tuple(Arch.parse(e) for e in entries)


def why_driver_too_old(toolkit: CudaVersion, driver: CudaVersion) -> str | None:
    """Why a driver for CUDA ``driver`` cannot run any build of ``toolkit``; None if it can."""
    if driver >= (toolkit[0], 0):
        return None
    return (
        f"needs a driver for CUDA {toolkit[0]}.0 or newer ({MIN_DRIVER.get(toolkit[0], '?')}), "
        f"and this one supports {text(driver)}"
    )


def needed_driver(
    toolkit: CudaVersion, archs: Iterable[Arch], capability: CudaVersion
) -> CudaVersion | None:
    """The oldest driver CUDA version on which the build runs on ``capability``: its major.0
    with SASS for it, the toolkit itself when the driver must compile its PTX; None when it
    carries no code for that GPU at all."""
    cap = number(capability)
    archs = tuple(archs)
    if any(a.sass_runs_on(cap) for a in archs):
        return (toolkit[0], 0)
    return toolkit if any(a.ptx_runs_on(cap) for a in archs) else None


def why_not_runs(
    toolkit: CudaVersion, archs: Iterable[Arch], capability: CudaVersion, driver: CudaVersion
) -> str | None:
    """Why a build of ``toolkit`` for ``archs`` does not run on a GPU of ``capability`` with
    a driver that supports CUDA ``driver``; None when it runs."""
    too_old = why_driver_too_old(toolkit, driver)
    if too_old is not None:
        return too_old
    archs = tuple(archs)
    needed = needed_driver(toolkit, archs, capability)
    cap = number(capability)
    if needed is None:
        return f"carries no code that runs on compute capability {text(capability)}"
    if driver < needed:
        ptx = max(a.number for a in archs if a.ptx_runs_on(cap))
        return (
            f"has no sm_{cap} code for compute capability {text(capability)}, only PTX "
            f"(compute_{ptx}) that a driver for CUDA {text(driver)} cannot compile: that "
            f"needs a driver for CUDA {text(needed)} or newer"
        )
    return None


def build_arch(capability: CudaVersion) -> Arch:
    """The architecture a local build gives a GPU of ``capability``.

    SASS and PTX (``90``): the SASS runs at once, and the PTX keeps the build running, through
    the driver's compiler, on a newer GPU put in later; nvcc writes the PTX on its way to the
    SASS, so it costs the build next to nothing. Blackwell GeForce and workstation GPUs
    (12.x) get ``120a-real``, as in llama.cpp's own list: its FP4 tensor-core code needs the
    arch-specific target, which has no portable PTX.
    """
    if capability[0] == 12:
        return Arch(number(capability), specific=True, code="real")
    return Arch(number(capability))


def why_nvcc_cannot(nvcc: CudaVersion, capability: CudaVersion) -> str | None:
    """Why this nvcc cannot compile for ``capability``; None when it can."""
    cap = number(capability)
    if nvcc >= (13, 0) and cap < NVCC_13_OLDEST:
        return (
            f"nvcc {text(nvcc)} cannot compile for compute capability {text(capability)} "
            "(CUDA 13 starts at 7.5); a CUDA 12 toolkit can"
        )
    needed = NVCC_ARCHS.get(cap)
    if needed is not None and nvcc < needed:
        return (
            f"nvcc {text(nvcc)} cannot compile for compute capability {text(capability)}; "
            f"that needs CUDA {text(needed)} or newer"
        )
    return None
