"""One way to open a Redis connection, with timeouts the stream readers rely on.

The URL is a plain Redis or a Sentinel-watched master (shared/connections/url.py); both get
the same bounded pool (shared/connections/pool.py), whose connections pack commands with
hiredis (shared/connections/packing.py).
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import SentinelConnectionPool
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.connections.packing import packing
from shared.connections.pool import BoundedConnectionPool
from shared.connections.url import (
    AsyncSentinelMaster,
    async_sentinel,
    is_sentinel_url,
    parse_sentinel_url,
)

SOCKET_TIMEOUT_S = 10.0
"""Blocking stream reads use at most half of this (see DESIGN.md section 3)."""

CONNECT_TIMEOUT_S = 3.0

SENTINEL_TIMEOUT_S = 1.0
"""Per Sentinel asked where the master is (redis-py asks them in turn until one knows)."""

MAX_BLOCK_MS = int(SOCKET_TIMEOUT_S * 1000 / 2)

MAX_CONNECTIONS = 256
"""Connections one process opens to Redis at most. Past it a command waits for a free
connection (up to ``SOCKET_TIMEOUT_S``) instead of failing with "Too many connections":
a burst must queue, never drop work on the floor."""


def as_text(value: bytes | str) -> str:
    """Redis replies are bytes (no decode_responses): names and ids as str."""
    return value.decode() if isinstance(value, bytes) else value


def db_of(redis: aioredis.Redis) -> int:
    return int(redis.connection_pool.connection_kwargs.get("db", 0) or 0)


def connect(url: str, *, max_connections: int = MAX_CONNECTIONS) -> aioredis.Redis:
    if is_sentinel_url(url):
        return _connect_sentinel(url, max_connections)
    pool = BoundedConnectionPool.from_url(url, **_pool_kwargs(max_connections))
    pool.connection_class = packing(pool.connection_class)
    return aioredis.Redis.from_pool(pool)


def _pool_kwargs(max_connections: int) -> dict[str, Any]:
    return {
        "max_connections": max_connections,
        "timeout": SOCKET_TIMEOUT_S,
        "socket_timeout": SOCKET_TIMEOUT_S,
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        "health_check_interval": 15,
        "retry": Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=3),
        "retry_on_error": [RedisConnectionError, RedisTimeoutError],
    }


class BoundedSentinelConnectionPool(SentinelConnectionPool, BoundedConnectionPool):
    """Sentinel's pool (asks where the master is on each new connection) with the bounded
    pool's bound: past ``max_connections`` a command waits for a free connection."""


def _connect_sentinel(url: str, max_connections: int) -> aioredis.Redis:
    parsed = parse_sentinel_url(url)
    sentinel = async_sentinel(
        parsed, timeout_s=SENTINEL_TIMEOUT_S, connect_timeout_s=SENTINEL_TIMEOUT_S
    )
    client: aioredis.Redis = sentinel.master_for(
        parsed.service_name,
        redis_class=AsyncSentinelMaster,
        connection_pool_class=BoundedSentinelConnectionPool,
        **_pool_kwargs(max_connections),
        **parsed.node_kwargs(),
    )
    pool = client.connection_pool
    pool.connection_class = packing(pool.connection_class)
    return client
