"""Uploading a GGUF file to a model store (``shoal data upload``): resumable, sha256-checked.

The protocol (the store's side is ``shoal.data.upload``): the file's sha256 names the upload.
``GET /api/v1/storage/upload/SHA256`` answers how many bytes of it the store holds; the client
sends the rest as the raw body of ``POST /api/v1/storage/upload?id=&sha256=&offset=``. The store
hashes the whole file (the bytes it held and the new ones) and keeps it only if the digest is
the one the client computed here, so a file that changed between two tries is refused, not
stored spliced. A broken connection is retried from where the store stopped, a few times; a
run that gave up continues the same way when it is run again.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import aiohttp
import anyio.to_thread
from pydantic import BaseModel, ValidationError

from shoal.models.errors import ModelError
from shoal.models.store_client import TIMEOUT, ErrorEnvelope
from shoal.pip_download import file_sha256
from shoal.progress import BYTES_UNIT, Progress, step

log = logging.getLogger(__name__)

UPLOAD_PATH = "/api/v1/storage/upload"
CHUNK_BYTES = 1 << 20
ATTEMPTS = 5
"""Tries of one upload (the first and the resumptions after a broken connection)."""
RETRY_PAUSE_S = 2.0
RESUMABLE_CONFLICTS = frozenset({"upload_in_progress", "upload_offset_mismatch"})
"""409s that another try settles: the store still lets go of a broken connection's upload, or
holds more bytes than it said a moment before."""


class _Again(Exception):
    """This try ended in a way the next one may not (a 409 of ``RESUMABLE_CONFLICTS``)."""


@dataclass(frozen=True)
class Uploaded:
    id: str
    size: int
    sha256: str
    resumed_from: int
    """Bytes the store already held when the last try began (0: sent whole)."""


async def upload_to_store(
    base_url: str,
    path: Path,
    *,
    model_id: str | None = None,
    api_key: str | None = None,
    overwrite: bool = False,
    tls: ssl.SSLContext | None = None,
    sha256: str | None = None,
) -> Uploaded:
    """Upload ``path`` as ``model_id`` (default: its name without .gguf). Raises
    ``ModelError`` with the store's message and what to do."""
    base = _checked_base(base_url)
    model_id = model_id or _default_id(path)
    size = path.stat().st_size
    if sha256 is None:
        step(f"Computing the sha256 of {path} ({size} bytes)")
        sha256 = await anyio.to_thread.run_sync(file_sha256, path)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    connector = aiohttp.TCPConnector(ssl=tls if tls is not None else True)
    async with aiohttp.ClientSession(
        timeout=TIMEOUT, headers=headers, connector=connector
    ) as session:
        for attempt in range(1, ATTEMPTS + 1):
            try:
                return await _try(session, base, path, model_id, sha256, size, overwrite)
            except (aiohttp.ClientError, TimeoutError, _Again) as exc:
                if attempt == ATTEMPTS:
                    raise ModelError(
                        f"the upload to {base} did not finish in {ATTEMPTS} tries (last: {exc}); "
                        "run the same command again to continue where the store stopped."
                    ) from None
                log.warning("upload of %s: %s; trying again in %g s", model_id, exc, RETRY_PAUSE_S)
                await asyncio.sleep(RETRY_PAUSE_S)
    raise AssertionError("unreachable: the loop returns or raises")


def _checked_base(url: str) -> str:
    """The store's base URL, or a ``ModelError`` at once for one no try could reach (a
    ``host:port`` without its scheme would otherwise be retried as if the network failed)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ModelError(
            f"{url!r} is not a model store's URL: give its scheme and host, e.g. "
            "https://store.lan:8100 (http://127.0.0.1:8100 for a store on loopback without TLS)."
        )
    return url.rstrip("/")


async def _try(
    session: aiohttp.ClientSession,
    base: str,
    path: Path,
    model_id: str,
    sha256: str,
    size: int,
    overwrite: bool,
) -> Uploaded:
    offset = await _held(session, base, sha256)
    if offset > size:
        offset = 0  # not this file's bytes after all: start over
    if offset:
        step(f"Resuming the upload of {model_id}: the store holds {offset} of {size} bytes")
    params = {"id": model_id, "sha256": sha256, "offset": str(offset)}
    if overwrite:
        params["overwrite"] = "true"
    with Progress(f"Uploading {model_id}", size, BYTES_UNIT) as progress:
        progress.update(offset)
        async with session.post(
            base + UPLOAD_PATH, params=params, data=_body(path, offset, progress)
        ) as resp:
            body = await resp.read()
            if resp.status == 409 and _code(body) in RESUMABLE_CONFLICTS:
                raise _Again(_refused(base, resp.status, body))
            if resp.status != 201:
                raise ModelError(_refused(base, resp.status, body))
    try:
        stored = _Stored.model_validate_json(body)
    except ValidationError:
        raise ModelError(f"{base} does not answer like a Shoal model store.") from None
    if stored.sha256 != sha256:
        raise ModelError(
            f"the store at {base} kept {stored.id} with sha256 {stored.sha256}, not {sha256}: "
            "it is not the file sent. Upload it again with --overwrite."
        )
    return Uploaded(stored.id, stored.size, stored.sha256, offset)


async def _held(session: aiohttp.ClientSession, base: str, sha256: str) -> int:
    async with session.get(f"{base}{UPLOAD_PATH}/{sha256}") as resp:
        body = await resp.read()
        if resp.status != 200:
            raise ModelError(_refused(base, resp.status, body))
    try:
        return _Offset.model_validate_json(body).offset
    except ValidationError:
        raise ModelError(f"{base} does not answer like a Shoal model store.") from None


async def _body(path: Path, offset: int, progress: Progress) -> AsyncIterator[bytes]:
    with path.open("rb") as f:
        f.seek(offset)
        while chunk := await anyio.to_thread.run_sync(f.read, CHUNK_BYTES):
            yield chunk
            progress.advance(len(chunk))


def _refused(base: str, status: int, body: bytes) -> str:
    try:
        message = ErrorEnvelope.model_validate_json(body).error.message
    except ValueError:
        message = body[:200].decode("utf-8", errors="replace") or "no details"
    hint = ""
    if status == 401:
        hint = " Pass an admin key of the store with --key (or SHOAL_UPLOAD_KEY)."
    elif status == 404:
        hint = " Is this a Shoal model store (`shoal data`, or a router with --storage)?"
    return f"the model store at {base} answered {status}: {message}{hint}"


def _code(body: bytes) -> str | int | None:
    try:
        return _Error.model_validate_json(body).error.code
    except ValidationError:
        return None


def _default_id(path: Path) -> str:
    name = path.name
    return name[:-5].lower() if name.lower().endswith(".gguf") else name.lower()


class _Stored(BaseModel):
    """The store's answer to a finished upload."""

    id: str
    size: int
    sha256: str


class _Offset(BaseModel):
    offset: int


class _ErrorCode(BaseModel):
    code: str | int | None = None


class _Error(BaseModel):
    error: _ErrorCode
