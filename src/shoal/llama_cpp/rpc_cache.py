"""``ggml-rpc-server``'s tensor cache (``-c``): what its files are named and how Shoal fills it.

Verified in the pinned llama.cpp (b11434):

* ``ggml/src/ggml-rpc/ggml-rpc.cpp``: ``ggml_backend_rpc_buffer_set_tensor`` (and the async
  variant) first sends ``RPC_CMD_SET_TENSOR_HASH`` when ``size > HASH_THRESHOLD`` (10 MiB) and
  the buffer's usage is ``GGML_BACKEND_BUFFER_USAGE_WEIGHTS`` (``rpc_use_hash_cache``). The
  hash is ``fnv_hash(data, size)``: FNV-1a 64-bit over exactly the bytes of that one call.
  The server answers from ``<cache>/<%016 PRIx64 hash>`` when that file exists (it reads the
  whole file and does **not** check its hash: ``rpc_server::get_cached_file``), otherwise the
  client sends the bytes with ``cache_flag = 1`` and the server saves them under that name.
* ``src/llama-model.cpp`` marks every model buffer ``USAGE_WEIGHTS`` before loading, and
  ``src/llama-model-loader.cpp`` ``load_all_data`` uploads each tensor to a non-host buffer
  (an RPC device's) with **one** ``ggml_backend_tensor_set(cur, data, 0, ggml_nbytes(cur))``:
  from the mapping when mmap (the default ``--load-mode``) or a lazy read is in use, and from
  a whole-tensor read buffer otherwise. Only the pinned-memory path (no mmap, and buffer 0's
  device async with host buffers and events, i.e. a GPU head) uploads in 1 MiB chunks, which
  are under the threshold and so never hashed. ``data`` is the tensor's bytes as stored in the
  GGUF, whatever its type (nothing is converted or repacked on the way to an RPC buffer).

So the file ``ggml-rpc-server`` looks for is the FNV-1a-64 of the tensor's bytes in the GGUF
file, named in 16 lowercase hex digits; ``tests/llama_cpp/test_rpc_cache.py`` proves it
against the files ``ggml-rpc-server`` writes itself.

``RpcCache`` is that folder as Shoal manages it: entries are written atomically, checked
(hashed again) before a deploy relies on them, and the folder is kept under a byte budget by
dropping the least recently used entries (their modification time is "last used").
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from fnv_c import fnv1a_64

log = logging.getLogger(__name__)

HASH_THRESHOLD = 10 * 1024 * 1024
"""``ggml-rpc.cpp``: only tensors strictly larger than this are looked up by hash."""
SUBDIR = "rpc"
"""``tools/rpc/rpc-server.cpp``: the cache is ``$LLAMA_CACHE/rpc/``."""


def tensor_hash(data: bytes) -> int:
    """``fnv_hash`` of ``ggml-rpc.cpp``: FNV-1a, 64 bits."""
    return int(fnv1a_64(data))


def entry_name(digest: int) -> str:
    """The file name ``ggml-rpc-server`` uses for a hash (``%016`` ``PRIx64``)."""
    return f"{digest:016x}"


def hashed(nbytes: int) -> bool:
    """Whether llama.cpp looks a weight tensor of this size up in the cache."""
    return nbytes > HASH_THRESHOLD


@dataclass(frozen=True, slots=True)
class Evicted:
    files: int
    bytes: int


class RpcCache:
    """The ``rpc/`` folder of one ``LLAMA_CACHE``, bounded to ``max_bytes``."""

    def __init__(self, llama_cache: Path, max_bytes: int) -> None:
        self.llama_cache = llama_cache
        self.folder = llama_cache / SUBDIR
        self.max_bytes = max_bytes

    def path(self, digest: int) -> Path:
        return self.folder / entry_name(digest)

    def has(self, digest: int, size: int) -> bool:
        """Whether a good entry for ``digest`` is there (size and hash checked); marks it used.

        A bad entry (torn, or changed on disk) is removed: ``ggml-rpc-server`` would load it
        without checking.
        """
        path = self.path(digest)
        try:
            if path.stat().st_size == size and tensor_hash(path.read_bytes()) == digest:
                os.utime(path)
                return True
        except FileNotFoundError:
            return False
        log.warning("rpc cache: %s is damaged; removing it", path)
        path.unlink(missing_ok=True)
        return False

    def put(self, data: bytes, digest: int | None = None) -> int:
        """Store ``data`` under its hash (atomically); returns the hash. ``digest``: the hash
        of ``data`` when the caller has it already."""
        if digest is None:
            digest = tensor_hash(data)
        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.path(digest)
        part = path.with_name(f".{path.name}.{os.getpid()}.part")
        try:
            with part.open("wb") as f:
                f.write(data)
            os.replace(part, path)
        finally:
            part.unlink(missing_ok=True)
        return digest

    def entries(self) -> list[Path]:
        try:
            return [p for p in self.folder.iterdir() if p.is_file() and not p.name.startswith(".")]
        except FileNotFoundError:
            return []

    def size(self) -> int:
        return sum(_size(p) for p in self.entries())

    def evict(self, keep: Iterable[int] = ()) -> Evicted:
        """Remove least recently used entries until the folder fits ``max_bytes``.

        Entries in ``keep`` (a deploy's own tensors) stay even if the budget is exceeded.
        """
        kept = {entry_name(d) for d in keep}
        stats = [(p, p.stat()) for p in self.entries()]
        total = sum(s.st_size for _, s in stats)
        files = freed = 0
        for p, s in sorted(stats, key=lambda ps: ps[1].st_mtime_ns):
            if total <= self.max_bytes:
                break
            if p.name in kept:
                continue
            with contextlib.suppress(FileNotFoundError):
                p.unlink()
                total -= s.st_size
                files, freed = files + 1, freed + s.st_size
        if files:
            log.info("rpc cache %s: evicted %d entries (%d bytes)", self.folder, files, freed)
        return Evicted(files, freed)


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except FileNotFoundError:
        return 0
