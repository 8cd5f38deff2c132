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

import contextlib
import dataclasses
import json
import logging
import os
import re
import threading
import time
from collections.abc import AsyncIterable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import anyio.to_thread

from shoal.data.errors import (
    BadRequest,
    DataError,
    ModelChanged,
    ModelExists,
    ModelNotFound,
    UnreadableModel,
    UploadConflict,
)
from shoal.data.http_range import OpenFile
from shoal.data.pull_plan import layer_byte_ranges
from shoal.data.settings import DEFAULT_MAX_UPLOAD_BYTES
from shoal.data.upload import TEMP_PREFIX, TEMP_SUFFIX, Upload, partial_size, too_large
from shoal.models.byte_ranges import ByteRange
from shoal.models.errors import ModelError
from shoal.models.gguf_info import GGUFInfo, inspect
from shoal.models.store_client import RegistryEntry
from shoal.pip_download import file_sha256

if TYPE_CHECKING:
    from shoal.data.multipart import FormUpload

log = logging.getLogger(__name__)

GGUF_SUFFIX = ".gguf"
SIDECAR_SUFFIX = ".sha256"
_MODEL_ID = re.compile(r"^[a-z0-9][a-z0-9._-]{0,127}$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_PARTIAL = re.compile(rf"^{re.escape(TEMP_PREFIX)}[0-9a-f]{{64}}{re.escape(TEMP_SUFFIX)}$")
PARTIAL_UPLOAD_TTL_S = 7 * 24 * 3600
"""A resumable upload's bytes are kept this long after its last write (a restart keeps them)."""


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
        self._receiving: set[str] = set()  # sha256 of the resumable uploads running

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
        offset: int | None = None,
    ) -> StoredModel:
        """Receive a model file sent as raw bytes; it takes its name only once checked.

        ``offset`` makes it resumable (see ``upload.py``): the body continues the partial
        file of ``sha256`` from that byte. Raises ``DataError``s.
        """
        model_id, sha256 = _checked_id(model_id), _checked_sha256(sha256)
        if declared_size is not None and (offset or 0) + declared_size > max_bytes:
            raise too_large((offset or 0) + declared_size, max_bytes)
        if not overwrite:
            self._refuse_existing(model_id)
        if offset is None:
            upload = await anyio.to_thread.run_sync(Upload.one_shot, self.storage, max_bytes)
            return await self._receive(upload, body, lambda: (model_id, sha256), overwrite)
        with self._receiving_of(sha256):
            upload = await anyio.to_thread.run_sync(
                Upload.resume, self.storage, sha256, offset, max_bytes
            )
            return await self._receive(upload, body, lambda: (model_id, sha256), overwrite)

    async def upload_form(
        self,
        form: FormUpload,
        *,
        model_id: str | None,
        sha256: str | None,
        overwrite: bool = False,
        max_bytes: int = DEFAULT_MAX_UPLOAD_BYTES,
    ) -> StoredModel:
        """Receive a model file sent as the seed's multipart form (its ``file`` field).

        The id is ``model_id``, else the form's ``id`` field, else the file name without
        .gguf; the sha256 is ``sha256``, else the form's ``sha256`` field, checked when given.
        """
        upload = await anyio.to_thread.run_sync(Upload.one_shot, self.storage, max_bytes)

        def naming() -> tuple[str, str | None]:
            name = model_id or form.fields.get("id") or _stem(form.filename)
            if not name:
                raise BadRequest(
                    "Name the model: ?id=ID, an 'id' form field, or a file name ending in .gguf.",
                    param="id",
                )
            digest = sha256 or form.fields.get("sha256")
            found = _checked_id(name), None if digest is None else _checked_sha256(digest)
            if not overwrite:
                self._refuse_existing(found[0])
            return found

        return await self._receive(upload, form.file_bytes(), naming, overwrite)

    async def _receive(
        self,
        upload: Upload,
        body: AsyncIterable[bytes],
        naming: Callable[[], tuple[str, str | None]],
        overwrite: bool,
    ) -> StoredModel:
        """Take the body, then check and name it (``naming``: the id and expected sha256,
        known once the body is read for a form)."""
        try:
            await upload.receive(body)
        except DataError:
            upload.discard()
            raise
        except BaseException:  # the client went away: a resumable upload may go on later
            upload.release()
            raise
        try:
            model_id, expected = naming()
            digest, info = await anyio.to_thread.run_sync(upload.verify, expected)
            model = await anyio.to_thread.run_sync(
                self._commit, upload, model_id, digest, info, overwrite
            )
        except BaseException:
            upload.discard()
            raise
        log.info(
            "stored model %s (%s, %d bytes, sha256 %s)",
            model.id,
            model.filename,
            model.size,
            digest,
        )
        return model

    def partial_upload(self, sha256: str) -> int:
        """How many bytes of the resumable upload of ``sha256`` the store holds."""
        return partial_size(self.storage, _checked_sha256(sha256))

    @contextlib.contextmanager
    def _receiving_of(self, sha256: str) -> Iterator[None]:
        """One resumable upload of a file at a time (two would write the same partial file)."""
        with self._lock:
            if sha256 in self._receiving:
                raise UploadConflict(
                    "Another upload of this file is running. Wait for it to end (or stop it), "
                    "then resume from the offset GET /api/v1/storage/upload/SHA256 answers.",
                    code="upload_in_progress",
                )
            self._receiving.add(sha256)
        try:
            yield
        finally:
            with self._lock:
                self._receiving.discard(sha256)

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

    def _commit(
        self, upload: Upload, model_id: str, digest: str, info: GGUFInfo, overwrite: bool
    ) -> StoredModel:
        with self._commit_lock:  # check and rename as one step, so two uploads cannot both win
            existing = self._find(model_id)
            if existing is not None and not overwrite:
                self._refuse_existing(model_id)
            target = existing.path if existing else self.storage / f"{model_id}{GGUF_SUFFIX}"
            os.replace(upload.path, target)
        st = target.stat()
        model = StoredModel(model_id, target, st.st_size, st.st_mtime_ns)
        self._write_sidecar(model, digest)
        with self._lock:  # known already: neither hashed nor parsed again
            self._hashes[target] = (model.size, model.mtime_ns, digest)
            self._infos[target] = (
                model.size,
                model.mtime_ns,
                dataclasses.replace(info, path=target),
            )
        return model

    def remove_partial_uploads(self, now: float | None = None) -> None:
        """Delete temp files of one-shot uploads a previous run did not finish, and those of
        resumable uploads untouched for ``PARTIAL_UPLOAD_TTL_S``."""
        now = time.time() if now is None else now
        for path in self.storage.glob(f"{TEMP_PREFIX}*{TEMP_SUFFIX}"):
            resumable = _PARTIAL.match(path.name) is not None
            with contextlib.suppress(FileNotFoundError):
                if resumable and now - path.stat().st_mtime < PARTIAL_UPLOAD_TTL_S:
                    continue
                log.info("removing %s, left by an unfinished upload", path.name)
                path.unlink()


def _stem(filename: str | None) -> str | None:
    if not filename:
        return None
    name = Path(filename).name
    return name[: -len(GGUF_SUFFIX)] if name.lower().endswith(GGUF_SUFFIX) else None


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
