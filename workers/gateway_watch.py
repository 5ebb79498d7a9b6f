"""Which gateways are gone, so their jobs can be dropped or aborted.

A gateway keeps a liveness key with a TTL. A missing key alone is not proof the
gateway died: a gateway whose event loop stalled for a moment, or a Redis that
restarted, leaves it missing while the gateway still waits for tokens, and
dropping that gateway's jobs would hang its clients. So a gateway counts as
gone only after this worker has seen its key missing, on every check, for a
whole grace period (the gateway's TTL: a live gateway rewrites its key several
times within it).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping

import redis.asyncio as aioredis

from shared import keys

FORGET_AFTER_S = 3600.0


class GatewayWatch:
    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        grace_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._redis = redis
        self._grace_s = grace_s
        self._clock = clock
        self._missing_since: dict[str, float] = {}

    async def gone(self, gateways: Iterable[str]) -> set[str]:
        ordered = sorted(set(gateways))
        if not ordered:
            return set()
        async with self._redis.pipeline(transaction=False) as pipe:
            for gateway in ordered:
                pipe.exists(keys.gateway_heartbeat(gateway))
            alive = await pipe.execute()
        return self.observe(dict(zip(ordered, map(bool, alive), strict=True)))

    def observe(self, alive: Mapping[str, bool]) -> set[str]:
        """Record one check of each gateway's key; return the gateways gone for good."""
        now = self._clock()
        gone = set()
        for gateway, is_alive in alive.items():
            if is_alive:
                self._missing_since.pop(gateway, None)
                continue
            since = self._missing_since.setdefault(gateway, now)
            if now - since >= self._grace_s:
                gone.add(gateway)
        self._forget_long_dead(now)
        return gone

    def _forget_long_dead(self, now: float) -> None:
        stale = [g for g, since in self._missing_since.items() if now - since > FORGET_AFTER_S]
        for gateway in stale:
            del self._missing_since[gateway]
