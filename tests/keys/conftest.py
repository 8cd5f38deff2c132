"""Real databases for the key store: a SQLite file per test, a PostgreSQL schema per test.

PostgreSQL is the machine's real server on 127.0.0.1:5432 (trust auth); each test gets its
own schema, chosen through libpq's ``options=-csearch_path`` in the URL exactly as a user
would, and the schema is dropped afterwards.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from keydb import StoreFactory

from shoal.keys import KeyStore, open_store


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'data' / 'shoal.db'}"


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request: pytest.FixtureRequest) -> str:
    name = "sqlite_url" if request.param == "sqlite" else "pg_url"
    url: str = request.getfixturevalue(name)
    return url


@pytest.fixture
def stores() -> Iterator[StoreFactory]:
    """Open stores on a URL (each migrates it); all are closed after the test."""
    opened: list[KeyStore] = []

    def make(url: str, **options: Any) -> KeyStore:
        store = open_store(url, **options)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()
