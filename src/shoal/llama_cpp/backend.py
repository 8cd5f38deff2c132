"""Which llama.cpp backend to fetch or build for this machine, how, and why.

:func:`choose_backend` is the decision, a pure function of :class:`MachineFacts` (gathered by
``llama_cpp.facts``). With the backend left on ``auto`` it follows the drivers, not the
toolkits: CUDA where NVIDIA GPUs and a driver are (the release build the driver can run, for
every GPU here; else a build for exactly these GPUs with the CUDA toolkit), Metal on Apple
Silicon, ROCm for AMD GPUs where ROCm is installed, Vulkan where a Vulkan driver drives a GPU
(the release needs only the driver), else the CPU. When the GPUs cannot be used (a driver too
old, a container without the driver's libraries) it says so and how to fix it
(``BackendChoice.idle_gpus``). An explicit backend wins, even without a GPU (a build box).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from shoal.hardware.profile import Accelerator, GpuDevice
from shoal.llama_cpp import cuda
from shoal.llama_cpp.cuda import CudaVersion
from shoal.llama_cpp.errors import LlamaCppError
from shoal.llama_cpp.source import BACKEND_CPU

BACKEND_CUDA = "cuda"
BACKEND_METAL = "metal"
BACKEND_VULKAN = "vulkan"
BACKEND_ROCM = "rocm"
BACKENDS: tuple[str, ...] = (BACKEND_CPU, BACKEND_CUDA, BACKEND_METAL, BACKEND_VULKAN, BACKEND_ROCM)
AUTO = "auto"
"""``requested`` value (like None) that lets the machine decide."""
INSTALL = "shoal llama-cpp install"

# Which operating systems each backend can run on (platform.system(), lower case).
_BACKEND_SYSTEMS: dict[str, frozenset[str]] = {
    BACKEND_CPU: frozenset({"linux", "darwin", "windows"}),
    BACKEND_CUDA: frozenset({"linux", "windows"}),
    BACKEND_METAL: frozenset({"darwin"}),
    BACKEND_VULKAN: frozenset({"linux", "darwin", "windows"}),
    BACKEND_ROCM: frozenset({"linux", "windows"}),
}
_CONTAINER_FIX = (
    "start the container with the NVIDIA Container Toolkit, which mounts them (`docker run "
    "--gpus all`, with NVIDIA_DRIVER_CAPABILITIES including compute and utility)"
)


def normalize_machine(machine: str) -> str:
    """``platform.machine()`` in llama.cpp's release vocabulary: ``x64``, ``arm64``, ..."""
    lowered = machine.lower()
    if lowered in ("x86_64", "amd64", "x64"):
        return "x64"
    if lowered in ("aarch64", "arm64", "armv8", "armv8l"):
        return "arm64"
    return lowered


@dataclass(frozen=True)
class MachineFacts:
    """What the backend decision knows of a machine; ``llama_cpp.facts`` gathers it."""

    system: str
    """``platform.system()``: ``Linux``, ``Darwin``, ``Windows``."""
    machine: str
    """``platform.machine()``: ``x86_64``, ``arm64``, ..."""
    gpus: tuple[GpuDevice, ...] = ()
    """The GPUs ``hardware.detect`` found, NVIDIA ones with compute capability and the
    driver's CUDA version."""
    nvidia_device_nodes: bool = False
    """``/dev/nvidia0``...: the NVIDIA kernel driver has GPUs, whatever NVML says."""
    wsl: bool = False
    """Linux under WSL 2, where the Windows driver provides CUDA."""
    nvcc: str = ""
    """The CUDA toolkit's version (``13.0``); "" without ``nvcc``."""
    vulkan_driver: str = ""
    """What shows a Vulkan driver for a GPU here (``vulkaninfo``, an ICD file); "" none."""
    vulkan_sdk: bool = False
    """The Vulkan SDK a build needs (``glslc`` and headers, or ``VULKAN_SDK``)."""
    rocm: str = ""
    """Where ROCm is installed (``/opt/rocm``, a tool on PATH); "" not installed."""
    hip_sdk: bool = False
    """``hipconfig`` on PATH, which a ROCm build needs."""


@dataclass(frozen=True)
class BackendChoice:
    """The backend to run, how to get it, and why, in words for the log and ``shoal doctor``."""

    backend: str
    reasons: tuple[str, ...] = ()
    cuda_major: int | None = None
    """CUDA: the major version of the release build to download (its CUDA runtime beside)."""
    no_release: str | None = None
    """Why the pinned release's build would not run here (then build from source)."""
    build_flags: tuple[str, ...] = ()
    """The CMake flags a build from source adds for this machine (its GPUs' architectures)."""
    no_build: str | None = None
    """Why a build from source cannot work here."""
    idle_gpus: str | None = None
    """The GPUs this choice leaves unused, why, and what to do about it."""
    asked: bool = False
    """The backend was given (``--llama-cpp-backend``), not chosen."""

    def describe(self) -> str:
        """One line for the log: the backend and the reasons."""
        return f"{self.backend}: {'; '.join(self.reasons)}" if self.reasons else self.backend


