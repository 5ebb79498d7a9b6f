"""The worker heartbeat thread against the real Redis: it beats through event-loop stalls,
stops when the loop has been stuck too long, and never beats after it was stopped.

The ``time.sleep`` calls block the event loop on purpose (that is the scenario); every
wait for the heartbeat itself polls what it did, not a clock."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
import redis

from shared.queue import names
from shared.queue.liveness import HeartbeatThread
from tests.conftest import REAL_REDIS_URL, _require_real_redis
from tests.waiting import eventually

pytestmark = pytest.mark.redis


@pytest.fixture
def client() -> redis.Redis:
    _require_real_redis(REAL_REDIS_URL)
    return redis.Redis.from_url(REAL_REDIS_URL)


async def beaten(beater: HeartbeatThread, times: int = 1) -> None:
    async def enough() -> bool:
        return beater.beats >= times

    await eventually(enough, what=f"{times} heartbeat(s)")


async def test_beats_through_a_blocked_event_loop(client: redis.Redis) -> None:
    worker_id = f"test-heartbeat-{uuid.uuid4().hex}"
    key = names.worker_heartbeat(worker_id)
    beater = HeartbeatThread(REAL_REDIS_URL, worker_id, ttl_s=0.4, payload=lambda: b"alive")
    task = asyncio.create_task(beater.run())
    await beaten(beater)
    # The loop is stuck (on purpose) for three TTLs: the thread keeps the key alive.
    before = beater.beats
    time.sleep(1.2)  # noqa: ASYNC251
    assert client.get(key) == b"alive"
    assert beater.beats > before
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert not beater.beating()  # joined before run() returned: no beat can land later
    client.delete(key)
    assert client.get(key) is None


async def test_a_hung_loop_stops_the_beat(client: redis.Redis) -> None:
    worker_id = f"test-heartbeat-{uuid.uuid4().hex}"
    key = names.worker_heartbeat(worker_id)
    beater = HeartbeatThread(
        REAL_REDIS_URL, worker_id, ttl_s=0.4, payload=lambda: b"alive", loop_stall_limit_s=0.5
    )
    task = asyncio.create_task(beater.run())

    async def alive() -> bool:  # a loaded box may stall the loop itself between two beats
        return client.get(key) == b"alive"

    await eventually(alive, what="the key written by a beat")
    # Stuck (on purpose) past the stall limit plus a TTL: the key has expired.
    time.sleep(1.5)  # noqa: ASYNC251
    assert client.get(key) is None
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def test_a_redis_stall_is_noticed_but_a_busy_loop_is_not(client: redis.Redis) -> None:
    worker_id = f"test-heartbeat-{uuid.uuid4().hex}"
    key = names.worker_heartbeat(worker_id)
    beater = HeartbeatThread(REAL_REDIS_URL, worker_id, ttl_s=0.4, payload=lambda: b"alive")
    task = asyncio.create_task(beater.run())
    try:
        await beaten(beater)
        time.sleep(1.0)  # noqa: ASYNC251 (a starved event loop, on purpose)
        assert not beater.redis_stalled(within_s=2.0)
        client.client_pause(1200)  # Redis answers no other client for 1.2 s

        async def stalled() -> bool:
            return beater.redis_stalled(within_s=2.0)

        await eventually(stalled, timeout_s=1.1, what="a beat that hangs on the paused Redis")
        paused_at = beater.beats
        await beaten(beater, paused_at + 1)  # the hung beat landed once Redis answered
        assert beater.redis_stalled(within_s=2.0)  # and it was slow, a moment ago
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        client.delete(key)
