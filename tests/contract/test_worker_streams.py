"""Workers' own job streams: placed admission, read-own-first, stealing, requeue.

The same tests against fakeredis and a real Redis (the steal and requeue scripts read
the consumer group's state with XINFO and read with XREADGROUP inside Lua).
"""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from shared.queue import names
from shared.queue.job_queue import Admission, JobQueue, JobStream
from shared.queue.worker_streams import Requeue, WorkerStreams
from shared.roles import Role
from tests.conftest import RedisTarget
from tests.contract.test_job_queue import make_job

POOL = JobStream("m", Role.AGGREGATED)
STEAL_MS = 40


@pytest.fixture
async def queue(redis_backend: aioredis.Redis) -> JobQueue:
    q = JobQueue(redis_backend)
    await q.ensure_group(POOL.name)
    return q


@pytest.fixture
async def streams(redis_backend: aioredis.Redis, queue: JobQueue) -> WorkerStreams:
    placed = WorkerStreams(redis_backend, queue)
    for worker in ("w1", "w2", "w3"):
        await placed.ensure_groups(POOL, worker)
    return placed


async def alive(redis: aioredis.Redis, *workers: str) -> None:
    for worker in workers:
        await redis.set(names.worker_heartbeat(worker), b"{}", px=60_000)


async def test_placed_jobs_go_to_the_workers_stream_and_count_in_the_pool_depth(
    queue: JobQueue, streams: WorkerStreams, redis_backend: aioredis.Redis
) -> None:
    await alive(redis_backend, "w1")
    placed = await queue.submit(
        POOL.name, [make_job("a", 0), make_job("a", 1)], max_depth=4, placed_on="w1"
    )
    assert placed.outcome is Admission.QUEUED
    assert placed.placed_on == "w1"
    assert placed.detail == "2"
    assert await redis_backend.xlen(POOL.own("w1").name) == 2
    assert await redis_backend.xlen(POOL.name) == 0
    assert await redis_backend.xlen(names.steal_tickets(POOL.name)) == 1

    # a worker that has left: its stream is not used, the shared one is
    gone = await queue.submit(POOL.name, [make_job("b")], max_depth=4, placed_on="w2")
    assert gone.placed_on is None
    assert await redis_backend.xlen(POOL.name) == 1

    # the cap counts the shared stream and every worker's own one
    assert await queue.depth(POOL.name) == 3
    full = await queue.submit(POOL.name, [make_job("c"), make_job("c", 1)], max_depth=4)
    assert full.outcome is Admission.FULL
    assert full.detail == "3"
    also_full = await queue.submit(
        POOL.name, [make_job("d"), make_job("d", 1)], max_depth=4, placed_on="w1"
    )
    assert also_full.outcome is Admission.FULL
    assert await redis_backend.xlen(POOL.own("w1").name) == 2


async def test_a_placed_retry_is_queued_once(
    queue: JobQueue, redis_backend: aioredis.Redis
) -> None:
    await alive(redis_backend, "w1")
    job = make_job("r")
    first = await queue.submit(POOL.name, [job], max_depth=8, placed_on="w1", idempotency_key="k")
    again = await queue.submit(POOL.name, [job], max_depth=8, placed_on="w1", idempotency_key="k")
    assert first.outcome is Admission.QUEUED
    assert again.outcome is Admission.QUEUED  # the admitted marker: the retry landed already
    assert await queue.depth(POOL.name) == 1


async def test_a_worker_reads_its_own_stream_first(
    queue: JobQueue, streams: WorkerStreams, redis_backend: aioredis.Redis
) -> None:
    await alive(redis_backend, "w1")
    await queue.submit(POOL.name, [make_job("shared")], max_depth=8)
    await queue.submit(POOL.name, [make_job("mine")], max_depth=8, placed_on="w1")
    read = await streams.read([POOL.own("w1"), POOL], [POOL], "w1", count=4, block_ms=100)
    assert [d.job.request_id for d in read.deliveries] == ["mine", "shared"]
    mine = read.deliveries[0]
    assert mine.stream == POOL.own("w1").name
    assert mine.shared_stream == POOL.name  # counted done, dead-lettered, handed back there
    assert [t.victim for t in read.tickets] == ["w1"]


async def test_steal_only_after_the_bound_and_never_before(
    queue: JobQueue, streams: WorkerStreams, redis_backend: aioredis.Redis
) -> None:
    await alive(redis_backend, "w1")
    await queue.submit(POOL.name, [make_job("p")], max_depth=8, placed_on="w1")
    read = await streams.read([POOL.own("w2"), POOL], [POOL], "w2", count=4, block_ms=100)
    assert read.deliveries == []
    (ticket,) = read.tickets

    wait_ms, early = await streams.steal(POOL, "w1", "w2", count=4, age_ms=10_000, tickets=[ticket])
    assert early == [] and wait_ms > 5_000  # too early by Redis's clock: nothing done
    assert await redis_backend.xlen(names.steal_tickets(POOL.name)) == 1

    await asyncio.sleep(STEAL_MS / 1000 + 0.02)
    wait_ms, stolen = await streams.steal(
        POOL, "w1", "w2", count=4, age_ms=STEAL_MS, tickets=[ticket]
    )
    assert wait_ms == 0
    assert [d.job.request_id for d in stolen] == ["p"]
    assert stolen[0].stream == POOL.own("w1").name  # pending there, under the thief
    assert await redis_backend.xlen(names.steal_tickets(POOL.name)) == 0
    pending = await redis_backend.xpending(POOL.own("w1").name, names.JOB_GROUP)
    assert [c["name"] for c in pending["consumers"]] == [b"w2"]
    # the owner never gets it
    own = await streams.read([POOL.own("w1"), POOL], [], "w1", count=4, block_ms=50)
    assert own.deliveries == []


