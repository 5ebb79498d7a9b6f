"""Declarative models of the control plane's tables.

Alembic's migrations (``alembic/versions``) must describe exactly these tables:
``tests/db/test_migrations.py`` runs autogenerate against a migrated database on
SQLite and PostgreSQL and fails on any difference.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    CheckConstraint,
    DateTime,
    Dialect,
    Index,
    Integer,
    MetaData,
    String,
    TypeDecorator,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class UtcDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every backend.

    PostgreSQL stores ``timestamptz``; SQLite has no time zones, so the value is stored
    as naive UTC and comes back with ``UTC`` attached. Naive values are refused on the way
    in (they would mean different instants on different machines).
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetime: pass an aware (UTC) datetime")
        value = value.astimezone(UTC)
        return value.replace(tzinfo=None) if dialect.name == "sqlite" else value

    def process_result_value(self, value: Any, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if not isinstance(value, datetime):
            raise TypeError(f"expected a datetime from the database, got {type(value)!r}")
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)


class ApiKeyRow(Base):
    """An API key. Only the SHA-256 of the secret is stored (secrets are 256-bit random,
    so a fast hash cannot be brute-forced); prefix and suffix make the masked form."""

    __tablename__ = "api_keys"
    __table_args__ = (
        CheckConstraint("budget_period IN ('day', 'month')", name="budget_period"),
        CheckConstraint(
            "(budget_tokens IS NULL) = (budget_period IS NULL)", name="budget_complete"
        ),
    )

    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    name: Mapped[str] = mapped_column(String(200), index=True)
    secret_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    suffix: Mapped[str] = mapped_column(String(8))
    scopes: Mapped[list[str]] = mapped_column(JSON)
    models: Mapped[list[str] | None] = mapped_column(JSON)
    """Models the key may use; NULL: every model."""
    rpm: Mapped[int | None] = mapped_column(BigInteger)
    tpm: Mapped[int | None] = mapped_column(BigInteger)
    max_concurrent: Mapped[int | None] = mapped_column(Integer)
    budget_tokens: Mapped[int | None] = mapped_column(BigInteger)
    budget_period: Mapped[str | None] = mapped_column(String(8))
    expires_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    revoked_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)
    updated_at: Mapped[datetime] = mapped_column(UtcDateTime)


class UsageRow(Base):
    """One request's usage. The request id is the key, so a retried or migrated request,
    or a ledger entry delivered twice, is counted once."""

    __tablename__ = "usage_records"
    __table_args__ = (
        CheckConstraint("status IN ('completed', 'cancelled', 'failed')", name="status"),
        Index("ix_usage_records_key_id_received_at", "key_id", "received_at"),
        Index("ix_usage_records_model_received_at", "model", "received_at"),
    )

    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    key_id: Mapped[str | None] = mapped_column(String(32))
    """The API key's id; NULL when auth is off; ``admin`` for CONVEYOR_ADMIN_KEY."""
    model: Mapped[str] = mapped_column(String(200))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    """Tokens delivered to the client (all choices)."""
    cached_prompt_tokens: Mapped[int | None] = mapped_column(Integer)
    """Prompt tokens served from the prefix cache, where the engine reports them."""
    n: Mapped[int] = mapped_column(Integer)
    finish_reason: Mapped[str | None] = mapped_column(String(64))
    """The choices' finish reasons, comma-separated in choice order."""
    status: Mapped[str] = mapped_column(String(16))
    migrations: Mapped[int] = mapped_column(Integer)
    received_at: Mapped[datetime] = mapped_column(UtcDateTime, index=True)
    first_token_at: Mapped[datetime | None] = mapped_column(UtcDateTime)
    finished_at: Mapped[datetime] = mapped_column(UtcDateTime)
    recorded_at: Mapped[datetime] = mapped_column(UtcDateTime)
    """When the ledger consumer wrote the row (finished_at to recorded_at = ledger delay)."""


class LoraAdapterRow(Base):
    """A registered LoRA adapter: the desired state (the gateway publishes these rows to
    Redis, shared/queue/lora_registry.py; workers of ``base_model`` load them)."""

    __tablename__ = "lora_adapters"

    name: Mapped[str] = mapped_column(String(128), primary_key=True)
    """The model name clients send for it."""
    path: Mapped[str] = mapped_column(String(4096))
    base_model: Mapped[str] = mapped_column(String(200), index=True)
    created_at: Mapped[datetime] = mapped_column(UtcDateTime)


class StoredResponseRow(Base):
    """A stored ``/v1/responses`` answer (``store``: true), with the input items it
    answered; ``previous_response_id`` chains a conversation."""

    __tablename__ = "responses"

    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    key_id: Mapped[str | None] = mapped_column(String(64), index=True)
    """The API key that created it (None: auth off); only that key (or admin) reads it."""
    previous_response_id: Mapped[str | None] = mapped_column(String(64))
    body: Mapped[dict[str, Any]] = mapped_column(JSON)
    """The response object as it was answered."""
    input_items: Mapped[list[Any]] = mapped_column(JSON)
    """This request's input items (each with an ``id``), not the earlier turns'."""
    created_at: Mapped[datetime] = mapped_column(UtcDateTime, index=True)
