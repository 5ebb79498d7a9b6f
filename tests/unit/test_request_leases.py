"""The lease of a resumable request (shared/queue/liveness.py) on fake and real Redis: a
holder renews its own, never another's; a lapsed lease is taken once; a released one is
gone, which is what workers and the orphan-usage sweep read as "its gateway is gone"."""

from __future__ import annotations

import redis.asyncio as aioredis

from shared.queue import names
from shared.queue.liveness import hold_request, release_request, take_request


async def test_a_lease_has_one_holder(redis_backend: aioredis.Redis) -> None:
    key = names.gateway_heartbeat(names.request_holder("chatcmpl-1"))
    assert await hold_request(redis_backend, "chatcmpl-1", "gw-a", 5.0)
    assert await hold_request(redis_backend, "chatcmpl-1", "gw-a", 5.0)  # renewed
    assert not await hold_request(redis_backend, "chatcmpl-1", "gw-b", 5.0)
    assert not await take_request(redis_backend, "chatcmpl-1", "gw-b", 5.0)
    assert await redis_backend.get(key) == b"gw-a"
    await release_request(redis_backend, "chatcmpl-1")
    assert not await redis_backend.exists(key)
    assert await take_request(redis_backend, "chatcmpl-1", "gw-b", 5.0)
    assert not await take_request(redis_backend, "chatcmpl-1", "gw-c", 5.0)
    assert not await hold_request(redis_backend, "chatcmpl-1", "gw-a", 5.0)
    assert 0 < await redis_backend.pttl(key) <= 5000


def test_a_resumable_requests_stream_names_its_holder() -> None:
    stream = names.reply_stream(names.request_holder("chatcmpl-9"))
    assert names.gateway_of_reply_stream(stream) == "r-chatcmpl-9"
