"""How fast each job stream drains, so a 429's Retry-After says when room will appear."""

from __future__ import annotations

import asyncio
import logging
import math
import time

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.queue import names

log = logging.getLogger(__name__)


class DrainMeter:
    """Samples each stream's completed-jobs counter; keeps a smoothed jobs/s rate."""

    def __init__(self, redis: aioredis.Redis, *, interval_s: float = 1.0) -> None:
        self._redis = redis
        self._interval_s = interval_s
        self._streams: set[str] = set()
        self._last: dict[str, tuple[float, int]] = {}
        self.rate_per_s: dict[str, float] = {}

    def watch(self, stream: str) -> None:
        self._streams.add(stream)

    async def run(self) -> None:
        while True:
            try:
                await self.sample()
            except RedisError as exc:
                log.debug("drain sample failed: %s", exc)
            await asyncio.sleep(self._interval_s)

    async def sample(self) -> None:
        for stream in list(self._streams):
            done = int(await self._redis.get(names.stream_done_counter(stream)) or 0)
            now = time.monotonic()
            previous = self._last.get(stream)
            self._last[stream] = (now, done)
            if previous is None or now <= previous[0]:
                continue
            instant = max(0, done - previous[1]) / (now - previous[0])
            old = self.rate_per_s.get(stream, instant)
            self.rate_per_s[stream] = 0.7 * old + 0.3 * instant

    def retry_after_s(self, stream: str, excess_jobs: int) -> int:
        """Seconds until ``excess_jobs`` have drained at the observed rate (1..60)."""
        rate = self.rate_per_s.get(stream, 0.0)
        if rate <= 0:
            return 5
        return max(1, min(60, math.ceil(excess_jobs / rate)))
