"""Serving an ASGI app the way every Shoal server does: socket bound first, uvicorn quiet,
signals owned by the process's composition root, cancellation closing connections, and TLS
(HTTPS and WSS) when given a certificate and key, accepted by ``tls_listener`` so that a
client speaking plain HTTP to the port is answered and named in the log."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
from collections.abc import Callable, Generator
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from starlette.types import ASGIApp

from shoal.settings import KEEP_ALIVE_S
from shoal.tls_listener import TlsListener

GRACEFUL_SHUTDOWN_S = 5


class BindError(Exception):
    pass


class TlsError(Exception):
    """The certificate or key cannot serve TLS; the message says which file and why."""


@dataclass(frozen=True)
class TlsFiles:
    """A PEM certificate (chain) and its private key; both may be the same file."""

    cert: Path
    key: Path


def tls_files(cert: Path | None, key: Path | None) -> TlsFiles | None:
    """``--tls-cert`` and ``--tls-key`` as given: both (HTTPS), neither (plain HTTP), or a
    ``TlsError`` saying which one is missing."""
    if cert is None and key is None:
        return None
    if cert is None or key is None:
        given, missing = ("--tls-cert", "--tls-key") if key is None else ("--tls-key", "--tls-cert")
        raise TlsError(
            f"{given} needs {missing} too: give both (the PEM certificate and its private key) "
            "to serve HTTPS, or neither for plain HTTP."
        )
    return TlsFiles(cert, key)


_PEM_MARKERS = (("certificate", b"-----BEGIN CERTIFICATE-----"), ("key", b"PRIVATE KEY-----"))


class _EncryptedKey(Exception):
    pass


def _no_password() -> str:
    raise _EncryptedKey  # instead of OpenSSL asking for a pass phrase on the terminal


def server_tls_context(tls: TlsFiles) -> ssl.SSLContext:
    """A TLS server context for ``tls``; ``TlsError`` naming the file and the fix otherwise."""
    for (what, marker), path in zip(_PEM_MARKERS, (tls.cert, tls.key), strict=True):
        try:
            text = path.read_bytes()
        except OSError as exc:
            raise TlsError(f"cannot read the TLS {what} {path}: {exc.strerror}") from None
        if marker not in text:
            raise TlsError(
                f"the TLS {what} {path} is not a PEM {what} (no {marker.decode()!r} line); "
                f"give --tls-cert the certificate and --tls-key its private key, both as PEM."
            )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(tls.cert, tls.key, password=_no_password)
    except _EncryptedKey:
        raise TlsError(
            f"the TLS key {tls.key} is protected by a pass phrase; give a key without one "
            f"(openssl pkey -in {tls.key} -out key.pem) and keep that file private."
        ) from None
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise TlsError(
                f"the TLS key {tls.key} does not belong to the certificate {tls.cert}; "
                "give the private key the certificate was issued for."
            ) from None
        raise TlsError(
            f"cannot serve TLS with the certificate {tls.cert} and key {tls.key}: "
            f"{exc.reason or exc}"
        ) from None
    return context


def bind(host: str, port: int) -> socket.socket:
    """Bind the listening socket up front: errors surface at once and port 0 works."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise BindError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the process's composition root owns signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


class _TlsServer(_Server):
    """uvicorn whose connections are accepted by a ``TlsListener`` instead of the event
    loop's TLS server: uvicorn keeps its protocols, its connection bookkeeping and its
    shutdown; it only opens no listener of its own."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._accepting: list[asyncio.Task[None]] = []

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=[])
        assert sockets and self.config.ssl is not None, "serve_on gives the bound socket"
        loop = asyncio.get_running_loop()

        def protocol() -> asyncio.Protocol:
            # What uvicorn's own create_server would build for each connection.
            return self.config.http_protocol_class(  # type: ignore[call-arg]  # uvicorn's kwargs
                config=self.config,
                server_state=self.server_state,
                app_state=self.lifespan.state,
                _loop=loop,
            )

        for sock in sockets:
            task = loop.create_task(TlsListener(sock, protocol, self.config.ssl).run())
            task.add_done_callback(self._listener_ended)
            self._accepting.append(task)

    def _listener_ended(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled():
            self.should_exit = True  # shutdown() awaits it and raises what ended it

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        accepting, self._accepting = self._accepting, []
        for task in accepting:
            task.cancel()
        for task in accepting:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await super().shutdown(sockets)


ContextFactory = Callable[[uvicorn.Config, Callable[[], ssl.SSLContext]], ssl.SSLContext]


def _context_factory(context: ssl.SSLContext) -> ContextFactory:
    """uvicorn's hook for a ready-made context (it would otherwise load the files again)."""

    def factory(config: uvicorn.Config, default: Callable[[], ssl.SSLContext]) -> ssl.SSLContext:
        return context

    return factory


def build_server(
    app: ASGIApp,
    *,
    websockets: bool = False,
    tls: TlsFiles | None = None,
    keep_alive: int = KEEP_ALIVE_S,
) -> uvicorn.Server:
    """A quiet uvicorn server for ``app``; HTTPS (and WSS) with ``tls``; idle client
    connections closed after ``keep_alive`` seconds.

    The certificate and key are loaded here, so a bad one is a ``TlsError`` before anything
    is served, not a traceback on the first connection. A TLS server's connections are
    accepted by a ``TlsListener``.
    """
    factory = None if tls is None else _context_factory(server_tls_context(tls))
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        loop="none",
        ws="websockets-sansio" if websockets else "none",
        ws_max_size=64 * 1024 * 1024,
        # No keepalive pings of the server's own: the router's only WebSockets are its
        # workers', which prove they live with heartbeats (``routes/worker_socket``) and
        # ping the router themselves; 10,000 of them were 500 pings and pongs a second.
        ws_ping_interval=None,
        ws_ping_timeout=None,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        timeout_keep_alive=keep_alive,
        lifespan="off",
        ssl_context_factory=factory,
    )
    return _Server(config) if tls is None else _TlsServer(config)


async def serve_on(server: uvicorn.Server, sock: socket.socket) -> None:
    """Serve until cancelled; on cancellation close the connections, then re-raise."""
    try:
        await server.serve(sockets=[sock])
    except asyncio.CancelledError:
        server.should_exit = True
        await server.shutdown(sockets=[sock])
        raise
    finally:
        sock.close()
