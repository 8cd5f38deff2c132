"""One file's bytes from the Hub into a partial file: resumable with ``Range``, hashed, checked.

The partial file survives any failure except a failed check, so the next attempt (in this call
after a dropped connection, or in a later run after a crash or Ctrl-C) continues where the last
one stopped. Requests go through huggingface_hub's shared HTTP session, following the Hub's
redirect to its download host (which drops the ``Authorization`` header on the way).
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx2
from huggingface_hub import get_session, hf_raise_for_status

from shoal.models.errors import HubError
from shoal.progress import BYTES_UNIT, Progress

logger = logging.getLogger(__name__)

RETRY_DELAY_S = 2.0
"""First back-off after an attempt that received nothing; doubles up to the maximum."""
MAX_RETRY_DELAY_S = 30.0
TRANSFER_TIMEOUT = httpx2.Timeout(60.0, connect=15.0)
RETRY_STATUS = frozenset({408, 429, 500, 502, 503, 504})
_CHUNK = 1 << 20


@dataclass(frozen=True)
class Transfer:
    """What to fetch, where to, and what it must turn out to be."""

    url: str
    headers: Mapping[str, str]
    partial: Path
    size: int | None
    sha256: str | None
    name: str
    """The file's name, for the progress bar."""
    label: str
    """Names the file in messages, e.g. ``x-Q4_K_M.gguf of repo org/x``."""
    source: str
    """The Hub's URL, for messages."""


def fetch(transfer: Transfer, attempts: int) -> str:
    """Complete ``transfer.partial`` and check it; its sha256.

    Raises :class:`HubError` when the attempts run out (the partial file is kept) or the result
    does not match (the partial file is deleted). HTTP errors other than dropped connections
    and busy servers propagate as huggingface_hub raised them, for the caller to translate.
    """
    _check_disk_space(transfer.partial, transfer.size)
    description = f"Downloading {transfer.name}"
    with Progress(description, total=transfer.size, unit=BYTES_UNIT) as progress:
        digest = _resume(transfer.partial, transfer.size, progress)
        _retrying(transfer, digest, progress, attempts)
    actual = digest.hexdigest()
    _verify(transfer, actual)
    return actual


class _Digest:
    """sha256 of the partial file as it grows; restarts if the server ignores ``Range``."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()

    def update(self, data: bytes) -> None:
        self._hash.update(data)

    def restart(self) -> None:
        self._hash = hashlib.sha256()

    def hexdigest(self) -> str:
        return self._hash.hexdigest()


def _resume(partial: Path, size: int | None, progress: Progress) -> _Digest:
    """The digest of what an earlier attempt left in ``partial`` (hashed again from disk)."""
    digest = _Digest()
    have = _size(partial)
    if have == 0:
        return digest
    if size is not None and have > size:
        logger.warning("%s is larger than the file on the Hub; starting again", partial)
        partial.unlink()
        return digest
    logger.info("resuming %s from byte %d", partial, have)
    with partial.open("rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    progress.update(have)
    return digest


class Retryable(Exception):
    """The server answered with a status worth retrying (busy, rate-limited, 5xx)."""


RETRYABLE = (httpx2.TransportError, Retryable)
"""What a request may fail with that the next attempt may not: a dropped or refused
connection, a timeout, a status worth retrying."""


def back_off(failures: int) -> float:
    """Seconds to wait before the next attempt, after ``failures`` that received nothing."""
    return min(RETRY_DELAY_S * 2.0 ** (failures - 1), MAX_RETRY_DELAY_S)


@contextmanager
def stream(url: str, headers: Mapping[str, str]) -> Iterator[httpx2.Response]:
    """``GET url`` through huggingface_hub's session (its redirects followed), its body not
    read yet. A status worth retrying raises ``Retryable``, any other error status the Hub's
    own error (``hf_raise_for_status``)."""
    with get_session().stream(
        "GET", url, headers=headers, timeout=TRANSFER_TIMEOUT, follow_redirects=True
    ) as response:
        if response.status_code in RETRY_STATUS:
            raise Retryable(f"HTTP {response.status_code}")
        hf_raise_for_status(response)
        yield response


def _retrying(transfer: Transfer, digest: _Digest, progress: Progress, attempts: int) -> None:
    failures = 0
    while True:
        before = _size(transfer.partial)
        try:
            _get(transfer, digest, progress)
            return
        except RETRYABLE as exc:
            failures += 1
            have = _size(transfer.partial)
            if failures >= max(1, attempts):
                raise HubError(
                    f"downloading {transfer.label} from {transfer.source} failed {failures} "
                    f"time(s), last: {exc or type(exc).__name__}. The {have} bytes received "
                    f"are kept in {transfer.partial}; run the same command again to resume."
                ) from exc
            moved = have > before
            delay = 0.0 if moved else back_off(failures)
            logger.warning(
                "download of %s broke off (%s); retrying in %.0f s", transfer.label, exc, delay
            )
            time.sleep(delay)  # back-off between retries, not polling


def _get(transfer: Transfer, digest: _Digest, progress: Progress) -> None:
    have = _size(transfer.partial)
    if transfer.size is not None and have >= transfer.size:
        return  # an earlier attempt got it all (and stopped before the file was moved)
    headers = dict(transfer.headers)
    if have:
        headers["Range"] = f"bytes={have}-"
    with stream(transfer.url, headers) as response:
        mode = "ab"
        if have and response.status_code != 206:  # the server ignored Range: start over
            mode = "wb"
            digest.restart()
            progress.update(0)
        with transfer.partial.open(mode) as out:
            for chunk in response.iter_bytes():  # as received: a drop loses nothing
                out.write(chunk)
                digest.update(chunk)
                progress.advance(len(chunk))


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _check_disk_space(partial: Path, size: int | None) -> None:
    partial.parent.mkdir(parents=True, exist_ok=True)
    if size is None:
        return
    needed = size - _size(partial)
    free = shutil.disk_usage(partial.parent).free
    if needed > free:
        raise HubError(
            f"{partial.parent} has {free // 10**6} MB free but the download needs "
            f"{needed // 10**6} MB more. Free some space (`shoal models rm`) and run it again."
        )


def _verify(transfer: Transfer, actual: str) -> None:
    size = _size(transfer.partial)
    if (transfer.size is None or size == transfer.size) and (
        transfer.sha256 is None or actual == transfer.sha256
    ):
        if transfer.sha256 is None:
            logger.warning("%s: no sha256 known; checked the size only", transfer.label)
        return
    transfer.partial.unlink(missing_ok=True)
    raise HubError(
        f"{transfer.label} arrived damaged: {size} bytes with sha256 {actual}, expected "
        f"{transfer.size} bytes with sha256 {transfer.sha256}. The download was deleted; run "
        "the command again (if it keeps failing, the server at HF_ENDPOINT sends wrong data)."
    )
