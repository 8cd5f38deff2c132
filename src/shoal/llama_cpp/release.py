"""The prebuilt llama.cpp of the pinned release, downloaded from GitHub into the cache.

llama.cpp publishes binaries for each build ``bNNNN`` as release assets on
``ggml-org/llama.cpp``. The names below follow the release workflow at the pinned commit
(``.github/workflows/release.yml`` and ``release-publish.yml`` inside the sdist): Linux and
macOS assets are ``.tar.gz`` archives with one top folder ``llama-<tag>/`` holding the
binaries and their shared libraries; Windows assets are flat ``.zip`` archives. CUDA
builds need a second asset with the CUDA runtime libraries, unpacked beside the binaries.

Each asset is checked against the sha256 GitHub computed at upload (the API's ``digest``),
or a sha256 pinned here; an asset with neither is refused. The binaries must run
(``llama-server --version``) before they are moved into the cache in one rename.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import shutil
import tempfile
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from shoal import paths
from shoal.llama_cpp.archive import extract
from shoal.llama_cpp.backend import (
    BACKEND_CUDA,
    BACKEND_METAL,
    BACKEND_ROCM,
    BACKEND_VULKAN,
    normalize_machine,
)
from shoal.llama_cpp.binaries import (
    LLAMA_SERVER_NAME,
    Binaries,
    cached_release,
    release_install_dir,
    rpc_server_beside,
)
from shoal.llama_cpp.build import BIN_DIR_MODE, exclusive_lock
from shoal.llama_cpp.cuda import DEFAULT_CUDA_MAJOR, RELEASE_CUDA
from shoal.llama_cpp.download import download_file, get_json
from shoal.llama_cpp.errors import LlamaCppError
from shoal.llama_cpp.source import BACKEND_CPU, LLAMA_CPP_RELEASE_TAG
from shoal.llama_cpp.version import server_version

logger = logging.getLogger(__name__)

RELEASE_TAG = LLAMA_CPP_RELEASE_TAG
"""The upstream release matching the pinned sdist (see ``source.LLAMA_CPP_RELEASE_TAG``)."""
RELEASE_REPO = "ggml-org/llama.cpp"
GITHUB_API_URL = "https://api.github.com"
GITHUB_API_VERSION = "2022-11-28"
CONNECT_TIMEOUT_S = 10.0
"""How long to wait for GitHub to answer: short, so an offline machine falls back quickly."""
DOWNLOAD_STALL_TIMEOUT_S = 60.0
"""How long an asset download may stall before it is given up (it resumes next time)."""
RELEASE_INFO_NAME = "release-info.json"

PINNED_SHA256: dict[str, str] = {}
"""sha256 of assets whose release JSON has no ``digest`` (GitHub adds one to every asset
uploaded since 2025-06, so the pinned release needs none); asset name -> hex digest."""

# (system, arch, backend) -> the platform part of the asset name, for all but CUDA.
_PLATFORM_PART: dict[tuple[str, str, str], str] = {
    ("linux", "x64", BACKEND_CPU): "ubuntu-x64",
    ("linux", "arm64", BACKEND_CPU): "ubuntu-arm64",
    ("linux", "s390x", BACKEND_CPU): "ubuntu-s390x",
    ("linux", "x64", BACKEND_VULKAN): "ubuntu-vulkan-x64",
    ("linux", "arm64", BACKEND_VULKAN): "ubuntu-vulkan-arm64",
    ("linux", "x64", BACKEND_ROCM): "ubuntu-rocm-10.0-x64",
    # The arm64 macOS build has Metal and the CPU backend (``--device none`` for CPU only);
    # the x64 one is built with Metal off.
    ("darwin", "arm64", BACKEND_METAL): "macos-arm64",
    ("darwin", "arm64", BACKEND_CPU): "macos-arm64",
    ("darwin", "x64", BACKEND_CPU): "macos-x64",
    ("windows", "x64", BACKEND_CPU): "win-cpu-x64",
    ("windows", "arm64", BACKEND_CPU): "win-cpu-arm64",
    ("windows", "x64", BACKEND_VULKAN): "win-vulkan-x64",
    ("windows", "arm64", BACKEND_VULKAN): "win-vulkan-arm64",
    ("windows", "x64", BACKEND_ROCM): "win-rocm-10.0-x64",
}
_BUILD_NUMBER_RE = re.compile(r"\(build (\d+)\b")


@dataclass(frozen=True)
class ReleaseAsset:
    """One downloadable file of a release, with the sha256 it must have."""

    name: str
    url: str
    size: int
    sha256: str


def asset_name(
    tag: str, system: str, machine: str, backend: str, *, cuda_major: int | None = None
) -> str | None:
    """The release asset with llama-server for this platform and backend; None if none exists.

    ``system`` and ``machine`` are as ``platform.system()`` and ``platform.machine()`` say.
    """
    system, arch = system.lower(), normalize_machine(machine)
    ext = "zip" if system == "windows" else "tar.gz"
    if backend == BACKEND_CUDA:
        toolkit = _cuda_toolkit(system, arch, cuda_major)
        if toolkit is None:
            return None
        os_part = "win" if system == "windows" else "ubuntu"
        return f"llama-{tag}-bin-{os_part}-cuda-{toolkit}-{arch}.{ext}"
    part = _PLATFORM_PART.get((system, arch, backend))
    return None if part is None else f"llama-{tag}-bin-{part}.{ext}"


def runtime_asset_name(
    tag: str, system: str, machine: str, backend: str, *, cuda_major: int | None = None
) -> str | None:
    """The asset with the runtime libraries the main asset needs beside it (CUDA only)."""
    system, arch = system.lower(), normalize_machine(machine)
    if backend != BACKEND_CUDA:
        return None
    toolkit = _cuda_toolkit(system, arch, cuda_major)
    if toolkit is None:
        return None
    if system == "windows":  # the Windows runtime zips carry no tag in their name
        return f"cudart-llama-bin-win-cuda-{toolkit}-{arch}.zip"
    return f"cudart-llama-{tag}-bin-ubuntu-cuda-{toolkit}-{arch}.tar.gz"


def _cuda_toolkit(system: str, arch: str, cuda_major: int | None) -> str | None:
    """The toolkit in the asset's name (``cuda.RELEASE_CUDA``); None if there is no such build."""
    major = cuda_major if cuda_major is not None else DEFAULT_CUDA_MAJOR.get(arch)
    return None if major is None else RELEASE_CUDA.get((system, arch), {}).get(major)