async def test_a_job_read_by_its_worker_is_not_stolen(
    queue: JobQueue, streams: WorkerStreams, redis_backend: aioredis.Redis
) -> None:
    await alive(redis_backend, "w1")
    await queue.submit(POOL.name, [make_job("p")], max_depth=8, placed_on="w1")
    own = await streams.read([POOL.own("w1")], [], "w1", count=4, block_ms=100)
    assert len(own.deliveries) == 1
    await asyncio.sleep(STEAL_MS / 1000 + 0.02)
    _, stolen = await streams.steal(POOL, "w1", "w2", count=4, age_ms=STEAL_MS, tickets=[])
    assert stolen == []


async def test_two_concurrent_stealers_never_take_one_job_twice(
    redis_target: RedisTarget, queue: JobQueue, streams: WorkerStreams
) -> None:
    redis = redis_target.connect()
    other = redis_target.connect()
    try:
        await alive(redis, "w1")
        for i in range(20):
            await queue.submit(POOL.name, [make_job(f"r{i}")], max_depth=64, placed_on="w1")
        await asyncio.sleep(STEAL_MS / 1000 + 0.02)
        thieves = [WorkerStreams(client, JobQueue(client)) for client in (redis, other)]

        async def steal(thief: WorkerStreams, name: str) -> list[str]:
            taken: list[str] = []
            for _ in range(10):
                _, got = await thief.steal(POOL, "w1", name, count=3, age_ms=STEAL_MS, tickets=[])
                taken += [d.job.request_id for d in got]
            return taken

        first, second = await asyncio.gather(steal(thieves[0], "w2"), steal(thieves[1], "w3"))
        assert not set(first) & set(second)
        assert sorted(first + second) == sorted(f"r{i}" for i in range(20))
    finally:
        await redis.aclose()
        await other.aclose()


async def test_a_dead_workers_unread_jobs_go_back_to_the_shared_stream(
    queue: JobQueue, streams: WorkerStreams, redis_backend: aioredis.Redis
) -> None:
    await alive(redis_backend, "w1")
    for request in ("a", "b", "c"):
        await queue.submit(POOL.name, [make_job(request)], max_depth=8, placed_on="w1")
    read = await streams.read([POOL.own("w1")], [], "w1", count=1, block_ms=100)
    assert [d.job.request_id for d in read.deliveries] == ["a"]  # read, not acked

    assert await streams.requeue(POOL, "w1", Requeue.DEAD) == -1  # alive: untouched
    assert await streams.sweep(POOL, "w2") == (0, set())
    assert await streams.sweep(POOL, "w1") == (1, set())  # its own read entry is pending
    await redis_backend.delete(names.worker_heartbeat("w1"))
    assert await streams.sweep(POOL, "w2") == (0, {"w1"})
    assert await streams.requeue(POOL, "w1", Requeue.DEAD) == 2
    assert await queue.depth(POOL.name) == 3  # nothing lost, nothing twice
    shared = await queue.read([POOL], "w2", count=8, block_ms=100)
    assert sorted(d.job.request_id for d in shared) == ["b", "c"]

    # the entry it read stays pending there (reclaimed as any dead worker's)
    assert await streams.members(POOL) == {"w1"}
    await queue.ack(read.deliveries[0].stream, read.deliveries[0].entry_id)
    assert await streams.requeue(POOL, "w1", Requeue.DEAD) == 0
    assert await streams.members(POOL) == set()  # empty: forgotten
    assert not await redis_backend.exists(POOL.own("w1").name)


async def test_a_draining_worker_moves_its_unread_jobs_and_keeps_its_stream(
    queue: JobQueue, streams: WorkerStreams, redis_backend: aioredis.Redis
) -> None:
    await alive(redis_backend, "w1")
    for request in ("a", "b"):
        await queue.submit(POOL.name, [make_job(request)], max_depth=8, placed_on="w1")
    assert await streams.requeue(POOL, "w1", Requeue.DRAIN) == 2
    assert await redis_backend.xlen(POOL.own("w1").name) == 0
    assert await streams.members(POOL) == {"w1"}
    shared = await queue.read([POOL], "w2", count=8, block_ms=100)
    assert sorted(d.job.request_id for d in shared) == ["a", "b"]
    assert await streams.requeue(POOL, "w1", Requeue.LEAVE) == 0
    assert await streams.members(POOL) == set()
