"""The model store's composition root: settings in, ASGI app and server out."""

from __future__ import annotations

import logging
import socket

from fastapi import FastAPI
from starlette.types import ASGIApp

from shoal import __version__, serving
from shoal.data import errors, routes
from shoal.data.settings import DataSettings
from shoal.data.store import ModelStore

log = logging.getLogger(__name__)


class DataConfigError(Exception):
    """The store must not start with these settings; the message says what to change."""


def build_app(settings: DataSettings) -> FastAPI:
    """The store's app; raises ``DataConfigError`` for an unsafe configuration."""
    problem = settings.security_problem()
    if problem:
        raise DataConfigError(problem)
    try:
        store = ModelStore(settings.storage)
        store.remove_partial_uploads()
    except OSError as exc:
        raise DataConfigError(
            f"cannot use {settings.storage} as the storage folder: {exc.strerror}. "
            "Pass another one with --storage."
        ) from None
    app = FastAPI(
        title="Shoal model store",
        version=__version__,
        description="GGUF models for workers: whole files, layer ranges, uploads.",
        docs_url=None,
        redoc_url=None,
    )
    errors.install_all(app)
    routes.install(
        app,
        store,
        read_keys=settings.api_key,
        admin_keys=settings.admin_key,
        max_upload_bytes=settings.max_upload_bytes,
    )
    return app


def bind(host: str, port: int) -> socket.socket:
    try:
        return serving.bind(host, port)
    except serving.BindError as exc:
        raise DataConfigError(str(exc)) from None


def describe_security(settings: DataSettings) -> str:
    reads = (
        f"reads need one of {len(settings.api_key)} API key(s)"
        if settings.api_key
        else "reads open to anyone who can reach " + settings.host
    )
    writes = "uploads need an admin key" if settings.admin_key else "uploads disabled"
    return f"{reads}; {writes}"


async def serve(
    settings: DataSettings, sock: socket.socket | None = None, *, app: ASGIApp | None = None
) -> None:
    """Run the store until cancelled. Pass ``sock`` to serve an already bound socket.

    ``app`` defaults to ``build_app(settings)``; pass one to serve a wrapped app.
    """
    app = app or build_app(settings)
    sock = sock or bind(settings.host, settings.port)
    host, port = sock.getsockname()[:2]
    log.info(
        "model store %s on http://%s:%d serving %s (%s)",
        __version__,
        host,
        port,
        settings.storage,
        describe_security(settings),
    )
    await serving.serve_on(serving.build_server(app), sock)
