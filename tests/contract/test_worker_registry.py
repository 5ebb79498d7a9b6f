"""The worker registry (shared/queue/liveness.py) on fakeredis and the real Redis: gateways
find the workers through the set the heartbeats keep, never by scanning the keyspace."""

from __future__ import annotations

import redis.asyncio as aioredis

from shared.queue import names
from shared.queue.liveness import WorkerRegistration, WorkerRegistry
from shared.roles import Role


async def test_the_registry_is_read_through_the_worker_set_not_the_keyspace(
    redis_backend: aioredis.Redis,
) -> None:
    registry = WorkerRegistry(redis_backend, ttl_s=60)
    for worker_id in ("aggregated-h-1-a", "aggregated-h-2-b"):
        await registry.beat(
            WorkerRegistration(
                worker_id=worker_id,
                role=Role.AGGREGATED,
                model="m",
                max_model_len=8,
                active=0,
                slots=1,
            )
        )
    await redis_backend.set(names.worker_heartbeat("aggregated-h-3-c"), b"{}")  # never beat
    assert sorted(w.worker_id for w in await registry.live_workers()) == [
        "aggregated-h-1-a",
        "aggregated-h-2-b",
    ]
    # a key that expired (or was deleted) is not a live worker, listed or not
    await redis_backend.delete(names.worker_heartbeat("aggregated-h-1-a"))
    assert [w.worker_id for w in await registry.live_workers()] == ["aggregated-h-2-b"]
    # long gone: the set forgets it
    await redis_backend.zadd(names.WORKER_SET, {"aggregated-h-1-a": 0})
    await registry.live_workers()
    assert await redis_backend.zrange(names.WORKER_SET, 0, -1) == [b"aggregated-h-2-b"]
    await registry.remove("aggregated-h-2-b")
    assert await registry.live_workers() == []
    assert await redis_backend.zcard(names.WORKER_SET) == 0
