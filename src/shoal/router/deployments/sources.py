"""Where a split model's GGUF is, and its structure for the planner: the router's copy or a store.

A deployment names a model (``DeploymentSpec.source``). ``ModelSources.locate`` finds it, in
this order, and reads only what the planner needs (``GGUFInfo``: metadata and tensor table):

1. a catalog id the router holds, or the path of a ``.gguf`` it can open (``models.resolve``,
   nothing downloaded): the file is parsed here;
2. the router's own model store (``--storage``): parsed here too, its file is local;
3. the model stores given with ``--model-store``, in order, the first that lists the id: only
   the header is read, by HTTP ``Range`` (``store_client.fetch_header``), never the weights,
   and parsed as a sparse file of the model's size. Parsed headers are kept by store and
   sha256, so planning again asks the store only for its registry line.

A model found in a store is pinned by its sha256 (``StoreFile`` in every ``ShardStart``): the
head fetches that version whole, the stages their layers, from that store. A model in no store
raises ``ModelError`` naming the stores asked (404); a store that could not be asked, when no
other had the model, ``StoreUnreachable`` (503).
"""

from __future__ import annotations

import dataclasses
import logging
import ssl
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio.to_thread

from shoal.data.errors import ModelNotFound as NotInOwnStore
from shoal.data.store import ModelStore
from shoal.models.errors import ModelError, StoreUnreachable
from shoal.models.gguf_info import GGUFInfo, inspect, inspect_cached
from shoal.models.resolve import GGUF_SUFFIX, resolve_model
from shoal.models.store_client import RegistryEntry, fetch_header, find_entry
from shoal.protocol.messages import StoreFile

log = logging.getLogger(__name__)

KEPT_HEADERS = 16
"""Parsed store headers kept (by store and sha256); the oldest goes first."""


@dataclass(frozen=True)
class Located:
    """A model as the planner reads it: its id, structure, and the store it is in."""

    id: str
    info: GGUFInfo
    store: StoreFile | None = None
    """None: a catalog model or a path on the router (``pin`` says which file shards use)."""

    def where(self) -> str:
        """Where the router found it, for the plan and the status."""
        if self.store is None:
            return "router"
        return self.store.url or "router store"


class ModelSources:
    """Finds a deployment's model on the router or in model stores (see the module's doc)."""

    def __init__(
        self,
        cache_dir: Path,
        stores: Sequence[str] = (),
        *,
        api_key: str | None = None,
        tls: ssl.SSLContext | None = None,
        own_store: ModelStore | None = None,
    ) -> None:
        """``stores``: base URLs asked in order; ``api_key``: the key the router presents to
        them (a read key of theirs); ``own_store``: the router's ``--storage`` store."""
        self.cache_dir = cache_dir
        self.stores = tuple(s.rstrip("/") for s in stores)
        self.api_key = api_key
        self.tls = tls
        self.own_store = own_store
        self._headers: dict[tuple[str, str], GGUFInfo] = {}

    def asked(self) -> list[str]:
        """The stores a model id is looked up in, in order, as messages name them."""
        own = ["the router's own store (--storage)"] if self.own_store is not None else []
        return own + list(self.stores)

    async def locate(self, source: str) -> Located:
        """``source`` on the router or in a store, with its structure. Raises ``ModelError``
        (in no store: 404) or ``StoreUnreachable`` (a store could not be asked: 503)."""
        try:
            local = await anyio.to_thread.run_sync(self._resolve, source)
        except ModelError as exc:
            if source.lower().endswith(GGUF_SUFFIX) or not self.asked():
                raise
            return await self._in_stores(source, exc)
        info = await anyio.to_thread.run_sync(inspect_cached, local[1])
        return Located(local[0], info)

    def _resolve(self, source: str) -> tuple[str, Path]:
        local = resolve_model(source, self.cache_dir, download=False)
        return local.id, local.path

    async def _in_stores(self, source: str, here: ModelError) -> Located:
        if self.own_store is not None:
            found = await anyio.to_thread.run_sync(self._in_own_store, source)
            if found is not None:
                return found
        unreachable: list[str] = []
        for base in self.stores:
            try:
                entry = await find_entry(base, source, api_key=self.api_key, tls=self.tls)
            except StoreUnreachable as exc:
                log.warning("model %s: model store %s: %s", source, base, exc)
                unreachable.append(f"{base} ({exc})")
                continue
            if entry is not None:
                info = await self._store_info(base, entry)
                log.info("model %s: found in the model store at %s", source, base)
                return Located(entry.id, info, _pinned(base, entry))
        asked = ", ".join(self.asked())
        if unreachable:
            raise StoreUnreachable(
                f"model {source!r} is not on the router nor in the model stores that answered "
                f"(asked: {asked}); these could not be asked: {'; '.join(unreachable)}. Start "
                "the store or fix its URL (--model-store), then try again."
            )
        raise ModelError(
            f"model {source!r} is not a model the router has ({here}) and is in none of the "
            f"model stores asked: {asked}. Upload it to one (POST /api/v1/storage/upload) or "
            "give the router the store that has it (--model-store)."
        )

    def _in_own_store(self, source: str) -> Located | None:
        """``source`` in the router's own store (blocking: the first sha256 reads the file)."""
        assert self.own_store is not None
        try:
            model = self.own_store.get(source)
        except NotInOwnStore:
            return None
        info = inspect_cached(model.path)
        pinned = StoreFile(
            url=None, id=model.id, sha256=self.own_store.sha256(model), size=model.size
        )
        return Located(model.id, info, pinned)

    async def _store_info(self, base: str, entry: RegistryEntry) -> GGUFInfo:
        key = (base, entry.sha256)
        info = self._headers.get(key)
        if info is None:
            header = await fetch_header(base, entry, api_key=self.api_key, tls=self.tls)
            info = await anyio.to_thread.run_sync(info_from_header, header, entry)
            if len(self._headers) >= KEPT_HEADERS:
                self._headers.pop(next(iter(self._headers)))
            self._headers[key] = info
        return info


def info_from_header(header: bytes, entry: RegistryEntry) -> GGUFInfo:
    """The structure of a store's model from its header alone: parsed as a sparse file of the
    model's size (the tensor table's offsets stay inside it; no tensor data is read). Its
    ``path`` is the store's file name. Blocking."""
    with tempfile.TemporaryDirectory(prefix="shoal-header-") as folder:
        path = Path(folder) / Path(entry.filename).name
        with path.open("wb") as out:
            out.truncate(entry.size)
            out.write(header)
        info = inspect(path)
    return dataclasses.replace(info, path=Path(entry.filename))


def _pinned(base: str, entry: RegistryEntry) -> StoreFile:
    return StoreFile(url=base, id=entry.id, sha256=entry.sha256, size=entry.size)
