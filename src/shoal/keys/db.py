"""Which database holds the keys, and SQLAlchemy engines for it.

One setting, ``SHOAL_DATABASE_URL`` (SQLAlchemy-style), picks the database:

- unset: ``sqlite:///<data dir>/shoal.db``, a file in Shoal's data folder (one machine);
- ``sqlite:///path/to/file.db``: that file (its folder is created);
- ``postgresql://user:password@host:5432/dbname``: PostgreSQL through psycopg 3, which lets
  several routers share keys, limits and usage. To keep Shoal's tables in their own schema,
  give libpq's ``options``: ``postgresql://.../db?options=-csearch_path%3Dshoal`` (the
  schema must exist); the tests use exactly that to get a schema per run.

SQLite runs in WAL mode (readers never wait for the writer) with a busy timeout, and every
write transaction starts with ``BEGIN IMMEDIATE`` so two writers queue on the lock instead of
failing with "database is locked" when one upgrades a read lock.
"""

from __future__ import annotations

import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import URL, Connection, Engine, make_url
from sqlalchemy.exc import ArgumentError

from shoal.keys.errors import DatabaseError
from shoal.paths import default_data_dir

DEFAULT_FILE = "shoal.db"
SQLITE_BUSY_MS = 30_000
PG_CONNECT_TIMEOUT_S = 10
WAL_RETRY_S = 0.02
WRITE_OPTION = "shoal_write"  # execution option: this transaction will write

URL_HINT = (
    "Set SHOAL_DATABASE_URL (or --database-url) to sqlite:///PATH or "
    "postgresql://USER:PASSWORD@HOST:5432/DBNAME, or leave it unset for a SQLite file "
    "in Shoal's data folder."
)


@dataclass(frozen=True)
class Database:
    """A resolved database URL: ``postgresql+psycopg://...`` or ``sqlite:///path``."""

    url: URL

    @property
    def kind(self) -> str:
        """``sqlite`` or ``postgresql``."""
        return self.url.get_backend_name()

    @property
    def sqlite_path(self) -> Path:
        if self.kind != "sqlite" or not self.url.database:
            raise ValueError(f"{self.display()} is not a SQLite file")
        return Path(self.url.database)

    def display(self) -> str:
        """The URL with any password hidden: safe to log and print."""
        return self.url.render_as_string(hide_password=True)

    def libpq_dsn(self) -> str:
        """The PostgreSQL URL as libpq reads it, for psycopg's own (listening) connection."""
        return self.url.set(drivername="postgresql").render_as_string(hide_password=False)


def default_database_url(data_dir: Path | None = None) -> str:
    return f"sqlite:///{(data_dir or default_data_dir()) / DEFAULT_FILE}"


def resolve_database(database_url: str | None, data_dir: Path | None = None) -> Database:
    """Parse and normalise the URL; unsupported ones raise DatabaseError saying what works."""
    text = database_url or default_database_url(data_dir)
    try:
        url = make_url(text)
    except ArgumentError:
        raise DatabaseError(f"cannot read the database URL {text!r}. {URL_HINT}") from None
    backend = url.get_backend_name()
    if backend in {"postgres", "postgresql"}:
        return Database(url.set(drivername="postgresql+psycopg"))
    if backend == "sqlite":
        if url.database in (None, "", ":memory:"):
            raise DatabaseError(
                f"{text!r}: an in-memory SQLite database would lose every key at exit and "
                f"cannot be shared. Give a file: sqlite:///PATH. {URL_HINT}"
            )
        return Database(url.set(drivername="sqlite"))
    raise DatabaseError(
        f"unsupported database {backend!r} in {Database(url).display()}. {URL_HINT}"
    )


def make_engine(db: Database) -> Engine:
    """An engine for ``db``; SQLite's folder is created and its connections tuned."""
    if db.kind == "sqlite":
        return _sqlite_engine(db)
    return sa.create_engine(
        db.url,
        pool_pre_ping=True,
        pool_size=5,
        max_overflow=5,
        connect_args={"connect_timeout": PG_CONNECT_TIMEOUT_S, "application_name": "shoal"},
    )


def _sqlite_engine(db: Database) -> Engine:
    path = db.sqlite_path
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        raise DatabaseError(f"cannot create the folder for {path}: {exc}. {URL_HINT}") from None
    engine = sa.create_engine(db.url, connect_args={"timeout": SQLITE_BUSY_MS / 1000})
    sa.event.listen(engine, "connect", _sqlite_on_connect)
    sa.event.listen(engine, "begin", _sqlite_on_begin)
    return engine


def tune_sqlite(conn: sqlite3.Connection) -> None:
    """WAL, a busy timeout, foreign keys: for every connection to Shoal's SQLite file."""
    conn.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_MS}")
    _use_wal(conn)
    conn.execute("PRAGMA synchronous = NORMAL")
    conn.execute("PRAGMA foreign_keys = ON")


def _use_wal(conn: sqlite3.Connection) -> None:
    """Switch the file to WAL (it stays so). Switching needs the file to itself, and SQLite
    answers "database is locked" at once, without its busy handler, while another connection
    (a second process starting at the same moment) holds it: retry until the busy timeout."""
    if conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal":
        return
    deadline = time.monotonic() + SQLITE_BUSY_MS / 1000
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
            time.sleep(WAL_RETRY_S)


def _sqlite_on_connect(dbapi_connection: Any, _record: Any) -> None:
    # SQLAlchemy, not the sqlite3 module, decides where transactions begin (see _on_begin).
    dbapi_connection.isolation_level = None
    tune_sqlite(dbapi_connection)


def _sqlite_on_begin(conn: Connection) -> None:
    writes = bool(conn.get_execution_options().get(WRITE_OPTION))
    conn.exec_driver_sql("BEGIN IMMEDIATE" if writes else "BEGIN")


def writer(engine: Engine) -> Engine:
    """The same engine, but its transactions take SQLite's write lock when they begin."""
    return engine.execution_options(**{WRITE_OPTION: True})
