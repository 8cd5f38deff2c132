"""Bring the key database's schema up to date with Alembic, safely from several processes.

Every router and CLI command calls ``upgrade(engine)`` at start-up; it is idempotent. Two
routers starting together do not race: on PostgreSQL the upgrade runs in one transaction
holding an advisory lock (``pg_advisory_xact_lock``), DDL included, so the second waits and
then finds the schema at head; on SQLite the transaction begins with ``BEGIN IMMEDIATE``,
which takes the file's write lock for the same effect.

To write a new revision (a developer task), with a database at head::

    from alembic import command
    from shoal.keys.migrate import alembic_config
    command.revision(alembic_config(), "what changed")  # then edit versions/vNNNN_*.py
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Engine

from shoal.keys.db import writer

log = logging.getLogger(__name__)

VERSION_TABLE = "shoal_alembic_version"
MIGRATIONS_DIR = Path(__file__).parent / "migrations"
# Any fixed 64-bit number, the same in every Shoal process: "shoal-keys-migrate".
ADVISORY_LOCK_ID = 0x5A0A_1C0D_E000_0001


def alembic_config() -> Config:
    """Alembic's configuration, built in code (Shoal ships no alembic.ini)."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("version_locations", str(MIGRATIONS_DIR / "versions"))
    config.set_main_option("path_separator", "os")
    return config


def head_revision() -> str:
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise RuntimeError(f"no migrations found in {MIGRATIONS_DIR}: a broken installation")
    return head


def current_revision(engine: Engine) -> str | None:
    """The revision the database is at, or None for an empty database."""
    with engine.connect() as conn:
        context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        return context.get_current_revision()


@contextmanager
def _quiet_alembic() -> Iterator[None]:
    """Alembic narrates every start-up at INFO; keep that for when Shoal logs at DEBUG."""
    alembic_log = logging.getLogger("alembic")
    before = alembic_log.level
    if not log.isEnabledFor(logging.DEBUG):
        alembic_log.setLevel(logging.WARNING)
    try:
        yield
    finally:
        alembic_log.setLevel(before)


def upgrade(engine: Engine) -> None:
    """Create or update the schema to the newest revision, under the migration lock."""
    with _quiet_alembic(), writer(engine).begin() as conn:
        if conn.dialect.name == "postgresql":
            conn.execute(sa.text("SELECT pg_advisory_xact_lock(:id)"), {"id": ADVISORY_LOCK_ID})
        context = MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE})
        before = context.get_current_revision()
        head = head_revision()
        if before == head:
            return
        config = alembic_config()
        config.attributes["connection"] = conn
        command.upgrade(config, "head")
    log.info("key database schema upgraded from %s to %s", before or "empty", head)
