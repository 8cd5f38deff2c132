"""How a process learns that keys changed elsewhere, so its cache never outlives a revoke.

``PgListener`` (PostgreSQL, several routers): one connection per process runs
``LISTEN shoal_keys``; every write to the keys sends ``NOTIFY`` in its own transaction, so
the notification arrives exactly when the change is visible, and the cache is dropped. While
that connection is down (or not yet up) the cache is not trusted: every request is checked
in the database until it is back. A ping every ``PING_INTERVAL`` seconds and TCP keepalives
bound how long a silently dead connection can go unnoticed.

``SqliteWatch`` (SQLite, one machine): ``PRAGMA data_version`` on a dedicated connection
changes whenever another connection (another process, or this one's pool) committed. It is
a read of shared memory, microseconds, so it runs on every request, inline.

Both answer ``trusted()`` per request: may the cache be used now?
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import threading
from pathlib import Path
from typing import Protocol

import psycopg

from shoal.keys.cache import KeyCache
from shoal.keys.tables import NOTIFY_CHANNEL

log = logging.getLogger(__name__)

PING_INTERVAL = 5.0  # seconds between liveness checks of the listening connection
PING_TIMEOUT = 5.0
CONNECT_TIMEOUT = 10
RETRY_FIRST = 0.5  # first reconnect delay, doubling up to RETRY_MAX
RETRY_MAX = 10.0
SQLITE_WATCH_BUSY_S = 0.05


class Watch(Protocol):
    def trusted(self) -> bool:
        """May the cache answer this request? (Drops the cache first if keys changed.)"""
        ...

    async def run(self) -> None:
        """Background work, if any, until cancelled."""
        ...

    def close(self) -> None: ...


class SqliteWatch:
    def __init__(self, path: Path, cache: KeyCache) -> None:
        self._cache = cache
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = sqlite3.connect(
            path, timeout=SQLITE_WATCH_BUSY_S, isolation_level=None, check_same_thread=False
        )
        self._version = self._read()
        self._failing = False

    def _read(self) -> int:
        with self._lock:
            if self._conn is None:
                raise sqlite3.ProgrammingError("the key store was closed")
            row = self._conn.execute("PRAGMA data_version").fetchone()
        return int(row[0])

    def trusted(self) -> bool:
        try:
            version = self._read()
        except sqlite3.Error as exc:
            if not self._failing:
                log.warning(
                    "cannot check the key database for changes (%s): checking keys "
                    "in the database on every request",
                    exc,
                )
                self._failing = True
            self._cache.clear("change check failed")
            return False
        self._failing = False
        if version != self._version:
            self._version = version
            self._cache.clear("the database changed")
        return True

    async def run(self) -> None:
        return  # nothing runs in the background: every request checks data_version

    def close(self) -> None:
        if self._conn is not None:
            with self._lock:
                self._conn.close()
                self._conn = None


class PgListener:
    def __init__(
        self,
        dsn: str,
        cache: KeyCache,
        *,
        retry_first: float = RETRY_FIRST,
        retry_max: float = RETRY_MAX,
        ping_interval: float = PING_INTERVAL,
    ) -> None:
        self._dsn = dsn  # carries the password: never logged
        self._cache = cache
        self._retry_first = retry_first
        self._retry_max = retry_max
        self._ping_interval = ping_interval
        self._up = asyncio.Event()
        self._down = asyncio.Event()
        self._down.set()
        self._notified = asyncio.Event()
        self.backend_pid: int | None = None
        self.notifications = 0

    @property
    def listening(self) -> bool:
        return self._up.is_set()

    def trusted(self) -> bool:
        return self._up.is_set()

    async def wait(self, *, up: bool) -> None:
        """Until the listener is up (or down)."""
        await (self._up if up else self._down).wait()

    async def wait_notified(self, count: int) -> None:
        """Until ``count`` key-change notifications have arrived in all (each drops the cache)."""
        while self.notifications < count:
            await self._notified.wait()

    def _on_notify(self, payload: str) -> None:
        self.notifications += 1
        self._cache.clear(f"notified: {payload}")
        done, self._notified = self._notified, asyncio.Event()
        done.set()

    def _set_up(self, pid: int) -> None:
        self.backend_pid = pid
        # Anything revoked while nobody listened is in the database; forget what we knew.
        self._cache.clear("listening for key changes again")
        self._down.clear()
        self._up.set()
        log.info("listening for key changes on PostgreSQL (backend pid %d)", pid)

    def _set_down(self, why: str, *, quiet: bool = False) -> None:
        if self._up.is_set() and not quiet:
            log.warning(
                "lost the key-change listener (%s): checking keys in the database on every "
                "request until it is back",
                why,
            )
        self.backend_pid = None
        self._up.clear()
        self._down.set()
        self._cache.clear("key-change listener down")

    async def run(self) -> None:
        delay = self._retry_first
        while True:
            try:
                await self._listen_once()
            except (psycopg.Error, OSError, TimeoutError) as exc:
                if self._up.is_set():
                    delay = self._retry_first  # it was working: retry soon
                self._set_down(str(exc).strip() or type(exc).__name__)
            finally:
                if self._up.is_set():  # cancelled (shutting down) while listening
                    self._set_down("stopped", quiet=True)
            log.debug("reconnecting the key-change listener in %.1fs", delay)
            await asyncio.sleep(delay)
            delay = min(self._retry_max, delay * 2)

    async def _listen_once(self) -> None:
        conn = await psycopg.AsyncConnection.connect(
            self._dsn,
            autocommit=True,
            application_name="shoal-keys-listener",
            connect_timeout=CONNECT_TIMEOUT,
            keepalives=1,
            keepalives_idle=10,
            keepalives_interval=5,
            keepalives_count=3,
        )
        async with conn:
            await conn.execute(f"LISTEN {NOTIFY_CHANNEL}")
            self._set_up(conn.info.backend_pid)
            while True:
                async for notify in conn.notifies(timeout=self._ping_interval):
                    self._on_notify(notify.payload)
                # No news for a while: make sure the connection is alive, else reconnect.
                await asyncio.wait_for(conn.execute("SELECT 1"), PING_TIMEOUT)

    def close(self) -> None:
        return  # the connection is closed when run() is cancelled