def release_api_url(api_url: str, tag: str) -> str:
    """The GitHub REST endpoint describing release ``tag`` of llama.cpp."""
    return f"{api_url.rstrip('/')}/repos/{RELEASE_REPO}/releases/tags/{tag}"


def parse_assets(
    release: object, *, pinned: dict[str, str] | None = None
) -> dict[str, ReleaseAsset | str]:
    """The assets of a GitHub release JSON, by name.

    An asset whose sha256 is known (the API's ``digest`` or ``pinned``) maps to a
    ReleaseAsset; one without maps to a sentence explaining why it cannot be used.
    """
    pins = PINNED_SHA256 if pinned is None else pinned
    if not isinstance(release, dict) or not isinstance(release.get("assets"), list):
        raise LlamaCppError("the GitHub release JSON has no 'assets' list")
    found: dict[str, ReleaseAsset | str] = {}
    for raw in release["assets"]:
        if not isinstance(raw, dict):
            continue
        name, url, size = raw.get("name"), raw.get("browser_download_url"), raw.get("size")
        if not (isinstance(name, str) and isinstance(url, str) and isinstance(size, int)):
            continue
        sha256 = _asset_sha256(name, raw.get("digest"), pins)
        found[name] = ReleaseAsset(name, url, size, sha256) if _is_hex64(sha256) else sha256
    return found


