"""What every admin command opens: the SQL database at its schema's head, and a Redis
client to announce changes to the gateways; and the one error a command stops with."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import redis.asyncio as aioredis

from gateway.db import schema
from gateway.db.engine import Database, open_database
from shared.connections.url import async_client
from shared.settings import Settings


class CliError(Exception):
    """A command cannot go on; the message says why and what to do."""


@contextlib.asynccontextmanager
async def open_control(
    settings: Settings, *, redis_needed: bool = True
) -> AsyncIterator[tuple[Database, aioredis.Redis | None]]:
    """The database, at head (the embedded one is migrated, an external one must be), and a
    Redis client for announcing key changes."""
    database = open_database(settings.database_url_or_default())
    redis = (
        async_client(settings.redis_url, timeout_s=2.0, connect_timeout_s=1.0)
        if redis_needed
        else None
    )
    try:
        if settings.database_is_embedded():
            await schema.upgrade_to_head(database.engine)
        status = await schema.schema_status(database.engine)
        if not status.at_head:
            raise CliError(f"{database.url}: {status.problem()}")
        yield database, redis
    finally:
        await database.dispose()
        if redis is not None:
            await redis.aclose()
