"""The router's composition root: settings in, ASGI app and server out."""

from __future__ import annotations

import logging
import socket

from fastapi import FastAPI
from starlette.types import ASGIApp

from shoal import __version__, serving
from shoal.data import routes as data_routes
from shoal.data.store import ModelStore
from shoal.router import errors
from shoal.router.auth import KeyCheck
from shoal.router.context import RouterContext
from shoal.router.dispatch import Dispatcher
from shoal.router.routes import health, inference, models, pipeline, worker_socket
from shoal.router.settings import RouterSettings
from shoal.router.workers import Registry

log = logging.getLogger(__name__)


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
    if settings.storage is not None:
        try:
            store = ModelStore(settings.storage)
        except OSError as exc:
            raise RouterConfigError(
                f"cannot use {settings.storage} as the model store: {exc.strerror}"
            ) from None
        data_routes.install(
            app,
            store,
            read_keys=settings.api_key + settings.gpu_key,  # clients and workers may read
            admin_keys=settings.admin_key,
        )
    return inference.FastPath(app, ctx)


def describe_security(settings: RouterSettings) -> str:
    if settings.api_key:
        return f"clients need one of {len(settings.api_key)} API key(s)"
    return "no API key configured: open to anyone who can reach " + settings.host


def bind(host: str, port: int) -> socket.socket:
    try:
        return serving.bind(host, port)
    except serving.BindError as exc:
        raise RouterConfigError(str(exc)) from None


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
    await serving.serve_on(serving.build_server(app, websockets=True), sock)