def choose_backend(facts: MachineFacts, requested: str | None = None) -> BackendChoice:
    """The backend for ``facts``: ``requested`` if given (LlamaCppError if unknown or
    impossible on this operating system), else the best one this machine's drivers run."""
    system = facts.system.lower()
    if requested is not None and requested.lower() != AUTO:
        return _asked(_check_requested(requested.lower(), system), facts)
    for rule in (_nvidia, _apple, _amd, _vulkan):
        choice = rule(facts)
        if choice is not None:
            return choice
    return _cpu(facts)


def _check_requested(requested: str, system: str) -> str:
    systems = _BACKEND_SYSTEMS.get(requested)
    if systems is None:
        raise LlamaCppError(
            f"unknown llama.cpp backend {requested!r}; choose one of "
            f"{', '.join((AUTO, *BACKENDS))}."
        )
    if system not in systems:
        raise LlamaCppError(
            f"the {requested} backend does not run on {system}; it needs "
            f"{' or '.join(sorted(systems))}. Leave the backend on {AUTO!r} to let Shoal choose."
        )
    return requested


def _gpus(facts: MachineFacts, accelerator: Accelerator) -> tuple[GpuDevice, ...]:
    return tuple(g for g in facts.gpus if g.accelerator is accelerator)


def _names(gpus: tuple[GpuDevice, ...]) -> str:
    counts: dict[str, int] = {}
    for g in gpus:
        counts[g.name] = counts.get(g.name, 0) + 1
    return ", ".join(f"{n}x {name}" if n > 1 else name for name, n in counts.items())


# ------------------------------------------------------------------------------ rules


def _nvidia(facts: MachineFacts) -> BackendChoice | None:
    gpus = _gpus(facts, Accelerator.CUDA)
    if not gpus or facts.system.lower() not in _BACKEND_SYSTEMS[BACKEND_CUDA]:
        return None
    plan = _cuda_plan(facts, gpus)
    if plan.works:
        return plan.choice
    reasons = plan.choice.reasons
    if facts.vulkan_driver:
        vulkan = f"so Vulkan: a Vulkan driver is here ({facts.vulkan_driver})"
        return BackendChoice(BACKEND_VULKAN, (*reasons, vulkan), no_build=_vulkan_no_build(facts))
    return BackendChoice(
        BACKEND_CPU,
        (*reasons, "so the CPU"),
        idle_gpus=f"the NVIDIA GPUs ({_names(gpus)}) stay unused: {plan.choice.no_release}; "
        f"and no build: {plan.choice.no_build}. To use them, {plan.fix()}",
    )


def _apple(facts: MachineFacts) -> BackendChoice | None:
    if facts.system.lower() == "darwin" and _arch(facts) == "arm64":
        return BackendChoice(BACKEND_METAL, ("Apple Silicon: Metal",))
    return None


def _amd(facts: MachineFacts) -> BackendChoice | None:
    gpus = _gpus(facts, Accelerator.ROCM)
    if not gpus:
        return None
    if facts.rocm:
        return BackendChoice(
            BACKEND_ROCM,
            (f"AMD GPUs ({_names(gpus)}) and ROCm ({facts.rocm})",),
            no_build=None if facts.hip_sdk else "no ROCm/HIP compiler (hipconfig) on PATH",
        )
    if facts.vulkan_driver:
        return BackendChoice(
            BACKEND_VULKAN,
            (f"AMD GPUs ({_names(gpus)}) without ROCm; Vulkan driver: {facts.vulkan_driver}",),
        )
    return BackendChoice(
        BACKEND_CPU,
        (f"AMD GPUs ({_names(gpus)}) but neither ROCm nor a Vulkan driver",),
        idle_gpus=f"the AMD GPUs ({_names(gpus)}) stay unused: neither ROCm nor a Vulkan "
        f"driver is installed. Install one (ROCm, or Mesa's RADV: `apt-get install "
        f"mesa-vulkan-drivers`), then run `{INSTALL}`",
    )


