"""Fetching models from a Shoal model store (``shoal data``) over HTTP.

``fetch_from_store`` downloads a whole GGUF file resumably: bytes go to ``NAME.gguf.part``
(with ``NAME.gguf.part.sha256`` naming the version it holds); a later run continues that file
with ``Range: bytes=N-`` and ``If-Range: "<sha256>"`` (the store's ETag), so a part of an older
version of the file is never extended with the new one. The sha256 the registry gives is
checked at the end and the file renamed into place.

``request_pull`` and ``fetch_ranges`` are for a worker running only some layers: the store
says which byte ranges those layers need, and they are written at their offsets into a sparse
file of the model's full size (a file system without sparse files just uses the space).

``mounted_copy`` finds a model in the store's folder mounted on this machine (NFS), so that
nothing is downloaded.

The wire types (``RegistryEntry``, ``PullPlan``) live here; the store builds its answers
with them, so client and server cannot drift apart.
"""

from __future__ import annotations

import hashlib
import logging
import os
import ssl
from pathlib import Path
from typing import BinaryIO

import aiohttp
import anyio.to_thread
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from shoal.models.errors import ModelError, StoreUnreachable
from shoal.models.gguf_header import next_header_read
from shoal.pip_download import file_sha256
from shoal.progress import BYTES_UNIT, Progress

logger = logging.getLogger(__name__)

REGISTRY_PATH = "/api/v1/models/registry"
TIMEOUT = aiohttp.ClientTimeout(total=None, connect=10.0, sock_connect=10.0, sock_read=60.0)
FLUSH_BYTES = 4 << 20
"""Received bytes are buffered up to this much, then written (and hashed) in a thread."""


