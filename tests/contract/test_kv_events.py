"""KV events through Redis: a worker's forwarder writes, a gateway's feeder reads into its
prefix index (fakeredis and a real Redis)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import redis.asyncio as aioredis

from gateway.placement.index_feeder import IndexFeeder
from gateway.placement.prefix_index import PrefixIndex
from shared.queue import names
from shared.queue.kv_events import (
    Entry,
    KvBatch,
    KvEvent,
    KvEventReader,
    KvEventWriter,
    RemovedBlocks,
    StoredBlocks,
)
from shared.queue.liveness import BEAT, WorkerRegistry, beat_args
from shared.tasks import cancel_and_wait
from tests.waiting import eventually
from workers.engines.base import KvEventFeed
from workers.engines.kv_events import KvEventForwarder

SIZE = 4
MODEL = "m"
PROMPT = list(range(100, 117))  # 4 full blocks


class Engine:
    """An engine's event feed the test steps by hand."""

    def __init__(self) -> None:
        self.steps: asyncio.Queue[list[KvEvent]] = asyncio.Queue()

    async def batches(self) -> AsyncIterator[list[KvEvent]]:
        while True:
            yield await self.steps.get()

    def feed(self) -> KvEventFeed:
        return KvEventFeed(SIZE, self.batches)


def stored(first: int, count: int) -> StoredBlocks:
    parent = None if first == 0 else first - 1
    return StoredBlocks(
        list(range(first, first + count)), parent, PROMPT[first * SIZE : (first + count) * SIZE]
    )


async def alive(redis: aioredis.Redis, *worker_ids: str) -> None:
    beat = redis.register_script(BEAT)
    for worker_id in worker_ids:
        keys, args = beat_args(worker_id, b"{}", 60_000)
        await beat(keys=keys, args=args)


@contextlib.asynccontextmanager
async def running(*coros: Coroutine[Any, Any, None]) -> AsyncIterator[None]:
    tasks = [asyncio.create_task(coro) for coro in coros]
    try:
        yield
    finally:
        await cancel_and_wait(tasks)


def feeder(
    redis: aioredis.Redis,
    index: PrefixIndex,
    dead_check_s: float = 5.0,
    *,
    reader: KvEventReader | None = None,
    read_interval_s: float = 0.0,
) -> IndexFeeder:
    registry = WorkerRegistry(redis, ttl_s=1.0)
    return IndexFeeder(
        reader or KvEventReader(redis),
        index,
        registry,
        block_ms=100,
        dead_check_s=dead_check_s,
        read_interval_s=read_interval_s,
    )


def matched(index: PrefixIndex, worker_id: str = "w1") -> int:
    return index.match(MODEL, None, PROMPT, [worker_id]).get(worker_id, 0)


class TimedReader(KvEventReader):
    """Records when each read began and how many entries it returned."""

    def __init__(self, redis: aioredis.Redis) -> None:
        super().__init__(redis)
        self.reads: list[tuple[float, int]] = []

    async def read(
        self, after: bytes | str, *, block_ms: int, count: int = 512
    ) -> list[tuple[bytes, Entry | None]]:
        began = time.monotonic()
        entries = await super().read(after, block_ms=block_ms, count=count)
        self.reads.append((began, len(entries)))
        return entries


async def test_reads_come_at_most_once_per_interval_and_miss_nothing(
    redis_backend: aioredis.Redis,
) -> None:
    await alive(redis_backend, "w1")
    engine = Engine()
    forwarder = KvEventForwarder(
        KvEventWriter(redis_backend, "w1"), engine.feed(), MODEL, snapshot_s=60
    )
    index, reader = PrefixIndex(), TimedReader(redis_backend)
    paced = feeder(redis_backend, index, reader=reader, read_interval_s=0.05)
    async with running(forwarder.run(), paced.run()):
        for first in range(4):
            await engine.steps.put([stored(first, 1)])
            await asyncio.sleep(0.01)

        async def four() -> bool:
            return matched(index) == 4

        await eventually(four, what="every step's block indexed")
    starts = [began for began, _ in reader.reads]
    for (began, count), after in zip(reader.reads, starts[1:], strict=False):
        if count:
            assert after - began >= 0.05 - 0.002


async def test_events_reach_the_index_and_leaving_drops_them(redis_backend: aioredis.Redis) -> None:
    await alive(redis_backend, "w1")
    engine = Engine()
    forwarder = KvEventForwarder(
        KvEventWriter(redis_backend, "w1"), engine.feed(), MODEL, snapshot_s=60
    )
    index = PrefixIndex()
    forwarding = asyncio.create_task(forwarder.run())
    async with running(feeder(redis_backend, index).run()):
        await engine.steps.put([stored(0, 2)])
        await engine.steps.put([stored(2, 2)])

        async def four() -> bool:
            return matched(index) == 4

        await eventually(four, what="the index holds the prompt's 4 blocks")
        await engine.steps.put([RemovedBlocks([1])])

        async def one() -> bool:
            return matched(index) == 1

        await eventually(one, what="block 1 removed")
        await cancel_and_wait([forwarding])  # the worker stops: it says so

        async def gone() -> bool:
            return index.blocks_by_worker() == {}

        await eventually(gone, what="the worker's blocks dropped")
    assert await redis_backend.get(names.kv_snapshot("w1")) is None


