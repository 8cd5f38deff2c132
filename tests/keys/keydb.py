"""Helpers for the key store tests: the real PostgreSQL's admin URL, background tasks."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import psycopg

from shoal.keys import KeyStore

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/test"

StoreFactory = Callable[..., KeyStore]  # the ``stores`` fixture: open_store(url, **options)


def pg_execute(sql: str, *params: Any) -> list[tuple[Any, ...]]:
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        cur = conn.execute(sql, params or None)
        return cur.fetchall() if cur.description else []


@contextlib.asynccontextmanager
async def running(store: KeyStore) -> AsyncIterator[KeyStore]:
    """The store's background tasks (listener, usage writer) for the block."""
    task = asyncio.create_task(store.run())
    try:
        yield store
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
