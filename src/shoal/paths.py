"""Where Shoal keeps things on disk: one place that knows the layout of the cache folder."""

from __future__ import annotations

from pathlib import Path

import platformdirs


def default_cache_dir() -> Path:
    """The user's cache folder for Shoal (``~/.cache/shoal`` on Linux)."""
    return platformdirs.user_cache_path("shoal")


def default_data_dir() -> Path:
    """The user's data folder for Shoal (``~/.local/share/shoal`` on Linux)."""
    return platformdirs.user_data_path("shoal")


def llama_cpp_dir(cache_dir: Path, version: str, backend: str) -> Path:
    """Cached llama.cpp binaries for one version and backend."""
    return cache_dir / "llama.cpp" / f"{version}-{backend}"


def downloads_dir(cache_dir: Path) -> Path:
    """Downloaded archives (sdists, wheels) kept so a second set-up needs no network."""
    return cache_dir / "downloads"


def models_dir(cache_dir: Path) -> Path:
    """GGUF model files, one folder per model id."""
    return cache_dir / "models"


def logs_dir(cache_dir: Path) -> Path:
    """Logs of subprocesses Shoal runs (llama-server, builds)."""
    return cache_dir / "logs"


def llama_cpp_lock_file(cache_dir: Path, version: str, backend: str) -> Path:
    """Lock file held while one process builds llama.cpp for this version and backend."""
    return cache_dir / "llama.cpp" / f"{version}-{backend}.lock"


def rpc_cache_dir(cache_dir: Path, build: str) -> Path:
    """``LLAMA_CACHE`` for one llama.cpp build's ``ggml-rpc-server -c``: it keeps its tensor
    files in ``rpc/`` below (``llama_cpp.rpc_cache``)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in build) or "unknown"
    return cache_dir / "rpc-cache" / safe


def kv_saves_dir(cache_dir: Path) -> Path:
    """Slots' KV caches saved by llama-server (``--slot-save-path``), one folder per model
    (``worker/text/residency/kv_saves.py``)."""
    return cache_dir / "kv-saves"