class RegistryEntry(BaseModel):
    """One model in a store's registry."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    id: str
    filename: str
    size: int
    sha256: str
    architecture: str | None
    n_layers: int | None
    quantization: str | None


class PullPlan(BaseModel):
    """The byte ranges ``[start, end)`` of ``file_url`` a worker needs for some layers."""

    model_config = ConfigDict(frozen=True, extra="forbid", validate_by_name=True)

    id: str
    size: int
    sha256: str
    file_url: str
    ranges: tuple[tuple[int, int], ...]
    total_bytes: int = Field(alias="bytes")


async def fetch_from_store(
    base_url: str,
    model_id: str,
    dest_dir: Path,
    *,
    api_key: str | None = None,
    tls: ssl.SSLContext | None = None,
    sha256: str | None = None,
) -> Path:
    """Download ``model_id`` from the store at ``base_url`` into ``dest_dir``; return its path.

    A complete file with the right sha256 is not downloaded again; a ``.part`` left by an
    interrupted run is continued. ``sha256``: the version wanted (a split model's, as the router
    planned it); another one on the store is refused. Raises ``ModelError`` with what to do next.
    """
    base = base_url.rstrip("/")
    async with _session(api_key, tls) as session:
        entry = await _registry_entry(session, base, model_id)
        if sha256 is not None and entry.sha256 != sha256:
            raise ModelError(
                f"model {entry.id} on the store at {base} has sha256 {entry.sha256}, not the "
                f"{sha256} the router planned with: it changed; deploy it again."
            )
        dest_dir.mkdir(parents=True, exist_ok=True)
        dest = dest_dir / Path(entry.filename).name
        if await anyio.to_thread.run_sync(_is_complete, dest, entry):
            logger.info("model %s: %s is already complete", entry.id, dest)
            return dest
        part = dest.with_name(dest.name + ".part")
        url = f"{base}/api/v1/models/{entry.id}/file"
        await _download(session, url, entry, part)
    os.replace(part, dest)
    _marker(part).unlink(missing_ok=True)
    logger.info("model %s saved as %s (sha256 verified)", entry.id, dest)
    return dest


async def mounted_copy(
    base_url: str,
    model_id: str,
    mount: Path,
    *,
    api_key: str | None = None,
    tls: ssl.SSLContext | None = None,
) -> Path | None:
    """``model_id``'s file in ``mount``, the store's storage folder as this machine mounts it
    (NFS, a bind mount: its path here need not be the store's), or None when it is not there
    with the size the store gives (not mounted, or another version): then download it.

    The store names the file (its registry's ``filename``); nothing is read from it here.
    """
    base = base_url.rstrip("/")
    async with _session(api_key, tls) as session:
        entry = await _registry_entry(session, base, model_id)
    path = mount / Path(entry.filename).name
    try:
        size = path.stat().st_size
    except OSError as exc:
        logger.warning(
            "model %s: not in the mounted store folder %s (%s); downloading it instead",
            entry.id,
            mount,
            exc.strerror,
        )
        return None
    if size != entry.size:
        logger.warning(
            "model %s: %s has %d bytes, the store's file %d (another version); downloading it",
            entry.id,
            path,
            size,
            entry.size,
        )
        return None
    logger.info("model %s: using %s from the mounted store folder (no download)", entry.id, path)
    return path


async def request_pull(
    base_url: str,
    model_id: str,
    first: int,
    last: int,
    *,
    api_key: str | None = None,
    tls: ssl.SSLContext | None = None,
) -> PullPlan:
    """Ask the store which byte ranges layers ``first..last`` (inclusive) of a model need."""
    base = base_url.rstrip("/")
    url = f"{base}/api/v1/models/{model_id}/pull"
    async with _session(api_key, tls) as session:
        try:
            async with session.post(url, json={"layers": [first, last]}) as resp:
                await _check(resp, base, model_id)
                return PullPlan.model_validate(await resp.json())
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise _unreachable(base, exc) from None
        except ValidationError as exc:
            raise _not_a_store(base, f"its pull plan did not parse: {exc}") from None


async def fetch_ranges(
    base_url: str,
    plan: PullPlan,
    dest: Path,
    *,
    api_key: str | None = None,
    tls: ssl.SSLContext | None = None,
) -> Path:
    """Write ``plan``'s ranges at their offsets into ``dest``, a sparse file of full size.

    Each range is asked for with ``If-Range``; should the store's file change meanwhile, the
    answer is not 206 and this raises ``ModelError`` (ask for a new plan). ``dest`` appears
    only when every range has arrived.
    """
    base = base_url.rstrip("/")
    part = dest.with_name(dest.name + ".part")
    with part.open("wb") as f:
        f.truncate(plan.size)
        try:
            async with _session(api_key, tls) as session:
                with Progress(f"Fetching layers of {plan.id}", plan.total_bytes, BYTES_UNIT) as p:
                    for start, end in plan.ranges:
                        await _fetch_range(session, base, plan, (start, end), f, p)
        except BaseException:
            part.unlink(missing_ok=True)
            raise
    os.replace(part, dest)
    return dest


async def find_entry(
    base_url: str,
    model_id: str,
    *,
    api_key: str | None = None,
    tls: ssl.SSLContext | None = None,
) -> RegistryEntry | None:
    """``model_id``'s line of the registry of the store at ``base_url``; None when the store
    does not have it. Raises ``StoreUnreachable`` when the store cannot be asked, and
    ``ModelError`` when it refuses (a key it does not take)."""
    base = base_url.rstrip("/")
    async with _session(api_key, tls) as session:
        try:
            return await _registry_entry(session, base, model_id)
        except _NotInStore:
            return None


async def fetch_header(
    base_url: str,
    entry: RegistryEntry,
    *,
    api_key: str | None = None,
    tls: ssl.SSLContext | None = None,
) -> bytes:
    """The GGUF header (metadata and tensor table) of a store's model, fetched by ``Range`` a
    chunk at a time (``gguf_header.next_header_read``): never the tensor data. Each range is
    asked for with ``If-Range`` on ``entry``'s sha256, so a file replaced meanwhile is refused.
    """
    base = base_url.rstrip("/")
    url = f"{base}/api/v1/models/{entry.id}/file"
    data = b""
    async with _session(api_key, tls) as session:
        while isinstance(step := _header_step(data, entry, base), tuple):
            data += await _read_range(session, url, entry, step)
    logger.info("model %s: read its %d-byte GGUF header from the store at %s", entry.id, step, base)
    return data[:step]


# Internals


class _NotInStore(ModelError):
    """The store answered, and has no such model."""


def _header_step(data: bytes, entry: RegistryEntry, base: str) -> int | tuple[int, int]:
    try:
        step = next_header_read(data, entry.size)
    except ValueError as exc:
        raise ModelError(f"model {entry.id} on the store at {base} is not a GGUF: {exc}") from None
    if step is None:
        raise ModelError(
            f"model {entry.id} on the store at {base} has no complete GGUF header in its "
            "first bytes; upload the file again."
        )
    return step


async def _read_range(
    session: aiohttp.ClientSession, url: str, entry: RegistryEntry, span: tuple[int, int]
) -> bytes:
    start, end = span
    headers = {"Range": f"bytes={start}-{end - 1}", "If-Range": _etag(entry)}
    try:
        async with session.get(url, headers=headers) as resp:
            await _check(resp, url, entry.id)
            expected = f"bytes {start}-{end - 1}/{entry.size}"
            if resp.status != 206 or resp.headers.get("Content-Range") != expected:
                raise ModelError(
                    f"model {entry.id} changed on the store at {url} while its header was "
                    "read (or the store ignored the byte range); ask again."
                )
            return await resp.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise _unreachable(url, exc) from None


def _session(api_key: str | None, tls: ssl.SSLContext | None = None) -> aiohttp.ClientSession:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    connector = aiohttp.TCPConnector(ssl=tls if tls is not None else True)
    return aiohttp.ClientSession(
        timeout=TIMEOUT, headers=headers, raise_for_status=False, connector=connector
    )


async def _registry_entry(
    session: aiohttp.ClientSession, base: str, model_id: str
) -> RegistryEntry:
    try:
        async with session.get(base + REGISTRY_PATH) as resp:
            await _check(resp, base, model_id)
            payload = await resp.json()
        entries = [RegistryEntry.model_validate(e) for e in payload["data"]]
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise _unreachable(base, exc) from None
    except (ValidationError, KeyError, TypeError, ValueError) as exc:
        raise _not_a_store(base, f"its registry did not parse: {exc}") from None
    for entry in entries:
        if entry.id == model_id.lower():
            return entry
    known = ", ".join(e.id for e in entries) or "none"
    raise _NotInStore(
        f"model {model_id!r} is not in the model store at {base} (it has: {known}). "
        "Upload it there first (POST /api/v1/storage/upload) or pick one of those."
    )


async def _download(
    session: aiohttp.ClientSession, url: str, entry: RegistryEntry, part: Path
) -> None:
    offset, digest = await anyio.to_thread.run_sync(_resume_state, part, entry)
    if offset < entry.size:
        headers = {"Range": f"bytes={offset}-", "If-Range": _etag(entry)} if offset else {}
        try:
            async with session.get(url, headers=headers) as resp:
                await _check(resp, url, entry.id)
                if _start_of(resp, entry, offset) == 0:  # the whole file came: start over
                    offset, digest = 0, hashlib.sha256()
                logger.info("model %s: fetching bytes %d-%d", entry.id, offset, entry.size - 1)
                with part.open("r+b" if offset else "wb") as f:
                    f.truncate(offset)
                    f.seek(offset)
                    with Progress(f"Downloading {entry.id}", entry.size, BYTES_UNIT) as progress:
                        progress.update(offset)
                        await _copy_body(resp, _Sink(f, digest), progress)
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ModelError(
                f"the download of {entry.id} from {url} broke off ({exc!r}); run it again to "
                f"continue from where it stopped ({part} keeps what arrived)."
            ) from None
    _verify(part, entry, digest.hexdigest())


def _etag(entry: RegistryEntry) -> str:
    return f'"{entry.sha256}"'


def _start_of(resp: aiohttp.ClientResponse, entry: RegistryEntry, offset: int) -> int:
    """Where the body starts in the file: ``offset`` for our range, 0 for the whole file."""
    if resp.headers.get("ETag") != _etag(entry):
        raise ModelError(
            f"model {entry.id} changed on the store while it was being fetched; "
            "run the download again."
        )
    if resp.status != 206:
        return 0
    if not resp.headers.get("Content-Range", "").startswith(f"bytes {offset}-"):
        raise _not_a_store(str(resp.url), f"it answered bytes={offset}- with the wrong range")
    return offset


def _is_complete(dest: Path, entry: RegistryEntry) -> bool:
    if not dest.is_file() or dest.stat().st_size != entry.size:
        return False
    return file_sha256(dest) == entry.sha256


def _marker(part: Path) -> Path:
    """Beside a ``.part``: the sha256 of the file version it holds the start of."""
    return part.with_name(part.name + ".sha256")


def _resume_state(part: Path, entry: RegistryEntry) -> tuple[int, hashlib._Hash]:
    """How many bytes of ``part`` to keep, and the sha256 state over them.

    A part of another version of the file (by its marker), longer than the model, or as long
    but with another sha256 is started over.
    """
    marker = _marker(part)
    fresh = hashlib.sha256()
    other_version = marker.is_file() and marker.read_text().strip() != entry.sha256
    marker.write_text(entry.sha256)
    if other_version or not part.is_file() or part.stat().st_size > entry.size:
        return 0, fresh
    digest = hashlib.sha256()
    kept = 0
    with part.open("rb") as f:
        while chunk := f.read(FLUSH_BYTES):
            digest.update(chunk)
            kept += len(chunk)
    if kept == entry.size and digest.hexdigest() != entry.sha256:
        return 0, fresh
    return kept, digest


def _verify(part: Path, entry: RegistryEntry, actual: str) -> None:
    if actual != entry.sha256:
        part.unlink(missing_ok=True)
        _marker(part).unlink(missing_ok=True)
        raise ModelError(
            f"the downloaded {entry.id} has sha256 {actual}, but the store says {entry.sha256}; "
            "the partial file was deleted. Run the download again; if it fails the same way, "
            "the store's file is damaged."
        )


class _Sink:
    """Buffers received bytes; writes (and optionally hashes) them in a thread."""

    def __init__(
        self, f: BinaryIO, digest: hashlib._Hash | None, offset: int | None = None
    ) -> None:
        self._f = f
        self._digest = digest
        self._offset = offset
        self._buffer = bytearray()

    async def add(self, chunk: bytes) -> None:
        self._buffer += chunk
        if len(self._buffer) >= FLUSH_BYTES:
            await self.flush()

    async def flush(self) -> None:
        data = bytes(self._buffer)
        self._buffer.clear()
        if data:
            await anyio.to_thread.run_sync(self._write, data)

    def _write(self, data: bytes) -> None:
        if self._offset is not None:
            os.pwrite(self._f.fileno(), data, self._offset)
            self._offset += len(data)
        else:
            self._f.write(data)
        if self._digest is not None:
            self._digest.update(data)


async def _copy_body(resp: aiohttp.ClientResponse, sink: _Sink, progress: Progress) -> int:
    received = 0
    async for chunk in resp.content.iter_chunked(1 << 20):
        await sink.add(chunk)
        received += len(chunk)
        progress.advance(len(chunk))
    await sink.flush()
    return received


async def _fetch_range(
    session: aiohttp.ClientSession,
    base: str,
    plan: PullPlan,
    span: tuple[int, int],
    f: BinaryIO,
    progress: Progress,
) -> None:
    start, end = span
    headers = {"Range": f"bytes={start}-{end - 1}", "If-Range": f'"{plan.sha256}"'}
    try:
        async with session.get(base + plan.file_url, headers=headers) as resp:
            await _check(resp, base, plan.id)
            expected = f"bytes {start}-{end - 1}/{plan.size}"
            if resp.status != 206 or resp.headers.get("Content-Range") != expected:
                raise ModelError(
                    f"model {plan.id} changed on the store (or the store ignored the range "
                    f"{start}-{end - 1}); ask for a new pull plan and fetch again."
                )
            received = await _copy_body(resp, _Sink(f, None, offset=start), progress)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise ModelError(
            f"fetching bytes {start}-{end - 1} of {plan.id} from the model store at {base} "
            f"failed ({exc!r}); check that the store runs, then fetch again."
        ) from None
    if received != end - start:
        raise ModelError(f"the store sent {received} bytes for {expected}; fetch again.")


async def _check(resp: aiohttp.ClientResponse, where: str, model_id: str) -> None:
    """Raise ``ModelError`` for an error answer, with the store's own message."""
    if resp.status < 400:
        return
    message = await _error_message(resp)
    if resp.status == 401:
        raise ModelError(
            f"the model store at {where} refused the request: {message} "
            "Pass the store's API key (--api-key of `shoal data`)."
        )
    if resp.status == 404:
        raise ModelError(f"model store at {where}: {message}")
    kind = StoreUnreachable if resp.status >= 500 else ModelError  # a proxy's 502, say
    raise kind(f"the model store at {where} answered {resp.status} for {model_id}: {message}")


async def _error_message(resp: aiohttp.ClientResponse) -> str:
    body = await resp.read()
    try:
        error = ErrorEnvelope.model_validate_json(body).error
    except ValidationError:
        return body[:200].decode("utf-8", errors="replace") or resp.reason or "no details"
    return error.message


class _ErrorBody(BaseModel):
    message: str


class ErrorEnvelope(BaseModel):
    """An OpenAI-style error answer; only the message is used."""

    error: _ErrorBody


def _unreachable(base: str, exc: BaseException) -> StoreUnreachable:
    return StoreUnreachable(
        f"cannot reach the model store at {base} ({exc!r}). Check that it runs "
        "(`shoal data`) and that the URL and port are right."
    )


def _not_a_store(base: str, detail: str) -> StoreUnreachable:
    return StoreUnreachable(f"{base} does not answer like a Shoal model store: {detail}.")
