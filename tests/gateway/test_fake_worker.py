"""The fake worker stops cleanly: a test that stops it to keep jobs queued finds them
all still waiting (none delivered to a consumer that never answers)."""

from __future__ import annotations

import asyncio

from fakeredis.aioredis import FakeRedis

from shared.queue.job_queue import JobStream
from shared.queue.names import JOB_GROUP
from shared.roles import Role
from tests.gateway.fake_worker import FakeWorker, echo


async def test_a_stopped_worker_takes_no_job_queued_right_after() -> None:
    redis = FakeRedis()
    stream = JobStream("tiny", Role.AGGREGATED).name
    worker = FakeWorker(redis, "tiny", Role.AGGREGATED, echo)
    await worker.start()
    await asyncio.sleep(0.005)  # inside a blocking read
    await worker.stop()
    await redis.xadd(stream, {"v": "1", "m": b""})  # within the read's block window
    await asyncio.sleep(0.05)  # past it
    [group] = await redis.xinfo_groups(stream)
    assert (group["name"], group["pending"]) == (JOB_GROUP.encode(), 0)
    await redis.aclose()
