"""The llama.cpp options every process that runs llama-server shares, and using them."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from pydantic import Field, SecretStr

from shoal.hardware.detect import detect_machine
from shoal.hardware.profile import GpuDevice
from shoal.llama_cpp.backend import BackendChoice, choose_backend
from shoal.llama_cpp.binaries import Binaries
from shoal.llama_cpp.facts import gather
from shoal.llama_cpp.locate import Preference, resolve
from shoal.llama_cpp.release import GITHUB_API_URL
from shoal.settings import CommonSettings

log = logging.getLogger(__name__)


class LlamaCppOptions(CommonSettings):
    """Mixed into the settings of ``worker``, ``up`` and ``llama-cpp``."""

    llama_server_path: Path | None = Field(
        None,
        description="llama-server binary to use instead of the cached, downloaded or built one.",
    )
    llama_cpp_backend: str = Field(
        "auto",
        description="llama.cpp backend: auto (follows the drivers: CUDA with an NVIDIA GPU and "
        "driver, Metal on Apple Silicon, ROCm with AMD GPUs and ROCm, Vulkan with a Vulkan "
        "driver, else CPU; `shoal doctor` says why), cpu, cuda, metal, vulkan or rocm.",
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


def backend_choice(
    options: LlamaCppOptions, path_env: str | None, gpus: Sequence[GpuDevice] | None = None
) -> BackendChoice:
    """The backend these options ask for on this machine (``gpus``: those detected, None to
    detect them now), and why."""
    if gpus is None:
        gpus = detect_machine().gpus
    facts = gather(gpus, path_env=path_env, vulkan_sdk=os.environ.get("VULKAN_SDK"))
    choice = choose_backend(facts, options.llama_cpp_backend)
    log.info("llama.cpp backend %s", choice.describe())
    return choice


def binaries(
    options: LlamaCppOptions,
    path_env: str | None,
    *,
    allow_build: bool = True,
    gpus: Sequence[GpuDevice] | None = None,
    choice: BackendChoice | None = None,
) -> Binaries:
    """The llama-server (and RPC server) these options select; may download or build.

    ``choice``: :func:`backend_choice` when the caller has it, else it is made here from
    ``gpus`` (this machine's, as detected; None: detected here)."""
    token = options.github_token.get_secret_value() if options.github_token else None
    explicit = options.llama_server_path
    return resolve(
        explicit=explicit,
        cache_dir=options.cache_dir,
        path_env=path_env,
        allow_build=allow_build,
        choice=None if explicit is not None else choice or backend_choice(options, path_env, gpus),
        prefer=options.llama_cpp_from,
        github_url=options.github_url,
        github_token=token,
    )
