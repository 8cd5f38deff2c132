"""The model store: a folder of ``.gguf`` files, each known by its id (file stem, lowercased).

The folder is the only state. A file's sha256 is computed once and kept in a hidden sidecar
(``.NAME.gguf.sha256``) keyed by the file's size and mtime, so a restart does not hash again
and a replaced file is never described by a stale hash. GGUF metadata is parsed on first use
and cached in memory by path, size and mtime. An upload's hash and metadata, known once it is
checked, go straight into both caches.

Methods are blocking (disk I/O, hashing); async callers run them in a thread. ``upload`` is the
exception: it consumes a request body and does its own blocking work in threads.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import threading
from collections.abc import AsyncIterable
from dataclasses import dataclass
from pathlib import Path

import anyio.to_thread

from shoal.data.errors import BadRequest, ModelChanged, ModelExists, ModelNotFound, UnreadableModel
from shoal.data.http_range import OpenFile
from shoal.data.pull_plan import layer_byte_ranges
from shoal.data.settings import DEFAULT_MAX_UPLOAD_BYTES
from shoal.data.upload import TEMP_PREFIX, TEMP_SUFFIX, Upload, too_large
from shoal.models.byte_ranges import ByteRange
from shoal.models.errors import ModelError
from shoal.models.gguf_info import GGUFInfo, inspect
from shoal.models.store_client import RegistryEntry
from shoal.pip_download import file_sha256

log = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
SIDECAR_SUFFIX = ".sha256"
_MODEL_ID = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class StoredModel:
    id: str
    path: Path
    size: int
    mtime_ns: int

    @property
    def filename(self) -> str:
        return self.path.name


class ModelStore:
    """The models in ``storage``; thread-safe, so blocking calls may run in worker threads."""

    def __init__(self, storage: Path) -> None:
        self.storage = storage.expanduser().absolute()
        self.storage.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()  # guards the caches below
        self._commit_lock = threading.Lock()
        self._hashes: dict[Path, tuple[int, int, str]] = {}
        self._infos: dict[Path, tuple[int, int, GGUFInfo]] = {}
        self._hash_locks: dict[Path, threading.Lock] = {}

    # Listing

    def models(self) -> list[StoredModel]:
        """Every ``*.gguf`` file in the folder, by id; on an id clash the first name wins."""
        found: dict[str, StoredModel] = {}
        try:
            entries = sorted(os.scandir(self.storage), key=lambda e: e.name)
        except FileNotFoundError:
            log.warning("storage folder %s is gone; no models to serve", self.storage)
            return []
        for entry in entries:
            name = entry.name
            if name.startswith(".") or not name.lower().endswith(GGUF_SUFFIX):
                continue
            if not entry.is_file():
                continue
            model_id = name[: -len(GGUF_SUFFIX)].lower()
            if model_id in found:
                log.warning(
                    "%s has the same id (%s) as %s; ignored",
                    name,
                    model_id,
                    found[model_id].filename,
                )
                continue
            st = entry.stat()
            found[model_id] = StoredModel(model_id, Path(entry.path), st.st_size, st.st_mtime_ns)
        return list(found.values())

    def get(self, model_id: str) -> StoredModel:
        wanted = model_id.lower()
        models = self.models()
        for model in models:
            if model.id == wanted:
                return model
        known = ", ".join(m.id for m in models) or "none yet"
        raise ModelNotFound(
            f"No model {model_id!r} in this store (it has: {known}). "
            "GET /api/v1/models/registry lists them; POST /api/v1/storage/upload adds one.",
            param="id",
        )

    def registry_entry(self, model: StoredModel) -> RegistryEntry:
        """One line of the registry; structure fields are null for a file that cannot be read."""
        try:
            info: GGUFInfo | None = self.info(model)
        except UnreadableModel as exc:
            log.warning("model %s: %s", model.id, exc.message)
            info = None
        return RegistryEntry(
            id=model.id,
            filename=model.filename,
            size=model.size,
            sha256=self.sha256(model),
            architecture=info.architecture if info else None,
            n_layers=info.n_layers if info else None,
            quantization=info.quantization if info else None,
        )

    # What a file holds

    def info(self, model: StoredModel) -> GGUFInfo:
        """The file's GGUF structure, parsed once per path, size and mtime."""
        with self._lock:
            cached = self._infos.get(model.path)
        if cached is not None and cached[:2] == (model.size, model.mtime_ns):
            return cached[2]
        try:
            info = inspect(model.path)
        except ModelError as exc:
            raise UnreadableModel(
                f"The store's file {model.filename} cannot be read as a GGUF model: {exc} "
                "Replace it (upload with overwrite=true) or remove it from the storage folder."
            ) from None
        with self._lock:
            self._infos[model.path] = (model.size, model.mtime_ns, info)
        return info

    def layer_ranges(self, model_id: str, start: int, end: int) -> tuple[ByteRange, ...]:
        """The byte ranges a worker needs for layers ``start..end`` (inclusive); see pull_plan."""
        model = self.get(model_id)
        try:
            return layer_byte_ranges(self.info(model), start, end)
        except ValueError as exc:
            raise BadRequest(f"Model {model.id}: {exc}", param="layers") from None

    def sha256(self, model: StoredModel) -> str:
        """The file's sha256: from memory, from its sidecar, or hashed once (then remembered)."""
        key = (model.size, model.mtime_ns)
        with self._lock:
            cached = self._hashes.get(model.path)
            lock = self._hash_locks.setdefault(model.path, threading.Lock())
        if cached is not None and cached[:2] == key:
            return cached[2]
        with lock:  # one hash per file at a time; a second caller waits for the first
            digest = self._read_sidecar(model) or self._hash(model)
            with self._lock:
                self._hashes[model.path] = (*key, digest)
            return digest

    def _hash(self, model: StoredModel) -> str:
        log.info("computing sha256 of %s (%d bytes)", model.filename, model.size)
        digest = file_sha256(model.path)
        st = model.path.stat()
        if (st.st_size, st.st_mtime_ns) != (model.size, model.mtime_ns):
            raise ModelChanged(
                f"Model {model.id} was replaced while it was being hashed; retry the request."
            )
        self._write_sidecar(model, digest)
        return digest

    def _sidecar(self, path: Path) -> Path:
        return path.with_name(f".{path.name}{SIDECAR_SUFFIX}")

    def _read_sidecar(self, model: StoredModel) -> str | None:
        try:
            data = json.loads(self._sidecar(model.path).read_text())
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or [data.get("size"), data.get("mtime_ns")] != [
            model.size,
            model.mtime_ns,
        ]:
            return None
        digest = data.get("sha256")
        return digest if isinstance(digest, str) and _SHA256.match(digest) else None

    def _write_sidecar(self, model: StoredModel, digest: str) -> None:
        sidecar = self._sidecar(model.path)
        tmp = sidecar.with_name(sidecar.name + ".tmp")
        record = {"size": model.size, "mtime_ns": model.mtime_ns, "sha256": digest}
        try:
            tmp.write_text(json.dumps(record))
            os.replace(tmp, sidecar)
        except OSError as exc:  # a read-only folder still serves; it hashes after a restart
            log.warning("cannot save the sha256 of %s in %s: %s", model.filename, sidecar, exc)

    async def open_file(self, model_id: str) -> OpenFile:
        """The model's file, opened, with the size and sha256 of exactly what was opened.

        The caller owns the descriptor. It is opened on the event loop, with no await between
        the open and the ``try`` that closes it, so a cancelled request cannot leak it.
        """
        model = await anyio.to_thread.run_sync(self.get, model_id)
        try:
            fd = os.open(model.path, os.O_RDONLY)
        except FileNotFoundError:
            raise ModelChanged(f"Model {model.id} was just removed or replaced; retry.") from None
        try:
            st = os.fstat(fd)
            opened = StoredModel(model.id, model.path, st.st_size, st.st_mtime_ns)
            digest = await anyio.to_thread.run_sync(self.sha256, opened)
        except BaseException:
            os.close(fd)
            raise
        return OpenFile(fd=fd, size=opened.size, sha256=digest)

    # Writing

    async def upload(
        self,
        model_id: str,
        sha256: str,
        body: AsyncIterable[bytes],
        *,
        overwrite: bool = False,
        declared_size: int | None = None,
        max_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
    ) -> StoredModel:
        """Receive a model file; it takes its name only once checked. Raises ``DataError``s."""
        model_id, sha256 = _checked_id(model_id), _checked_sha256(sha256)
        if declared_size is not None and declared_size > max_bytes:
            raise too_large(declared_size, max_bytes)
        if not overwrite:
            self._refuse_existing(model_id)
        upload = Upload(self.storage, model_id, sha256, max_bytes)
        try:
            await upload.receive(body)
            info = await anyio.to_thread.run_sync(upload.verify)
            model = await anyio.to_thread.run_sync(self._commit, upload, info, overwrite)
        except BaseException:
            upload.discard()
            raise
        log.info(
            "stored model %s (%s, %d bytes, sha256 %s)",
            model.id,
            model.filename,
            model.size,
            sha256,
        )
        return model

    def _refuse_existing(self, model_id: str) -> None:
        existing = self._find(model_id)
        if existing is not None:
            raise ModelExists(
                f"Model {model_id} is already in the store ({existing.filename}). Add "
                "&overwrite=true to replace it, or upload it under another id.",
                param="id",
            )

    def _find(self, model_id: str) -> StoredModel | None:
        return next((m for m in self.models() if m.id == model_id), None)

    def _commit(self, upload: Upload, info: GGUFInfo, overwrite: bool) -> StoredModel:
        with self._commit_lock:  # check and rename as one step, so two uploads cannot both win
            existing = self._find(upload.model_id)
            if existing is not None and not overwrite:
                self._refuse_existing(upload.model_id)
            target = existing.path if existing else self.storage / f"{upload.model_id}{GGUF_SUFFIX}"
            os.replace(upload.path, target)
        st = target.stat()
        model = StoredModel(upload.model_id, target, st.st_size, st.st_mtime_ns)
        self._write_sidecar(model, upload.expected_sha256)
        with self._lock:  # known already: neither hashed nor parsed again
            self._hashes[target] = (model.size, model.mtime_ns, upload.expected_sha256)
            self._infos[target] = (
                model.size,
                model.mtime_ns,
                dataclasses.replace(info, path=target),
            )
        return model

    def remove_partial_uploads(self) -> None:
        """Delete temp files of uploads a previous run did not finish."""
        for path in self.storage.glob(f"{TEMP_PREFIX}*{TEMP_SUFFIX}"):
            log.info("removing %s, left by an unfinished upload", path.name)
            path.unlink(missing_ok=True)


def _checked_id(model_id: str) -> str:
    lowered = model_id.lower()
    if lowered.endswith(GGUF_SUFFIX):
        raise BadRequest(
            f"Give the model id without {GGUF_SUFFIX} (id={model_id[: -len(GGUF_SUFFIX)]}).",
            param="id",
        )
    if not _MODEL_ID.match(lowered):
        raise BadRequest(
            f"{model_id!r} is not a usable model id: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (it becomes the file name ID.gguf).",
            param="id",
        )
    return lowered


def _checked_sha256(sha256: str) -> str:
    lowered = sha256.strip().lower()
    if not _SHA256.match(lowered):
        raise BadRequest(
            f"sha256 {sha256!r} is not 64 hex digits. Pass the file's sha256 (`sha256sum FILE`).",
            param="sha256",
        )
    return lowered
