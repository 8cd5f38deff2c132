"""Plain HTTPS for the release download: one JSON document, and one verified, resumable file.

urllib is used (not a third-party client) so the user's ``HTTPS_PROXY``/``NO_PROXY``
settings apply as they do for pip. A file is written to ``<name>.part`` beside its target
and only renamed once its size and sha256 are right, so the target never holds a partial
or wrong file; an interrupted download resumes from the ``.part`` with a Range request.
"""

from __future__ import annotations

import json
import logging
import os
import urllib.error
import urllib.request
from email.message import Message
from http.client import HTTPResponse
from pathlib import Path
from typing import IO

from shoal.llama_cpp.errors import LlamaCppError
from shoal.pip_download import file_sha256
from shoal.progress import BYTES_UNIT, Progress

logger = logging.getLogger(__name__)

USER_AGENT = "shoal-llama-cpp-download"
MAX_JSON_BYTES = 16 << 20
"""A release's JSON is a few hundred kB; more than this is not a GitHub release."""

_CHUNK = 1 << 20
_HTTP_PARTIAL_CONTENT = 206
_HTTP_RANGE_NOT_SATISFIABLE = 416
_ALLOWED_SCHEMES = ("http://", "https://")


def get_json(url: str, *, headers: dict[str, str], timeout: float) -> object:
    """GET ``url`` and parse its JSON body; LlamaCppError on any network or HTTP failure.

    ``headers`` are not sent on to another host when the server redirects (so an
    ``Authorization`` header stays with the API).
    """
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
    for key, value in headers.items():
        request.add_unredirected_header(key, value)
    with _open(request, timeout=timeout) as response:
        body = response.read(MAX_JSON_BYTES + 1)
    if len(body) > MAX_JSON_BYTES:
        raise LlamaCppError(f"{url} answered with more than {MAX_JSON_BYTES} bytes of JSON")
    try:
        return json.loads(body)
    except ValueError as exc:
        raise LlamaCppError(f"{url} did not answer with JSON: {exc}") from exc


def download_file(
    url: str, target: Path, *, size: int, sha256: str, timeout: float, description: str
) -> Path:
    """``target``, downloaded from ``url`` and checked to have ``size`` bytes and ``sha256``.

    A verified ``target`` that already exists is returned as is. On a wrong size or hash
    nothing is left behind; on a network failure the ``.part`` file is kept to resume.
    """
    if not url.startswith(_ALLOWED_SCHEMES):
        raise LlamaCppError(f"refusing to download {url!r}: only http(s) URLs are fetched")
    if target.is_file() and target.stat().st_size == size and file_sha256(target) == sha256:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    part = target.with_name(target.name + ".part")
    have = part.stat().st_size if part.is_file() else 0
    if have >= size:  # complete (or too long): start over rather than trust it
        part.unlink(missing_ok=True)
        have = 0
    _fetch_into(url, part, have=have, size=size, timeout=timeout, description=description)
    _verify(part, url=url, size=size, sha256=sha256)
    os.replace(part, target)
    return target


def _fetch_into(
    url: str, part: Path, *, have: int, size: int, timeout: float, description: str
) -> None:
    request = urllib.request.Request(url, headers={"User-Agent": USER_AGENT})
    if have:
        request.add_header("Range", f"bytes={have}-")
    try:
        response = _open(request, timeout=timeout)
    except _RangeNotSatisfiable:
        part.unlink(missing_ok=True)
        _fetch_into(url, part, have=0, size=size, timeout=timeout, description=description)
        return
    with response:
        if have and response.status != _HTTP_PARTIAL_CONTENT:
            logger.info("%s: the server ignored the resume request; starting over", url)
            have = 0
        elif have:
            logger.info("%s: resuming at byte %d of %d", url, have, size)
        with (
            part.open("ab" if have else "wb") as sink,
            Progress(description, total=size, unit=BYTES_UNIT) as progress,
        ):
            progress.update(have)
            _copy(response, sink, progress, url=url, limit=size - have)


def _copy(
    response: HTTPResponse, sink: IO[bytes], progress: Progress, *, url: str, limit: int
) -> None:
    written = 0
    try:
        while chunk := response.read(_CHUNK):
            written += len(chunk)
            if written > limit:
                raise LlamaCppError(f"{url} sent more bytes than the release lists; refusing it")
            sink.write(chunk)
            progress.advance(len(chunk))
    except (OSError, urllib.error.URLError) as exc:  # includes timeouts and dropped connections
        raise LlamaCppError(
            f"the download of {url} broke off ({exc}); run the same command again to resume it"
        ) from exc


def _verify(part: Path, *, url: str, size: int, sha256: str) -> None:
    actual_size = part.stat().st_size
    if actual_size < size:
        raise LlamaCppError(
            f"the download of {url} ended early ({actual_size} of {size} bytes); "
            "run the same command again to resume it"
        )
    actual = file_sha256(part)
    if actual_size != size or actual != sha256:
        part.unlink(missing_ok=True)
        raise LlamaCppError(
            f"{url} does not match the release: got {actual_size} bytes with sha256 {actual}, "
            f"expected {size} bytes with sha256 {sha256}. Nothing was installed; try again, "
            "and if it happens again build from source instead."
        )


class _RangeNotSatisfiable(Exception):
    pass


def _open(request: urllib.request.Request, *, timeout: float) -> HTTPResponse:
    """urlopen, with every failure turned into LlamaCppError naming the URL and the fix."""
    url = request.full_url
    try:
        response = urllib.request.urlopen(request, timeout=timeout)
    except urllib.error.HTTPError as exc:
        code, headers = exc.code, exc.headers
        exc.close()
        if code == _HTTP_RANGE_NOT_SATISFIABLE:
            raise _RangeNotSatisfiable from None
        raise LlamaCppError(http_error_message(url, code, headers)) from None
    except (urllib.error.URLError, OSError) as exc:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        raise LlamaCppError(
            f"could not reach {url} ({reason}); check the network (or HTTPS_PROXY)"
        ) from exc
    if not isinstance(response, HTTPResponse):  # file:// and the like: not ours to fetch
        response.close()
        raise LlamaCppError(f"refusing {url}: not an http(s) URL")
    return response


def http_error_message(url: str, code: int, headers: Message) -> str:
    """What an HTTP error from GitHub means for the user, and what to do about it."""
    if code == 404:
        return f"{url} was not found (HTTP 404)"
    if code in (403, 429) and headers.get("X-RateLimit-Remaining") == "0":
        return (
            f"GitHub's API rate limit is used up (HTTP {code} from {url}); wait an hour or "
            "give Shoal a token (GITHUB_TOKEN) to raise the limit"
        )
    return f"{url} answered HTTP {code}"
