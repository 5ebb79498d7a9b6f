"""One way to open a Redis connection, with timeouts the stream readers rely on."""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.redis_pool import BoundedConnectionPool

SOCKET_TIMEOUT_S = 10.0
"""Blocking stream reads use at most half of this (see DESIGN.md section 3)."""

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
    pool = BoundedConnectionPool.from_url(
        url,
        max_connections=max_connections,
        timeout=SOCKET_TIMEOUT_S,
        socket_timeout=SOCKET_TIMEOUT_S,
        socket_connect_timeout=3.0,
        health_check_interval=15,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries=3),
        retry_on_error=[RedisConnectionError, RedisTimeoutError],
    )
    return aioredis.Redis.from_pool(pool)
