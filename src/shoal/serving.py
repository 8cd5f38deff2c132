"""Serving an ASGI app the way every Shoal server does: socket bound first, uvicorn quiet,
signals owned by the process's composition root, cancellation closing connections."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Generator

import uvicorn
from starlette.types import ASGIApp

KEEP_ALIVE_S = 75
"""Idle client connections stay open this long: clients pool them (as nginx does, 75 s)."""
GRACEFUL_SHUTDOWN_S = 5


class BindError(Exception):
    pass


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


def build_server(app: ASGIApp, *, websockets: bool = False) -> uvicorn.Server:
    config = uvicorn.Config(
        app,
        log_level="warning",
        access_log=False,
        loop="none",
        ws="websockets-sansio" if websockets else "none",
        ws_max_size=64 * 1024 * 1024,
        ws_ping_interval=20.0,
        ws_ping_timeout=20.0,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        timeout_keep_alive=KEEP_ALIVE_S,
        lifespan="off",
    )
    return _Server(config)


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
