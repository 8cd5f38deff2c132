"""The router's composition root: settings in, ASGI app and server out."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Generator

import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp

from shoal import __version__
from shoal.router import errors
from shoal.router.auth import KeyCheck
from shoal.router.context import RouterContext
from shoal.router.dispatch import Dispatcher
from shoal.router.routes import health, inference, models, pipeline, worker_socket
from shoal.router.settings import RouterSettings
from shoal.router.workers import Registry

log = logging.getLogger(__name__)

KEEP_ALIVE_S = 75
"""Idle client connections stay open this long: clients pool them (as nginx does, 75 s)."""


class RouterConfigError(Exception):
    pass


def build_app(settings: RouterSettings) -> ASGIApp:
    problem = settings.security_problem()
    if problem:
        raise RouterConfigError(problem)
    registry = Registry()
    app = FastAPI(
        title="Shoal router",
        version=__version__,
        description="OpenAI-compatible endpoint over workers that dial out.",
        docs_url=None,
        redoc_url=None,
    )
    ctx = RouterContext(
        settings=settings,
        registry=registry,
        dispatcher=Dispatcher(settings, registry),
        keys=KeyCheck(settings.api_key, settings.gpu_key),
    )
    app.state.ctx = ctx
    errors.install(app)
    for module in (inference, models, health, pipeline, worker_socket):
        app.include_router(module.router)
    return inference.FastPath(app, ctx)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handlers: the process's composition root owns signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


def build_server(settings: RouterSettings, app: ASGIApp | None = None) -> uvicorn.Server:
    config = uvicorn.Config(
        app or build_app(settings),
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,
        loop="none",
        ws="websockets-sansio",
        ws_max_size=64 * 1024 * 1024,
        ws_ping_interval=20.0,
        ws_ping_timeout=20.0,
        timeout_graceful_shutdown=5,
        timeout_keep_alive=KEEP_ALIVE_S,
        lifespan="off",
    )
    return _Server(config)


def describe_security(settings: RouterSettings) -> str:
    if settings.api_key:
        return f"clients need one of {len(settings.api_key)} API key(s)"
    return "no API key configured: open to anyone who can reach " + settings.host


def bind(host: str, port: int) -> socket.socket:
    """Bind the listening socket up front: errors surface at once and port 0 works."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise RouterConfigError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def serve(settings: RouterSettings, sock: socket.socket | None = None) -> None:
    """Run the router until cancelled. Pass ``sock`` to serve an already bound socket."""
    app = build_app(settings)
    sock = sock or bind(settings.host, settings.port)
    host, port = sock.getsockname()[:2]
    log.info(
        "router %s on http://%s:%d (%s; %s)",
        __version__,
        host,
        port,
        describe_security(settings),
        "workers need a GPU key" if settings.gpu_key else "any local worker may join",
    )
    server = build_server(settings, app)
    try:
        await server.serve(sockets=[sock])
    except asyncio.CancelledError:
        # Our caller owns signals and cancels us: close connections, then go.
        server.should_exit = True
        await server.shutdown(sockets=[sock])
        raise
    finally:
        sock.close()
