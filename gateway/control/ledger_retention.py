"""Retention of old usage rows: once an interval, one gateway deletes the ledger rows
received more than ``usage_retention_days`` ago (0 keeps everything).

A plain task in the gateway, not an arq job: arq 0.28 pins redis-py below 6 (Conveyor
runs redis-py 8) and needs its own worker process polling a sorted set, while an hourly
DELETE needs only a lock so that one gateway of the fleet runs it: ``SET NX`` with the
interval as TTL, never released, so the fleet purges at most once per interval.
Budget periods need no roll-over job either: a budget counter is a Redis key named by
its period, which expires by itself.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime, timedelta

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.control.ledger import DATABASE_ERRORS
from gateway.db import usage_repo
from shared.queue import names

log = logging.getLogger(__name__)

RETENTION_INTERVAL_S = 3600.0


async def purge_once(
    redis: aioredis.Redis,
    sessions: async_sessionmaker[AsyncSession],
    retention_days: int,
    *,
    interval_s: float = RETENTION_INTERVAL_S,
    now: datetime | None = None,
) -> int | None:
    """Delete expired rows unless another gateway did this interval (then None)."""
    taken = await redis.set(names.LEDGER_RETENTION_LOCK, b"1", nx=True, px=int(interval_s * 1000))
    if not taken:
        return None
    cutoff = (now or datetime.now(UTC)) - timedelta(days=retention_days)
    try:
        async with sessions.begin() as session:
            deleted = await usage_repo.delete_received_before(session, cutoff)
    except DATABASE_ERRORS:
        await redis.delete(names.LEDGER_RETENTION_LOCK)  # let a gateway try again soon
        raise
    log.info("ledger retention: deleted %d usage rows received before %s", deleted, cutoff)
    return deleted


async def retention_loop(
    redis: aioredis.Redis,
    sessions: async_sessionmaker[AsyncSession],
    retention_days: int,
    *,
    interval_s: float = RETENTION_INTERVAL_S,
) -> None:
    if retention_days <= 0:
        return
    while True:
        try:
            await purge_once(redis, sessions, retention_days, interval_s=interval_s)
        except (RedisError, *DATABASE_ERRORS) as exc:
            log.warning("ledger retention: skipped this round: %s", exc)
        await asyncio.sleep(min(interval_s, 300.0))
