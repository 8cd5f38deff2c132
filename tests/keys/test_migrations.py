"""Alembic migrations on real SQLite and PostgreSQL: create, idempotent, race-free."""

from __future__ import annotations

import threading

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from keydb import StoreFactory

from shoal.keys import DatabaseError, open_store
from shoal.keys.db import make_engine, resolve_database
from shoal.keys.migrate import VERSION_TABLE, current_revision, head_revision, upgrade
from shoal.keys.tables import metadata


def test_upgrade_creates_the_schema_and_is_idempotent(db_url: str) -> None:
    engine = make_engine(resolve_database(db_url))
    try:
        assert current_revision(engine) is None
        upgrade(engine)
        assert current_revision(engine) == head_revision() == "0002"
        tables = set(sa.inspect(engine).get_table_names())
        assert {"api_keys", "usage", "deployments", VERSION_TABLE} <= tables
        upgrade(engine)  # again: nothing to do, nothing breaks
        assert current_revision(engine) == head_revision()
        with engine.connect() as conn:
            versions = conn.execute(sa.text(f"SELECT version_num FROM {VERSION_TABLE}")).all()
        assert versions == [("0002",)]
    finally:
        engine.dispose()


def test_migrated_schema_matches_the_tables_the_code_uses(db_url: str) -> None:
    engine = make_engine(resolve_database(db_url))
    try:
        upgrade(engine)
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn, opts={"version_table": VERSION_TABLE, "compare_type": True}
            )
            diff = compare_metadata(context, metadata)
        assert diff == []
    finally:
        engine.dispose()


def test_two_processes_starting_together_do_not_race(db_url: str, stores: StoreFactory) -> None:
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def open_one() -> None:
        start.wait()
        try:
            stores(db_url)
        except BaseException as exc:  # reported below, with the others
            errors.append(exc)

    threads = [threading.Thread(target=open_one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    engine = make_engine(resolve_database(db_url))
    try:
        assert current_revision(engine) == head_revision()
    finally:
        engine.dispose()


def test_postgresql_schema_comes_from_the_url(pg_url: str, stores: StoreFactory) -> None:
    schema = pg_url.rsplit("%3D", 1)[1]
    stores(pg_url)
    engine = make_engine(resolve_database(pg_url))
    try:
        assert "api_keys" in sa.inspect(engine).get_table_names(schema=schema)
        assert "api_keys" not in sa.inspect(engine).get_table_names(schema="public")
    finally:
        engine.dispose()


def test_sqlite_file_and_folder_are_created_in_wal_mode(
    sqlite_url: str, stores: StoreFactory
) -> None:
    store = stores(sqlite_url)
    path = store.db.sqlite_path
    assert path.is_file()
    engine = make_engine(resolve_database(sqlite_url))
    try:
        with engine.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
    finally:
        engine.dispose()


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("sqlite://", "in-memory SQLite"),
        ("sqlite:///:memory:", "in-memory SQLite"),
        ("mysql://u@h/db", "unsupported database 'mysql'"),
        ("not a url", "cannot read the database URL"),
    ],
)
def test_bad_urls_say_what_works(url: str, problem: str) -> None:
    with pytest.raises(DatabaseError, match=problem) as info:
        open_store(url)
    assert "SHOAL_DATABASE_URL" in str(info.value)


def test_unreachable_postgresql_is_a_clear_error_without_the_password() -> None:
    with pytest.raises(DatabaseError) as info:
        open_store("postgresql://shoal:hunter2secret@127.0.0.1:1/shoal")
    text = str(info.value)
    assert "cannot open the key database" in text and "127.0.0.1:1" in text
    assert "hunter2secret" not in text
