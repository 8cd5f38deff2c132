"""API keys and hourly usage per key and model.

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(32), primary_key=True),
        sa.Column("name", sa.String(200), nullable=True),
        sa.Column("scope", sa.String(16), nullable=False),
        sa.Column("prefix", sa.String(32), nullable=False),
        sa.Column("hash", sa.String(64), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("requests_per_min", sa.Integer(), nullable=True),
        sa.Column("tokens_per_min", sa.Integer(), nullable=True),
        sa.Column("max_streams", sa.Integer(), nullable=True),
        sa.CheckConstraint("scope IN ('inference', 'worker', 'admin')", name="ck_api_keys_scope"),
        sa.UniqueConstraint("hash", name="uq_api_keys_hash"),
    )
    op.create_index("ix_api_keys_prefix", "api_keys", ["prefix"])
    op.create_table(
        "usage",
        sa.Column("key_id", sa.String(32), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("period_start", sa.DateTime(timezone=True), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("tokens_in", sa.BigInteger(), nullable=False, server_default="0"),
        sa.Column("tokens_out", sa.BigInteger(), nullable=False, server_default="0"),
        sa.ForeignKeyConstraint(
            ["key_id"], ["api_keys.id"], name="fk_usage_key_id", ondelete="CASCADE"
        ),
        sa.PrimaryKeyConstraint("key_id", "model", "period_start", name="pk_usage"),
    )
    op.create_index("ix_usage_period_start", "usage", ["period_start"])


def downgrade() -> None:
    op.drop_index("ix_usage_period_start", table_name="usage")
    op.drop_table("usage")
    op.drop_index("ix_api_keys_prefix", table_name="api_keys")
    op.drop_table("api_keys")