def _vulkan(facts: MachineFacts) -> BackendChoice | None:
    gpus = _gpus(facts, Accelerator.VULKAN)
    if not (gpus or facts.vulkan_driver):
        return None
    seen = f" ({_names(gpus)})" if gpus else ""
    return BackendChoice(
        BACKEND_VULKAN,
        (f"a Vulkan driver for a GPU{seen}: {facts.vulkan_driver or 'vulkaninfo'}",),
        no_build=_vulkan_no_build(facts),
    )


def _cpu(facts: MachineFacts) -> BackendChoice:
    if facts.nvidia_device_nodes and not facts.wsl:
        return BackendChoice(
            BACKEND_CPU,
            ("NVIDIA GPU device files (/dev/nvidia*) but neither NVML nor nvidia-smi answers",),
            idle_gpus="the NVIDIA GPUs stay unused: the kernel driver has them (/dev/nvidia*) "
            "but its user-space libraries are missing, as in a container started without "
            f"them. To use them, {_CONTAINER_FIX}, then run `{INSTALL}`",
        )
    if facts.wsl:
        return BackendChoice(
            BACKEND_CPU,
            (
                "WSL 2 without a GPU: CUDA there comes from the Windows NVIDIA driver "
                "(/usr/lib/wsl/lib/libcuda.so and nvidia-smi); install or update it on Windows",
            ),
        )
    if facts.gpus:
        why = f"no llama.cpp backend drives the GPUs here on {facts.system} ({_names(facts.gpus)})"
        return BackendChoice(BACKEND_CPU, (why,))
    return BackendChoice(BACKEND_CPU, ("no GPU found (NVML, nvidia-smi, amd-smi, vulkaninfo)",))


# ------------------------------------------------------------------- asked for


def _asked(backend: str, facts: MachineFacts) -> BackendChoice:
    given = f"--llama-cpp-backend {backend}"
    if backend == BACKEND_CUDA:
        plan = _cuda_plan(facts, _gpus(facts, Accelerator.CUDA)).choice
        return dataclasses.replace(plan, reasons=(f"{given} given", *plan.reasons), asked=True)
    no_build = {
        BACKEND_VULKAN: _vulkan_no_build(facts),
        BACKEND_ROCM: None if facts.hip_sdk else "no ROCm/HIP compiler (hipconfig) on PATH",
    }.get(backend)
    idle = None
    if backend == BACKEND_CPU and facts.gpus:
        idle = (
            f"{given} leaves the GPUs here ({_names(facts.gpus)}) unused; leave the backend "
            f"on {AUTO} and run `{INSTALL}` to use them"
        )
    return BackendChoice(
        backend, (f"{given} given",), no_build=no_build, idle_gpus=idle, asked=True
    )


def _vulkan_no_build(facts: MachineFacts) -> str | None:
    return None if facts.vulkan_sdk else "no Vulkan SDK (glslc and headers, or VULKAN_SDK)"


# ------------------------------------------------------------------------ CUDA


def _arch(facts: MachineFacts) -> str:
    return normalize_machine(facts.machine)


def driver_cuda(gpus: tuple[GpuDevice, ...]) -> tuple[CudaVersion | None, str]:
    """The CUDA version the NVIDIA driver supports, and where that comes from."""
    for g in gpus:
        version = cuda.parse_version(g.cuda_version) if g.cuda_version else None
        if version is not None:
            return version, f"the driver supports CUDA {cuda.text(version)}"
    for g in gpus:
        floor = cuda.driver_floor(g.driver)
        if floor is not None:
            return floor, f"driver {g.driver} supports CUDA {cuda.text(floor)} or newer"
    return None, "the driver's CUDA version is unknown"


def _capabilities(gpus: tuple[GpuDevice, ...]) -> tuple[CudaVersion, ...]:
    found = {cuda.parse_version(g.compute_capability) for g in gpus}
    return tuple(sorted(c for c in found if c is not None))


@dataclass(frozen=True)
class _Release:
    major: int | None
    """The release build to download; None when none runs here."""
    reasons: tuple[str, ...]
    why_not: str | None = None
    upgrade_to: CudaVersion | None = None
    """The oldest driver CUDA version on which some release build would run here."""


def _release(facts: MachineFacts, gpus: tuple[GpuDevice, ...]) -> _Release:
    """The CUDA release build that runs on every GPU here, preferring the driver's major."""
    builds = cuda.RELEASE_CUDA.get((facts.system.lower(), _arch(facts)), {})
    if not builds:
        return _Release(None, (), f"llama.cpp publishes no CUDA build for {facts.system}")
    driver, said = driver_cuda(gpus)
    if driver is None or not gpus:
        major = cuda.DEFAULT_CUDA_MAJOR.get(_arch(facts), max(builds))
        return _Release(major, (f"{said}: the CUDA {builds[major]} release",))
    caps = _capabilities(gpus)
    problems: list[str] = []
    for major in sorted(builds, key=lambda m: (m != driver[0], -m)):
        toolkit = cuda.parse_version(builds[major]) or (major, 0)
        why = _release_problems(toolkit, caps, driver)
        if why is None:
            runs = f"the CUDA {builds[major]} release runs on them"
            if not caps:
                runs += " as far as the driver goes (their compute capability is unknown)"
            return _Release(major, (said, *problems, runs))
        problems.append(f"the CUDA {builds[major]} release {why}")
    needs = [n for t in builds.values() if (n := _release_needs(t, caps)) is not None]
    return _Release(None, (said, *problems), "; ".join(problems), min(needs, default=None))


