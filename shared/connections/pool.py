"""A bounded Redis connection pool whose common path costs next to nothing.

Past ``max_connections`` a command must wait for a free connection instead of failing
with "Too many connections" (a burst must queue, never drop work). redis-py's
``BlockingConnectionPool`` does that, but takes an ``asyncio.Condition``, a timeout
scope and its observability hooks on every command, both ways. This pool takes a free
connection with no await at all and waits, on a future, only when every connection is
in use: redis-py's whole client CPU per ``GET`` drops by about a third (measured with
``python -m bench.redis_pool``; docs/benchmarks.md).

It leaves out what Conveyor does not use: redis-py's connection-count metrics, the
after-release event (streaming credential re-auth) and maintenance-mode locking.
It relies on ``ConnectionPool``'s ``get_available_connection`` / ``ensure_connection``
and its two connection collections (redis-py 8, pinned in pyproject.toml); the
contract tests in tests/contract/test_redis_pool.py run it against a real Redis.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError


class BoundedConnectionPool(aioredis.ConnectionPool):
    def __init__(self, *, timeout: float = 10.0, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.timeout = timeout
        """Seconds a command waits for a free connection before it fails."""
        self._waiters: deque[asyncio.Future[None]] = deque()

    async def get_connection(self, command_name: Any = None, *keys: Any, **options: Any) -> Any:
        connection = await self._take()
        try:
            await self.ensure_connection(connection)
        except BaseException:
            await self.release(connection)
            raise
        return connection

    async def _take(self) -> Any:
        try:
            return self.get_available_connection()  # type: ignore[no-untyped-call]
        except MaxConnectionsError:
            pass
        deadline = asyncio.get_running_loop().time() + self.timeout
        while True:
            freed = asyncio.get_running_loop().create_future()
            self._waiters.append(freed)
            left = deadline - asyncio.get_running_loop().time()
            try:
                async with asyncio.timeout(max(left, 0.0)):
                    await freed
            except TimeoutError:
                self._pass_on_wake(freed)
                raise RedisConnectionError(
                    f"no Redis connection free for {self.timeout:.0f}s "
                    f"(all {self.max_connections} in use)"
                ) from None
            except asyncio.CancelledError:
                self._pass_on_wake(freed)
                raise
            try:
                return self.get_available_connection()  # type: ignore[no-untyped-call]
            except MaxConnectionsError:
                continue  # another caller took it first: wait again

    async def release(self, connection: AbstractConnection) -> None:
        self._in_use_connections.remove(connection)
        if connection.should_reconnect():  # type: ignore[no-untyped-call]
            await connection.disconnect()
        self._available_connections.append(connection)
        self._wake_one()

    def _pass_on_wake(self, freed: asyncio.Future[None]) -> None:
        """A waiter woken but leaving anyway (cancelled, timed out) hands its turn on."""
        if freed.done() and not freed.cancelled():
            self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def waiting(self) -> int:
        """Callers waiting for a connection now."""
        return sum(1 for waiter in self._waiters if not waiter.done())
