"""LoRA adapter registry.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-25
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa

from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "lora_adapters",
        sa.Column("name", sa.String(length=128), nullable=False),
        sa.Column("path", sa.String(length=4096), nullable=False),
        sa.Column("base_model", sa.String(length=200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_lora_adapters")),
    )
    op.create_index(
        op.f("ix_lora_adapters_base_model"), "lora_adapters", ["base_model"], unique=False
    )


def downgrade() -> None:
    op.drop_index(op.f("ix_lora_adapters_base_model"), table_name="lora_adapters")
    op.drop_table("lora_adapters")
