"""Alembic migrations of Shoal's key database; run by ``shoal.keys.migrate.upgrade``."""
