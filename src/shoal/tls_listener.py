"""Accepting TLS connections for a Shoal server, and answering plain HTTP sent to them.

Left to itself, the event loop (asyncio or uvloop) wraps every accepted socket in TLS; a
client that speaks plain HTTP to the port (``http://``, or a worker dialing ``ws://``) fails
the handshake, and that failure is logged nowhere (only at debug level, with the loop in debug
mode, and without the peer). So a TLS server accepts its connections here instead: the first
bytes of each are peeked at (nothing is consumed). A TLS ClientHello (record type 22) goes on
to the handshake (``loop.connect_accepted_socket``) and then to uvicorn's protocol, as before;
plain HTTP gets a 400 whose OpenAI-style error says to use https:// or wss://, and the log gets
one WARNING line naming the peer (again for that peer only after ``PLAIN_HTTP_WARN_EVERY_S``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
from collections.abc import Callable
from typing import Literal

import orjson

from shoal.api_errors import BadRequest, error_payload

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT_S = 60.0
"""From accepting a connection to the end of its TLS handshake (asyncio's own default)."""
PLAIN_HTTP_WARN_EVERY_S = 600.0
"""A client that keeps sending plain HTTP (a worker retrying) is named once per this period."""
ACCEPT_RETRY_S = 1.0
"""Pause before accepting again after accept() failed for lack of file descriptors or memory
(what asyncio's own accept loop does)."""
PEEK_BYTES = 1
"""The TLS record type, or the first letter of an HTTP method: enough to tell them apart."""
MAX_PEERS_REMEMBERED = 4096
TLS_HANDSHAKE_RECORD = 0x16
USE_TLS = (
    "use https:// (a worker: --router-url wss://HOST:PORT, or HOST:PORT with --tls-ca; "
    "--model-store https://HOST:PORT)"
)

Kind = Literal["tls", "http", "other"]
ProtocolFactory = Callable[[], asyncio.Protocol]


def kind_of(first: bytes) -> Kind:
    """What a connection's first bytes say it speaks: a TLS handshake, plain HTTP (a request
    line starts with an upper-case method), or something else."""
    if first[:1] == bytes([TLS_HANDSHAKE_RECORD]):
        return "tls"
    if first[:1].isupper():
        return "http"
    return "other"


class PeerWarnings:
    """When to warn about a peer again: the first time, then once per ``every`` seconds."""

    def __init__(self, every: float = PLAIN_HTTP_WARN_EVERY_S) -> None:
        self.every = every
        self._last: dict[str, float] = {}

    def due(self, peer: str, now: float) -> bool:
        last = self._last.get(peer)
        if last is not None and now - last < self.every:
            return False
        if len(self._last) >= MAX_PEERS_REMEMBERED:  # forget the oldest half
            newest = sorted(self._last.items(), key=lambda item: item[1])
            kept = newest[MAX_PEERS_REMEMBERED // 2 :]
            self._last = {p: t for p, t in kept if now - t < self.every}
        self._last[peer] = now
        return True

    def __len__(self) -> int:
        """How many peers are remembered (at most ``MAX_PEERS_REMEMBERED``)."""
        return len(self._last)


def _plain_http_answer() -> bytes:
    """A whole HTTP/1.1 response: no server framework runs on a connection refused this early."""
    body = orjson.dumps(
        error_payload(BadRequest(f"this port serves HTTPS: {USE_TLS}", code="tls_required"))
    )
    head = (
        "HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


PLAIN_HTTP_ANSWER = _plain_http_answer()


class TlsListener:
    """Accepts on ``listener`` until cancelled; each connection is handed, once its TLS
    handshake is done, to a protocol from ``protocol`` (uvicorn's, for that server)."""

    def __init__(
        self, listener: socket.socket, protocol: ProtocolFactory, context: ssl.SSLContext
    ) -> None:
        self.listener = listener
        self.protocol = protocol
        self.context = context
        self.warnings = PeerWarnings()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        async with asyncio.TaskGroup() as tg:
            while True:
                try:
                    conn, address = await loop.sock_accept(self.listener)
                except (ConnectionAbortedError, InterruptedError):
                    continue  # the client left before we got to it
                except OSError as exc:  # EMFILE, ENFILE, ENOBUFS, ENOMEM: wait, then go on
                    log.error("cannot accept a connection: %s; again in %g s", exc, ACCEPT_RETRY_S)
                    await asyncio.sleep(ACCEPT_RETRY_S)
                    continue
                tg.create_task(self._connection(conn, _peer(address)))

    async def _connection(self, conn: socket.socket, peer: str) -> None:
        """Peek, then hand over to TLS or answer plain HTTP; errors end only this connection."""
        handed_over = False
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT_S):
                conn.setblocking(False)
                first = await _peek(conn)
                kind = kind_of(first)
                if kind == "tls":
                    await asyncio.get_running_loop().connect_accepted_socket(
                        self.protocol, conn, ssl=self.context
                    )
                    handed_over = True
                elif kind == "http":
                    self._warn(peer)
                    await _answer_plain_http(conn)
                elif first:
                    log.debug("%s sent neither TLS nor HTTP; closed", peer)
        except (OSError, TimeoutError) as exc:  # ssl.SSLError is an OSError
            log.debug("TLS connection from %s failed: %s", peer, exc)
        finally:
            if not handed_over:
                conn.close()

    def _warn(self, peer: str) -> None:
        host = peer.rsplit(":", 1)[0]
        if self.warnings.due(host, asyncio.get_running_loop().time()):
            log.warning("%s sent plain HTTP to this HTTPS port (answered 400): %s", peer, USE_TLS)


async def _peek(conn: socket.socket) -> bytes:
    """The first bytes the client sent, left in the socket for whoever reads it next."""
    loop = asyncio.get_running_loop()
    readable: asyncio.Future[None] = loop.create_future()

    def ready() -> None:
        if not readable.done():
            readable.set_result(None)

    fd = conn.fileno()
    loop.add_reader(fd, ready)
    try:
        await readable
    finally:
        loop.remove_reader(fd)
    return conn.recv(PEEK_BYTES, socket.MSG_PEEK)


async def _answer_plain_http(conn: socket.socket) -> None:
    """A 400 saying to use TLS. The request is read first: closing a socket with unread data
    resets the connection, and the client might not see the answer."""
    loop = asyncio.get_running_loop()
    await loop.sock_recv(conn, 64 * 1024)
    await loop.sock_sendall(conn, PLAIN_HTTP_ANSWER)
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_WR)


def _peer(address: object) -> str:
    if isinstance(address, tuple) and len(address) >= 2:
        host, port = address[0], address[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"
    return str(address)
