"""Serving a file with HTTP range requests (RFC 9110 §14), streamed from disk in chunks.

One range per request: ``bytes=a-b``, ``bytes=a-`` and ``bytes=-n`` answer 206 with
``Content-Range``; a range starting past the end answers 416 with ``Content-Range: bytes */SIZE``.
A request for several ranges gets the whole file with 200: RFC 9110 lets a server ignore
``Range``, and Shoal's workers never ask for more than one (multipart answers would only add
code). Malformed ``Range`` headers, other units and a non-matching ``If-Range`` are ignored the
same way. The ``ETag`` is the file's sha256, so ``If-Range`` makes a resumed download safe.
"""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator
from dataclasses import dataclass

import anyio.to_thread
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from shoal.data.errors import RangeNotSatisfiable

CHUNK_BYTES = 1 << 20
"""Bytes read from disk (in a thread) and sent per chunk."""

_SINGLE = re.compile(r"^(\d*)-(\d*)$")


@dataclass(frozen=True)
class OpenFile:
    """An open file descriptor, with the size and sha256 of the file it reads."""

    fd: int
    size: int
    sha256: str

    @property
    def etag(self) -> str:
        return f'"{self.sha256}"'


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """The ``[start, end)`` a ``Range`` header asks for, or None for the whole file.

    Raises ``RangeNotSatisfiable`` for a single range that selects nothing in the file.
    """
    if not header:
        return None
    unit, _, spec = header.partition("=")
    if unit.strip().lower() != "bytes" or "," in spec:
        return None
    match = _SINGLE.match(spec.strip())
    if match is None or match.group(0) == "-":
        return None
    first, last = match.groups()
    if not first:  # suffix: the last n bytes
        n = int(last)
        if n == 0 or size == 0:
            raise _unsatisfiable(header, size)
        return max(0, size - n), size
    start = int(first)
    if last and int(last) < start:
        return None  # invalid: ignored, as RFC 9110 says
    if start >= size:
        raise _unsatisfiable(header, size)
    end = min(int(last) + 1, size) if last else size
    return start, end


def _unsatisfiable(header: str, size: int) -> RangeNotSatisfiable:
    return RangeNotSatisfiable(
        f"Range {header!r} selects no bytes of this {size}-byte file. Ask for bytes=START-END "
        f"with START below {size}.",
        param="Range",
        headers={"Content-Range": f"bytes */{size}"},
    )


def file_response(
    file: OpenFile, *, head: bool, range_header: str | None, if_range: str | None
) -> Response:
    """The response for GET or HEAD of ``file``. Owns ``file.fd``: it is always closed."""
    try:
        wanted = parse_range(range_header, file.size) if if_range in (None, file.etag) else None
    except RangeNotSatisfiable:
        os.close(file.fd)
        raise
    start, end = wanted or (0, file.size)
    headers = {
        "Accept-Ranges": "bytes",
        "ETag": file.etag,
        "Content-Length": str(end - start),
    }
    status = 200
    if wanted is not None:
        status = 206
        headers["Content-Range"] = f"bytes {start}-{end - 1}/{file.size}"
    if head:
        os.close(file.fd)
        return Response(status_code=status, headers=headers, media_type="application/octet-stream")
    return FileSliceResponse(file.fd, start, end, status_code=status, headers=headers)


class FileSliceResponse(StreamingResponse):
    """Bytes ``[start, end)`` of an open file, read in chunks; closes the descriptor when done.

    Reads are ``os.pread`` at absolute offsets, so the file served is the one opened even if
    the path is replaced meanwhile.
    """

    def __init__(
        self, fd: int, start: int, end: int, *, status_code: int, headers: dict[str, str]
    ) -> None:
        self._fd = fd
        super().__init__(
            self._chunks(start, end),
            status_code=status_code,
            headers=headers,
            media_type="application/octet-stream",
        )

    async def _chunks(self, start: int, end: int) -> AsyncIterator[bytes]:
        offset = start
        while offset < end:
            # Not abandoned on cancellation: the read finishes before the descriptor closes.
            chunk = await anyio.to_thread.run_sync(
                os.pread, self._fd, min(CHUNK_BYTES, end - offset), offset
            )
            if not chunk:
                raise OSError(f"file shrank while being served (at byte {offset} of {end})")
            offset += len(chunk)
            yield chunk

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            os.close(self._fd)
