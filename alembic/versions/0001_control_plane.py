"""Control plane: API keys and the usage ledger.

Revision ID: 0001
Revises:
Create Date: 2025-06-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "api_keys",
        sa.Column("id", sa.String(length=32), nullable=False),
        sa.Column("name", sa.String(length=200), nullable=False),
        sa.Column("secret_hash", sa.String(length=64), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("suffix", sa.String(length=8), nullable=False),
        sa.Column("scopes", sa.JSON(), nullable=False),
        sa.Column("models", sa.JSON(), nullable=True),
        sa.Column("rpm", sa.BigInteger(), nullable=True),
        sa.Column("tpm", sa.BigInteger(), nullable=True),
        sa.Column("max_concurrent", sa.Integer(), nullable=True),
        sa.Column("budget_tokens", sa.BigInteger(), nullable=True),
        sa.Column("budget_period", sa.String(length=8), nullable=True),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "budget_period IN ('day', 'month')", name=op.f("ck_api_keys_budget_period")
        ),
        sa.CheckConstraint(
            "(budget_tokens IS NULL) = (budget_period IS NULL)",
            name=op.f("ck_api_keys_budget_complete"),
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("secret_hash", name=op.f("uq_api_keys_secret_hash")),
    )
    op.create_index(op.f("ix_api_keys_name"), "api_keys", ["name"])

    op.create_table(
        "usage_records",
        sa.Column("request_id", sa.String(length=64), nullable=False),
        sa.Column("key_id", sa.String(length=32), nullable=True),
        sa.Column("model", sa.String(length=200), nullable=False),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("cached_prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("n", sa.Integer(), nullable=False),
        sa.Column("finish_reason", sa.String(length=64), nullable=True),
        sa.Column("status", sa.String(length=16), nullable=False),
        sa.Column("migrations", sa.Integer(), nullable=False),
        sa.Column("received_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("first_token_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("recorded_at", sa.DateTime(timezone=True), nullable=False),
        sa.CheckConstraint(
            "status IN ('completed', 'cancelled', 'failed')", name=op.f("ck_usage_records_status")
        ),
        sa.PrimaryKeyConstraint("request_id", name=op.f("pk_usage_records")),
    )
    op.create_index(
        "ix_usage_records_key_id_received_at", "usage_records", ["key_id", "received_at"]
    )
    op.create_index(
        "ix_usage_records_model_received_at", "usage_records", ["model", "received_at"]
    )
    op.create_index(op.f("ix_usage_records_received_at"), "usage_records", ["received_at"])


def downgrade() -> None:
    op.drop_index(op.f("ix_usage_records_received_at"), table_name="usage_records")
    op.drop_index("ix_usage_records_model_received_at", table_name="usage_records")
    op.drop_index("ix_usage_records_key_id_received_at", table_name="usage_records")
    op.drop_table("usage_records")
    op.drop_index(op.f("ix_api_keys_name"), table_name="api_keys")
    op.drop_table("api_keys")
