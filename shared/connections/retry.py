"""Riding out a Redis outage: the one backoff rule every retrying call and loop uses.

A restart of Redis takes about a second, a ``DEBUG SLEEP`` stall a few. Calls that
must land (a journal write, an admission, a cancel) go through :func:`retry`, which
tries again with :class:`Backoff` for a bounded time and then raises. Loops that run
for the life of the process (reading a job or reply stream, the command channel)
keep one :class:`Backoff` and wait on it after each failure, resetting it after a
success.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

from redis.exceptions import RedisError

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(slots=True)
class Backoff:
    """Delays that start at ``first_s`` and double up to ``max_s`` (equal: a fixed pause)."""

    first_s: float
    max_s: float
    _next_s: float = field(init=False)

    def __post_init__(self) -> None:
        self._next_s = self.first_s

    def next_delay(self) -> float:
        delay = self._next_s
        self._next_s = min(delay * 2, self.max_s)
        return delay

    def reset(self) -> None:
        self._next_s = self.first_s

    async def wait(self) -> float:
        """Sleep the next delay; returns it."""
        delay = self.next_delay()
        await asyncio.sleep(delay)
        return delay


async def retry(
    call: Callable[[], Awaitable[T]],
    *,
    for_s: float,
    backoff: Backoff,
    what: str,
    retry_on: tuple[type[BaseException], ...] = (RedisError,),
) -> T:
    """``call()`` until it succeeds. A failure in ``retry_on`` is tried again after the next
    backoff delay, for ``for_s`` (the last try comes at that deadline); then it is raised."""
    deadline = time.monotonic() + for_s
    while True:
        try:
            return await call()
        except retry_on as exc:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise
            delay = min(backoff.next_delay(), remaining)
            log.warning("%s failed (%s); retrying in %.2fs", what, exc, delay)
            await asyncio.sleep(delay)
