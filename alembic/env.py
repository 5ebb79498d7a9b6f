"""Alembic environment for Conveyor's control-plane database.

Two ways in:
- from Conveyor (``gateway.db.schema``, the ``conveyor db`` CLI, the gateway's start-up):
  a connection arrives in ``config.attributes["connection"]`` and is used as is;
- plain ``alembic`` on the command line: the URL comes from ``-x url=...``, else
  CONVEYOR_DATABASE_URL (else the embedded SQLite file), and an async engine is opened.
"""

from __future__ import annotations

import asyncio
from logging.config import fileConfig
from typing import Any, Literal

from alembic import context
from sqlalchemy.engine import Connection

from gateway.db.engine import normalize_url, open_database
from gateway.db.models import Base, UtcDateTime

config = context.config
target_metadata = Base.metadata


def _url() -> str:
    url = context.get_x_argument(as_dictionary=True).get("url")
    if url:
        return url
    from shared.settings import Settings

    return Settings().database_url_or_default()


def _render_item(type_: str, obj: Any, _autogen_context: Any) -> str | Literal[False]:
    """Migrations must not import the models: write UtcDateTime as the column type it is."""
    if type_ == "type" and isinstance(obj, UtcDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def _configure(connection: Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        render_as_batch=True,  # SQLite cannot ALTER most things: later migrations copy tables
        render_item=_render_item,
        compare_type=True,
    )


MIGRATION_LOCK_ID = 0x636F6E76  # "conv"


def _run_on(connection: Connection) -> None:
    """Migrate in the connection's transaction. Two processes migrating one database take
    turns: SQLite's transactions begin IMMEDIATE (gateway/db/engine.py), PostgreSQL takes a
    transaction-scoped advisory lock; the second then finds the schema at head."""
    if connection.dialect.name == "postgresql":
        connection.exec_driver_sql(f"SELECT pg_advisory_xact_lock({MIGRATION_LOCK_ID})")
    _configure(connection)
    with context.begin_transaction():
        context.run_migrations()


async def _run_online() -> None:
    database = open_database(_url())
    try:
        async with database.engine.begin() as connection:
            await connection.run_sync(_run_on)
    finally:
        await database.dispose()


def _run_offline() -> None:
    context.configure(
        url=normalize_url(_url()).render_as_string(hide_password=False),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
        render_item=_render_item,
    )
    with context.begin_transaction():
        context.run_migrations()


if config.config_file_name is not None and "connection" not in config.attributes:
    fileConfig(config.config_file_name, disable_existing_loggers=False)

if context.is_offline_mode():
    _run_offline()
elif (given := config.attributes.get("connection")) is not None:
    _run_on(given)
else:
    asyncio.run(_run_online())