def _release_problems(
    toolkit: CudaVersion, caps: tuple[CudaVersion, ...], driver: CudaVersion
) -> str | None:
    """Why the release of ``toolkit`` does not run on every GPU here (the first GPU that
    stops it); None when it runs on all (or their capabilities are unknown)."""
    too_old = cuda.why_driver_too_old(toolkit, driver)
    if too_old is not None or not caps:
        return too_old
    archs = cuda.default_architectures(toolkit)
    return next((w for c in caps if (w := cuda.why_not_runs(toolkit, archs, c, driver))), None)


def _release_needs(toolkit_text: str, caps: tuple[CudaVersion, ...]) -> CudaVersion | None:
    """The oldest driver CUDA version on which this release runs on every GPU here."""
    toolkit = cuda.parse_version(toolkit_text)
    if toolkit is None:
        return None
    archs = cuda.default_architectures(toolkit)
    needs = [cuda.needed_driver(toolkit, archs, c) for c in caps]
    if any(n is None for n in needs):
        return None
    return max((n for n in needs if n is not None), default=(toolkit[0], 0))


def _build(facts: MachineFacts, gpus: tuple[GpuDevice, ...]) -> tuple[tuple[str, ...], str | None]:
    """The CMake flags of a build for these GPUs, and why one cannot work (None: it can)."""
    nvcc = cuda.parse_version(facts.nvcc) if facts.nvcc else None
    caps = _capabilities(gpus)
    flags: tuple[str, ...] = ()
    if caps:
        archs = ";".join(dict.fromkeys(str(cuda.build_arch(c)) for c in caps))
        flags = (f"-DCMAKE_CUDA_ARCHITECTURES={archs}",)
    if nvcc is None:
        return flags, "no CUDA toolkit (nvcc) here to build with"
    driver, _ = driver_cuda(gpus)
    problems = [w for c in caps if (w := cuda.why_nvcc_cannot(nvcc, c)) is not None]
    if gpus and driver is not None and driver < (nvcc[0], 0):
        problems.append(
            f"a build with nvcc {cuda.text(nvcc)} needs a driver for CUDA {nvcc[0]}.0 or newer "
            f"({cuda.MIN_DRIVER.get(nvcc[0], '?')}), and this one supports {cuda.text(driver)}"
        )
    return flags, "; ".join(problems) or None


def _cuda_plan(facts: MachineFacts, gpus: tuple[GpuDevice, ...]) -> _CudaPlan:
    release = _release(facts, gpus)
    flags, no_build = _build(facts, gpus)
    reasons = list(release.reasons)
    if not gpus:
        reasons.append(
            "no NVIDIA GPU here: a build compiles llama.cpp's default list of architectures, "
            "which takes several times longer than one for a single GPU"
        )
    elif release.major is None and no_build is None:
        reasons.append(f"so a build from source with nvcc {facts.nvcc}: {' '.join(flags)}")
    elif release.major is None:
        reasons.append(f"and no build: {no_build}")
    choice = BackendChoice(
        BACKEND_CUDA,
        tuple(reasons),
        cuda_major=release.major,
        no_release=release.why_not,
        build_flags=flags,
        no_build=no_build,
    )
    return _CudaPlan(choice, release.upgrade_to)


@dataclass(frozen=True)
class _CudaPlan:
    choice: BackendChoice
    upgrade_to: CudaVersion | None
    """The oldest driver CUDA version on which a release build would run on these GPUs."""

    @property
    def works(self) -> bool:
        return self.choice.cuda_major is not None or self.choice.no_build is None

    def fix(self) -> str:
        """What makes CUDA work when neither the release nor a build does."""
        driver = "upgrade the NVIDIA driver"
        if self.upgrade_to is not None:
            driver += f" to one that supports CUDA {cuda.text(self.upgrade_to)} or newer"
        return (
            f"{driver} (`nvidia-smi` shows the CUDA version a driver supports) or install a "
            f"CUDA toolkit that compiles for these GPUs, then run `{INSTALL}`"
        )
