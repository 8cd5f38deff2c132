"""Alembic's environment for Shoal's key database.

Shoal runs this through ``shoal.keys.migrate.upgrade``, which hands over a connection that is
already inside a transaction holding the migration lock; there is no alembic.ini. Offline mode
(``alembic upgrade --sql``) renders SQL for the URL in the ``sqlalchemy.url`` option.
"""

from __future__ import annotations

from alembic import context

from shoal.keys.migrate import VERSION_TABLE
from shoal.keys.tables import metadata


def run_offline() -> None:
    context.configure(
        url=context.config.get_main_option("sqlalchemy.url"),
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        literal_binds=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is None:
        raise RuntimeError(
            "run Shoal's migrations with shoal.keys.migrate.upgrade(engine), which passes a "
            "locked connection; there is no alembic.ini to take a URL from"
        )
    context.configure(
        connection=connection,
        target_metadata=metadata,
        version_table=VERSION_TABLE,
        render_as_batch=True,  # SQLite alters tables by copying them; batch mode does that
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
