"""Stored /v1/responses answers.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "responses",
        sa.Column("id", sa.String(length=64), nullable=False),
        sa.Column("key_id", sa.String(length=64), nullable=True),
        sa.Column("previous_response_id", sa.String(length=64), nullable=True),
        sa.Column("body", sa.JSON(), nullable=False),
        sa.Column("input_items", sa.JSON(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_responses")),
    )
    op.create_index(op.f("ix_responses_key_id"), "responses", ["key_id"], unique=False)
    op.create_index(op.f("ix_responses_created_at"), "responses", ["created_at"], unique=False)


def downgrade() -> None:
    op.drop_index(op.f("ix_responses_created_at"), table_name="responses")
    op.drop_index(op.f("ix_responses_key_id"), table_name="responses")
    op.drop_table("responses")
