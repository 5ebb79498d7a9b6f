"""BoundedConnectionPool against a real Redis: bursts queue within the bound, a full pool
times out cleanly, a woken-then-cancelled waiter strands nobody, dropped connections
are replaced."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from shared.connections.connect import connect
from shared.connections.pool import BoundedConnectionPool
from tests.conftest import REAL_REDIS_URL, _require_real_redis
from tests.waiting import eventually

pytestmark = pytest.mark.redis


@pytest.fixture
async def small_pool() -> AsyncIterator[BoundedConnectionPool]:
    _require_real_redis(REAL_REDIS_URL)
    pool = BoundedConnectionPool.from_url(REAL_REDIS_URL, max_connections=4, timeout=5.0)
    try:
        yield pool
    finally:
        await pool.disconnect()


async def test_a_burst_larger_than_the_pool_queues_and_every_command_succeeds(
    small_pool: BoundedConnectionPool,
) -> None:
    client = aioredis.Redis.from_pool(small_pool)
    most_in_use = most_waiting = 0

    async def one(n: int) -> object:
        nonlocal most_in_use, most_waiting
        result = await client.incr("conveyor:test:pool:count")
        most_in_use = max(most_in_use, len(small_pool._in_use_connections))
        most_waiting = max(most_waiting, small_pool.waiting())
        return result

    results = await asyncio.gather(*(one(n) for n in range(200)))
    assert sorted(results) == list(range(1, 201))  # type: ignore[type-var]
    assert most_in_use <= 4
    assert most_waiting > 0  # the burst did queue
    assert len(small_pool._in_use_connections) == 0
    assert small_pool.waiting() == 0
    await client.delete("conveyor:test:pool:count")


async def test_a_command_that_finds_every_connection_busy_for_too_long_fails_cleanly() -> None:
    _require_real_redis(REAL_REDIS_URL)
    pool = BoundedConnectionPool.from_url(REAL_REDIS_URL, max_connections=1, timeout=0.2)
    client = aioredis.Redis.from_pool(pool)
    try:
        holder = asyncio.create_task(client.blpop(["conveyor:test:pool:hold"], timeout=1))
        await asyncio.sleep(0.05)
        with pytest.raises(RedisConnectionError, match="no Redis connection free"):
            await client.ping()
        assert await holder is None
        assert await client.ping()  # the pool works again once the connection is back
    finally:
        await client.aclose()


async def test_a_waiter_woken_then_cancelled_passes_the_connection_on(
    small_pool: BoundedConnectionPool,
) -> None:
    held = [await small_pool.get_connection() for _ in range(4)]
    first = asyncio.create_task(small_pool.get_connection())
    second = asyncio.create_task(small_pool.get_connection())

    async def both_waiting() -> bool:
        return small_pool.waiting() == 2

    await eventually(both_waiting, what="two callers waiting for a connection")
    await small_pool.release(held.pop())  # wakes `first` ...
    first.cancel()  # ... which is cancelled before it runs
    connection = await asyncio.wait_for(second, timeout=2)
    with pytest.raises(asyncio.CancelledError):
        await first
    for other in [*held, connection]:
        await small_pool.release(other)


async def test_a_connection_killed_by_the_server_is_replaced() -> None:
    _require_real_redis(REAL_REDIS_URL)
    client = connect(REAL_REDIS_URL)
    admin = aioredis.Redis.from_url(REAL_REDIS_URL)
    try:
        own_id = await client.client_id()
        await admin.client_kill_filter(_id=own_id)
        assert await client.ping()
        assert await client.client_id() != own_id
    finally:
        await client.aclose()
        await admin.aclose()