def _asset_sha256(name: str, digest: object, pins: dict[str, str]) -> str:
    """The asset's sha256 (hex), or a sentence saying why it has none we can trust."""
    from_api = None
    if isinstance(digest, str) and digest.startswith("sha256:"):
        from_api = digest.removeprefix("sha256:").lower()
    pinned = pins.get(name)
    if from_api is not None and pinned is not None and from_api != pinned:
        return f"GitHub's sha256 for {name} ({from_api}) is not the one Shoal pins ({pinned})"
    chosen = pinned or from_api
    if chosen is None or not _is_hex64(chosen):
        return f"GitHub gives no sha256 digest for {name} and Shoal pins none"
    return chosen


def _is_hex64(text: str) -> bool:
    return re.fullmatch(r"[0-9a-f]{64}", text) is not None


def fetch_release(
    cache_dir: Path,
    backend: str = BACKEND_CPU,
    *,
    api_url: str = GITHUB_API_URL,
    token: str | None = None,
    timeout: float = CONNECT_TIMEOUT_S,
    system: str | None = None,
    machine: str | None = None,
    cuda_major: int | None = None,
) -> Binaries:
    """The pinned release's binaries for ``backend``, downloaded into the cache unless there.

    ``system``/``machine`` default to this machine's. LlamaCppError (with the reason and
    what to do) when there is no prebuilt for this platform, GitHub cannot be reached, an
    asset fails verification or the binaries do not run; nothing is installed then.
    """
    existing = cached_release(cache_dir, backend)
    if existing is not None:
        return existing
    system = system or platform.system()
    machine = machine or platform.machine()
    names = _asset_names(system, machine, backend, cuda_major)
    release = get_json(
        release_api_url(api_url, RELEASE_TAG), headers=_api_headers(token), timeout=timeout
    )
    assets = parse_assets(release)
    main = _pick(assets, names[0], required=True)
    runtime = _pick(assets, names[1], required=False) if names[1] else None
    lock_path = paths.llama_cpp_lock_file(cache_dir, f"{RELEASE_TAG}-release", backend)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(lock_path, waiting="downloading"):
        existing = cached_release(cache_dir, backend)
        if existing is not None:
            return existing
        wanted = [a for a in (main, runtime) if a is not None]
        archives = [_download(cache_dir, a, timeout) for a in wanted]
        try:
            _install(archives, release_install_dir(cache_dir, backend), _info(backend, wanted))
        finally:
            for archive in archives:
                archive.unlink(missing_ok=True)
    installed = cached_release(cache_dir, backend, source="download")
    if installed is None:
        raise LlamaCppError(
            f"the download finished but {release_install_dir(cache_dir, backend)}"
            " has no llama-server"
        )
    return installed


def _asset_names(
    system: str, machine: str, backend: str, cuda_major: int | None
) -> tuple[str, str | None]:
    name = asset_name(RELEASE_TAG, system, machine, backend, cuda_major=cuda_major)
    if name is None:
        raise LlamaCppError(
            f"llama.cpp {RELEASE_TAG} publishes no prebuilt {backend} binaries for "
            f"{system}/{machine}; build it from source instead (`shoal llama-cpp install "
            "--from build`)."
        )
    runtime = runtime_asset_name(RELEASE_TAG, system, machine, backend, cuda_major=cuda_major)
    return name, runtime


def _api_headers(token: str | None) -> dict[str, str]:
    headers = {"Accept": "application/vnd.github+json", "X-GitHub-Api-Version": GITHUB_API_VERSION}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


def _pick(
    assets: dict[str, ReleaseAsset | str], name: str, *, required: bool
) -> ReleaseAsset | None:
    found = assets.get(name)
    if isinstance(found, ReleaseAsset):
        return found
    if found is not None:
        raise LlamaCppError(
            f"{found}; refusing to install an unverified binary. Build from source instead "
            "(`shoal llama-cpp install --from build`)."
        )
    if required:
        raise LlamaCppError(
            f"llama.cpp release {RELEASE_TAG} has no asset {name}; build from source instead "
            "(`shoal llama-cpp install --from build`)."
        )
    logger.warning(
        "llama.cpp release %s has no %s; using the system's libraries", RELEASE_TAG, name
    )
    return None


