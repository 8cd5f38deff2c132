"""HTTP to the llama-server this worker runs (or attaches to): its connection pool and a
POST that survives a connection the server closed.

llama-server closes a connection after each streamed answer, and aiohttp may hand such a
connection out again before it notices. A POST that fails to go out on it reached nothing,
so ``post`` sends it once more on a fresh connection.

So that a job does not wait for a TCP connection to be opened (and for llama-server to take
it on), each answer's connection is closed as the answer ends and a fresh one is opened for
the next job at once (``open_spare``: a cheap GET whose connection stays in the pool, up
to ``KEEPALIVE_S``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import aiohttp

log = logging.getLogger(__name__)

KEEPALIVE_S = 3.0
"""Under llama-server's own 5 s idle limit, so we never write to a connection it is closing."""
TIMEOUT = aiohttp.ClientTimeout(total=None, connect=10.0, sock_connect=10.0)
"""Generous: the router's own request timeouts apply; a long answer must not be cut here."""
SPARE_TIMEOUT = aiohttp.ClientTimeout(total=2.0)
"""Opening a spare connection takes a millisecond; past this none is kept ready."""


def session() -> aiohttp.ClientSession:
    """The connection pool to the worker's llama-server."""
    connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
    return aiohttp.ClientSession(connector=connector, timeout=TIMEOUT)


async def post(
    client: aiohttp.ClientSession,
    url: str,
    data: bytes,
    headers: Mapping[str, str] | None = None,
    timeout: aiohttp.ClientTimeout | None = None,
) -> aiohttp.ClientResponse:
    """POST ``data``; once more on a fresh connection when the pooled one had been closed by
    the server (nothing reached it). The caller reads and releases the response."""
    timeout = timeout or client.timeout
    try:
        return await client.post(url, data=data, headers=headers, timeout=timeout)
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
        log.debug("%s: stale connection (%r), posting again", url, exc)
        return await client.post(url, data=data, headers=headers, timeout=timeout)


async def open_spare(
    client: aiohttp.ClientSession, url: str, headers: Mapping[str, str] | None = None
) -> None:
    """Leave an open connection to the server in ``client``'s pool for the next job: GET
    ``url`` (a cheap answer the server keeps the connection after); nothing when it fails
    (the next job opens its own)."""
    try:
        async with client.get(url, headers=headers, timeout=SPARE_TIMEOUT) as resp:
            await resp.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.debug("%s: no spare connection (%r)", url, exc)
