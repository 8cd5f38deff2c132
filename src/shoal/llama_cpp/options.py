"""The llama.cpp options every process that runs llama-server shares, and using them."""

from __future__ import annotations

import platform
from pathlib import Path

from pydantic import Field, SecretStr

from shoal.llama_cpp.backend import detect_backend
from shoal.llama_cpp.binaries import Binaries
from shoal.llama_cpp.locate import Preference, resolve
from shoal.llama_cpp.release import GITHUB_API_URL
from shoal.settings import CommonSettings


class LlamaCppOptions(CommonSettings):
    """Mixed into the settings of ``worker``, ``up`` and ``llama-cpp``."""

    llama_server_path: Path | None = Field(
        None,
        description="llama-server binary to use instead of the cached, downloaded or built one.",
    )
    llama_cpp_backend: str = Field(
        "auto",
        description="llama.cpp backend: auto (CUDA with nvcc and an NVIDIA GPU, Metal on Apple "
        "Silicon, Vulkan with its SDK, else CPU), cpu, cuda, metal, vulkan or rocm.",
    )
    llama_cpp_from: Preference = Field(
        "auto",
        description="Where to get llama.cpp: auto (the pinned GitHub release, else build from "
        "the pinned PyPI sdist), release, or build.",
    )
    github_url: str = Field(
        GITHUB_API_URL, description="GitHub API base for release downloads (or a mirror of it)."
    )
    github_token: SecretStr | None = Field(
        None, description="GitHub token for release downloads (raises GitHub's rate limit)."
    )


def binaries(
    options: LlamaCppOptions, path_env: str | None, *, allow_build: bool = True
) -> Binaries:
    """The llama-server (and RPC server) these options select; may download or build."""
    backend = detect_backend(
        options.llama_cpp_backend,
        system=platform.system(),
        machine=platform.machine(),
        path_env=path_env,
    )
    token = options.github_token.get_secret_value() if options.github_token else None
    return resolve(
        explicit=options.llama_server_path,
        cache_dir=options.cache_dir,
        path_env=path_env,
        allow_build=allow_build,
        backend=backend,
        prefer=options.llama_cpp_from,
        github_url=options.github_url,
        github_token=token,
    )
