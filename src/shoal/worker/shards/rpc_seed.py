"""Pre-seeding a stage: its layers' weights go into its ``ggml-rpc-server`` cache first.

When the head loads a split model, llama.cpp asks each stage for every weight tensor over
10 MiB by hash before sending it (``llama_cpp.rpc_cache``); a stage that already holds the
file sends nothing back but "yes". So before a stage starts, it reads the tensors the plan
gives it (``stage_tensors``: its layers, and the output layer on the last stage) from its own
copy of the GGUF and writes each into the cache under that hash. The head's weights then
never cross the network, the router's tunnel included; only tensors of 10 MiB or less do.

Which hash belongs to which tensor is remembered in an index beside the cache (by the file's
identity, tensor name and offset), so a redeploy finds its entries without reading the GGUF
again; every entry is still hashed again before it is relied on.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from shoal.llama_cpp.rpc_cache import RpcCache, tensor_hash
from shoal.models.gguf_info import TensorInfo, inspect_cached
from shoal.models.stage_tensors import stage_tensors
from shoal.protocol.shards import SeedReport

log = logging.getLogger(__name__)

INDEX = "shoal-index.json"
"""Beside ``rpc/`` in the ``LLAMA_CACHE`` folder: ``{file key: {tensor key: hash}}``."""


@dataclass(frozen=True, slots=True)
class SeedOrder:
    """What one stage pre-seeds."""

    deployment: str
    gguf: Path
    first: int
    last: int
    output: bool
    source: str = "local"


def seed(cache: RpcCache, order: SeedOrder) -> SeedReport:
    """Put the stage's hashed tensors into ``cache``, then keep it in budget. Blocking."""
    began = time.monotonic()
    info = inspect_cached(order.gguf)
    tensors = stage_tensors(info, order.first, order.last, order.output)
    index = _Index(cache.llama_cache / INDEX, _file_key(order.gguf))
    cached = fetched = 0
    digests: list[int] = []
    with order.gguf.open("rb") as f:
        for t in tensors:
            digest, read = _seed_one(cache, index, f, t)
            digests.append(digest)
            cached += read == 0
            fetched += read
    index.save()
    cache.evict(keep=digests)
    report = SeedReport(
        tensors=len(tensors),
        bytes=sum(t.nbytes for t in tensors),
        cached=cached,
        fetched_bytes=fetched,
        seconds=round(time.monotonic() - began, 3),
        source=order.source,
    )
    log.info(
        "deployment %s: pre-seeded layers %d-%d%s: %d tensors (%d cached), %d bytes read, %.2f s",
        order.deployment,
        order.first,
        order.last,
        " and the output" if order.output else "",
        report.tensors,
        report.cached,
        report.fetched_bytes,
        report.seconds,
    )
    return report


def _seed_one(cache: RpcCache, index: _Index, f: BinaryIO, t: TensorInfo) -> tuple[int, int]:
    """One tensor into the cache: its hash, and the bytes read for it (0: it was there)."""
    digest = index.get(t)
    if digest is not None and cache.has(digest, t.nbytes):
        return digest, 0
    data = _read(f, t)
    digest = tensor_hash(data)
    index.set(t, digest)
    if cache.has(digest, t.nbytes):  # the index did not know it (ggml-rpc-server saved it)
        return digest, 0
    cache.put(data, digest)
    return digest, t.nbytes


def _read(f: BinaryIO, t: TensorInfo) -> bytes:
    f.seek(t.offset)
    data = f.read(t.nbytes)
    if len(data) != t.nbytes:
        raise OSError(f"the file ends inside tensor {t.name}")
    return data


def _file_key(path: Path) -> str:
    st = path.stat()
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"


class _Index:
    """Tensor -> hash, per GGUF file (a hint only: entries are checked before use)."""

    def __init__(self, path: Path, file_key: str) -> None:
        self.path = path
        self.file_key = file_key
        try:
            loaded = json.loads(path.read_text())
            self.data: dict[str, dict[str, str]] = loaded if isinstance(loaded, dict) else {}
        except (FileNotFoundError, ValueError):
            self.data = {}
        self.changed = False

    @staticmethod
    def _key(t: TensorInfo) -> str:
        return f"{t.name}@{t.offset}+{t.nbytes}"

    def get(self, t: TensorInfo) -> int | None:
        value = self.data.get(self.file_key, {}).get(self._key(t))
        return int(value, 16) if isinstance(value, str) else None

    def set(self, t: TensorInfo, digest: int) -> None:
        self.data.setdefault(self.file_key, {})[self._key(t)] = f"{digest:016x}"
        self.changed = True

    def save(self) -> None:
        """Write it back, merged with what other stages on this machine saved meanwhile."""
        if not self.changed:
            return
        mine = self.data.get(self.file_key, {})
        self.data = _Index(self.path, self.file_key).data
        self.data[self.file_key] = self.data.get(self.file_key, {}) | mine
        self.path.parent.mkdir(parents=True, exist_ok=True)
        part = self.path.with_name(f".{self.path.name}.{os.getpid()}.part")
        part.write_text(json.dumps(self.data))
        os.replace(part, self.path)