def _download(cache_dir: Path, asset: ReleaseAsset, timeout: float) -> Path:
    target = paths.downloads_dir(cache_dir) / asset.name
    return download_file(
        asset.url,
        target,
        size=asset.size,
        sha256=asset.sha256,
        timeout=max(timeout, DOWNLOAD_STALL_TIMEOUT_S),
        description=f"Downloading {asset.name}",
    )


def _info(backend: str, assets: list[ReleaseAsset]) -> dict[str, object]:
    return {
        "release_tag": RELEASE_TAG,
        "repository": RELEASE_REPO,
        "backend": backend,
        "assets": [
            {"name": a.name, "url": a.url, "size": a.size, "sha256": a.sha256} for a in assets
        ],
        "downloaded_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def _install(archives: list[Path], install_dir: Path, info: dict[str, object]) -> None:
    """Unpack, check that llama-server runs, and move its folder to ``install_dir/bin``."""
    install_dir.mkdir(parents=True, exist_ok=True)
    for leftover in install_dir.glob(".release-*"):  # from a killed download
        shutil.rmtree(leftover, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=".release-", dir=install_dir))
    final = install_dir / "bin"
    try:
        extract(archives[0], staging / "main")
        bin_folder = find_bin_folder(staging / "main")
        for extra in archives[1:]:
            _add_runtime(extra, staging / extra.name, bin_folder)
        info["server_version"] = _check_runs(bin_folder / LLAMA_SERVER_NAME)
        bin_folder.chmod(BIN_DIR_MODE)
        info_tmp = install_dir / f".{RELEASE_INFO_NAME}.tmp"
        info_tmp.write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
        os.replace(info_tmp, install_dir / RELEASE_INFO_NAME)
        if final.exists():
            shutil.rmtree(final)
        os.replace(bin_folder, final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("installed llama.cpp %s (%s) in %s", RELEASE_TAG, info["server_version"], final)


def find_bin_folder(root: Path) -> Path:
    """The folder inside an unpacked release that holds llama-server (and its libraries)."""
    found = sorted(
        (p for p in root.rglob(LLAMA_SERVER_NAME) if p.is_file() and not p.is_symlink()),
        key=lambda p: len(p.parts),
    )
    if not found:
        raise LlamaCppError(
            f"the llama.cpp {RELEASE_TAG} archive has no {LLAMA_SERVER_NAME}; build from "
            "source instead (`shoal llama-cpp install --from build`)."
        )
    folder = found[0].parent
    if rpc_server_beside(found[0]) is None:
        logger.warning(
            "the llama.cpp %s archive has no RPC server beside llama-server; this node will "
            "not be able to take part in a split model",
            RELEASE_TAG,
        )
    return folder


def _add_runtime(archive: Path, unpack_dir: Path, bin_folder: Path) -> None:
    """Put the runtime libraries of ``archive`` beside the binaries (they load from there)."""
    extract(archive, unpack_dir)
    for path in sorted(unpack_dir.rglob("*")):
        if path.is_file() and not path.is_symlink():
            os.replace(path, bin_folder / path.name)


def _check_runs(llama_server: Path) -> str:
    try:
        version = server_version(llama_server)
    except LlamaCppError as exc:
        raise LlamaCppError(
            f"the downloaded llama.cpp {RELEASE_TAG} does not run on this machine: {exc}\n"
            "Build it from source instead (`shoal llama-cpp install --from build`)."
        ) from exc
    match = _BUILD_NUMBER_RE.search(version)
    if match is not None and f"b{match.group(1)}" != RELEASE_TAG:
        logger.warning(
            "the %s release's llama-server says it is build %s (%s)",
            RELEASE_TAG,
            match.group(1),
            version,
        )
    return version
