"""API keys (inference, worker, admin) and usage, in SQLite or PostgreSQL.

``open_store(url)`` gives a migrated, ready ``KeyStore``; ``ensure_bootstrap_keys`` makes the
first admin and inference keys for ``shoal up``.
"""

from typing import TYPE_CHECKING, Any

from shoal.keys.errors import AmbiguousKey, DatabaseError, KeyStoreError, RevokedKey, UnknownKey
from shoal.keys.records import (
    KeyLimits,
    KeyRecord,
    Priority,
    Queueing,
    Scope,
    UsageRow,
    parse_rate,
)

if TYPE_CHECKING:
    from shoal.keys.store import KeyStore, ensure_bootstrap_keys, open_store


def __getattr__(name: str) -> Any:
    """The store and what opens it, imported on first use: SQLAlchemy, Alembic and psycopg
    cost a second of start-up that ``shoal worker`` and ``shoal --help`` never need."""
    if name in _FROM_STORE:
        from shoal.keys import store

        return getattr(store, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_FROM_STORE = frozenset({"KeyStore", "ensure_bootstrap_keys", "open_store"})

__all__ = [
    "AmbiguousKey",
    "DatabaseError",
    "KeyLimits",
    "KeyRecord",
    "KeyStore",
    "KeyStoreError",
    "Priority",
    "Queueing",
    "RevokedKey",
    "Scope",
    "UnknownKey",
    "UsageRow",
    "ensure_bootstrap_keys",
    "open_store",
    "parse_rate",
]