async def test_a_lost_batch_is_rebuilt_from_the_next_snapshot(
    redis_backend: aioredis.Redis,
) -> None:
    await alive(redis_backend, "w1")
    engine = Engine()
    writer = KvEventWriter(redis_backend, "w1")
    forwarder = KvEventForwarder(writer, engine.feed(), MODEL, snapshot_s=0.2)
    index = PrefixIndex()
    lost = asyncio.Event()
    publish = writer.publish

    async def losing(batch):  # type: ignore[no-untyped-def]
        if batch.seq == 1 and not lost.is_set():
            lost.set()
            return  # as if Redis never got it
        await publish(batch)

    writer.publish = losing  # type: ignore[method-assign]
    async with running(forwarder.run(), feeder(redis_backend, index).run()):
        await engine.steps.put([stored(0, 1)])
        await engine.steps.put([stored(1, 1)])  # lost
        await engine.steps.put([stored(2, 2)])

        async def rebuilt() -> bool:
            return matched(index) == 4 and index.gaps == 1

        await eventually(rebuilt, what="the gap seen and the snapshot applied")


async def test_a_late_gateway_starts_from_the_snapshots(redis_backend: aioredis.Redis) -> None:
    await alive(redis_backend, "w1")
    engine = Engine()
    forwarder = KvEventForwarder(
        KvEventWriter(redis_backend, "w1"), engine.feed(), MODEL, snapshot_s=0.1
    )
    async with running(forwarder.run()):
        await engine.steps.put([stored(0, 4)])

        async def snapshotted() -> bool:
            return await KvEventReader(redis_backend).snapshot("w1") is not None

        await eventually(snapshotted, what="a snapshot")
        await redis_backend.xtrim(names.KV_EVENTS_STREAM, maxlen=0)  # the batches are gone
        index = PrefixIndex()
        async with running(feeder(redis_backend, index).run()):

            async def loaded() -> bool:
                return matched(index) == 4

            await eventually(loaded, what="the index built from the snapshot")


async def test_dead_workers_are_dropped(redis_backend: aioredis.Redis) -> None:
    await alive(redis_backend, "w1")
    writer = KvEventWriter(redis_backend, "w2")  # w2 has no liveness key: dead
    await writer.publish(KvBatch("w2", MODEL, SIZE, 0, [stored(0, 4)]))
    await KvEventWriter(redis_backend, "w1").publish(KvBatch("w1", MODEL, SIZE, 0, [stored(0, 2)]))
    index = PrefixIndex()
    reader = feeder(redis_backend, index, dead_check_s=0.05)
    async with running(reader.run()):

        async def dropped() -> bool:
            return reader.entries == 2 and index.blocks_by_worker() == {"w1": 2}

        await eventually(dropped, what="w2 dropped, w1 kept")


async def test_a_failing_engine_feed_takes_the_worker_out_of_the_index(
    redis_backend: aioredis.Redis,
) -> None:
    async def broken() -> AsyncIterator[list[KvEvent]]:
        yield [stored(0, 4)]
        raise RuntimeError("the engine's event socket broke")

    writer = KvEventWriter(redis_backend, "w1")
    forwarder = KvEventForwarder(writer, KvEventFeed(SIZE, broken), MODEL, snapshot_s=60)
    await forwarder.run()  # logs the failure and leaves
    index = PrefixIndex()
    reader = feeder(redis_backend, index)
    for _, entry in await KvEventReader(redis_backend).read(b"0-0", block_ms=10):
        await reader.apply(entry)
    assert forwarder.batches == 1 and index.blocks_by_worker() == {}


async def test_a_started_job_is_indexed_as_coming_until_its_engine_stores_it(
    redis_backend: aioredis.Redis,
) -> None:
    await alive(redis_backend, "w1")
    engine = Engine()
    forwarder = KvEventForwarder(
        KvEventWriter(redis_backend, "w1"), engine.feed(), MODEL, snapshot_s=60
    )
    index = PrefixIndex(pending_s=60)
    async with running(forwarder.run(), feeder(redis_backend, index).run()):
        await engine.steps.put([stored(0, 1)])  # indexes the worker (its first batch)

        async def one() -> bool:
            return matched(index) == 1

        await eventually(one, what="the first block stored")
        forwarder.announce(PROMPT, None, cached_tokens=SIZE)

        async def coming() -> bool:
            return matched(index) == 4 and index.pending_blocks() == 3

        await eventually(coming, what="the started job's 3 uncached blocks counted as held")
        await engine.steps.put([stored(1, 3)])

        async def stored_now() -> bool:
            return matched(index) == 4 and index.pending_blocks() == 0

        await eventually(stored_now, what="the stored blocks no longer pending")
        index.expire(float("inf"))
        assert matched(index) == 4  # what the engine stored does not expire
