"""The model store's composition root: settings in, ASGI app and server out.

HTTPS, and the answer to plain HTTP sent to it, are every Shoal server's (``shoal.serving``);
keys are checked by the rule the router's embedded store follows too (``keys.StoreKeys``).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import TYPE_CHECKING

import anyio.to_thread
import uvicorn
from fastapi import FastAPI
from starlette.types import ASGIApp

from shoal import __version__, serving
from shoal.data import errors, routes
from shoal.data.keys import StoreKeys
from shoal.data.settings import DataSettings
from shoal.data.store import ModelStore

if TYPE_CHECKING:
    from shoal.keys.store import KeyStore

log = logging.getLogger(__name__)


class DataConfigError(Exception):
    """The store must not start with these settings; the message says what to change."""


def open_database(settings: DataSettings) -> KeyStore | None:
    """The key database of ``--database-url`` (None without one); the caller closes it."""
    if settings.database_url is None:
        return None
    from shoal.keys import KeyStoreError, open_store  # SQLAlchemy only when it is used

    try:
        return open_store(settings.database_url)
    except KeyStoreError as exc:
        raise DataConfigError(f"cannot open the key database: {exc}") from None


def store_keys(settings: DataSettings, database: KeyStore | None) -> StoreKeys:
    return StoreKeys(
        read=settings.api_key,
        admin=settings.admin_key,
        database=database,
        open_when_keyless=settings.on_loopback,
    )


def build_app(settings: DataSettings, database: KeyStore | None = None) -> FastAPI:
    """The store's app; raises ``DataConfigError`` for an unsafe configuration.

    ``database``: the key database (``open_database``), whose keys count beside the flags'.
    """
    keys = store_keys(settings, database)
    problem = keys.startup_problem(settings.host)
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
    routes.install(app, store, access=keys, max_upload_bytes=settings.max_upload_bytes)
    return app


def bind(host: str, port: int) -> socket.socket:
    try:
        return serving.bind(host, port)
    except serving.BindError as exc:
        raise DataConfigError(str(exc)) from None


def build_server(settings: DataSettings, app: ASGIApp) -> uvicorn.Server:
    """uvicorn for ``app``: HTTPS with ``--tls-cert``/``--tls-key``, as the router serves."""
    try:
        tls = serving.tls_files(settings.tls_cert, settings.tls_key)
        return serving.build_server(app, tls=tls)
    except serving.TlsError as exc:
        raise DataConfigError(str(exc)) from None


async def serve(
    settings: DataSettings,
    sock: socket.socket | None = None,
    *,
    app: ASGIApp | None = None,
    database: KeyStore | None = None,
) -> None:
    """Run the store until cancelled. Pass ``sock`` to serve an already bound socket.

    ``app`` defaults to ``build_app(settings)`` over ``open_database(settings)`` (closed when
    the store stops); pass one to serve a wrapped app, with the ``database`` it was built on
    (the caller's to close). The database's change watch runs while the store serves, so its
    key cache is trusted (PostgreSQL: a revoke elsewhere reaches it by NOTIFY).
    """
    opened = None
    try:
        if app is None:
            database = opened = open_database(settings)
            app = build_app(settings, database)
        server = build_server(settings, app)
        sock = sock or bind(settings.host, settings.port)
        host, port = sock.getsockname()[:2]
        keys = store_keys(settings, database)
        log.info(
            "model store %s on %s://%s:%d serving %s (%s)",
            __version__,
            "https" if server.config.is_ssl else "http",
            host,
            port,
            settings.storage,
            await anyio.to_thread.run_sync(keys.describe, settings.host),
        )
        if database is None:
            await serving.serve_on(server, sock)
            return
        async with asyncio.TaskGroup() as tasks:
            watching = tasks.create_task(database.run(), name="keys-watch")
            await serving.serve_on(server, sock)
            watching.cancel()
    finally:
        if opened is not None:
            opened.close()
