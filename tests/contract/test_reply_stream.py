"""ReplyRouter (gateway side of the token return path) on both backends.

Events reach the reply stream the way workers write them: XADD of the protocol's
stream fields, or through a :class:`workers.journal.run_journal.RunJournal`.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from fakeredis.aioredis import FakeRedis
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.dispatch.reply_router import ReplyRouter, StreamInterrupted
from shared.connections.connect import connect
from shared.protocol import (
    ErrorEvent,
    Event,
    FinishEvent,
    GenerateJob,
    SamplingOptions,
    TokenEvent,
    encode,
)
from shared.queue import names
from shared.queue.job_queue import JobQueue, JobStream
from shared.roles import Role
from shared.tasks import cancel_and_wait
from tests.conftest import RedisTarget
from tests.waiting import eventually
from workers.journal.run_journal import RunJournal

REPLY = names.reply_stream("gw-test")
JOB_STREAM = JobStream("m", Role.AGGREGATED)
JOBS = JOB_STREAM.name
WATCHDOG_TICK_S = 0.1
"""How often the routers of the watchdog tests look (production: once a second)."""


def tok(request_id: str, seq: int, index: int = 0) -> TokenEvent:
    return TokenEvent(request_id, index, seq, 0, [seq], f"t{seq}")


def fin(request_id: str, seq: int, index: int = 0) -> FinishEvent:
    return FinishEvent(request_id, index, seq, 0, "stop", 3, seq)


async def send(redis: aioredis.Redis, *events: Event, stream: str = REPLY) -> None:
    """Append events to a reply stream exactly as the journal's script does."""
    for event in events:
        await redis.xadd(stream, encode(event))  # type: ignore[arg-type]


async def stop(task: asyncio.Task[Any], *, within_s: float = 5.0) -> None:
    """Stop ``task`` (cancelling until it ends) and re-raise anything it died of."""
    await cancel_and_wait([task], timeout_s=within_s)
    assert task.done(), f"{task.get_name()} ignored cancellation for {within_s}s"
    if not task.cancelled() and task.exception() is not None:
        raise task.exception()  # type: ignore[misc]


@contextlib.asynccontextmanager
async def running(coro: Any, name: str = "task") -> AsyncIterator[asyncio.Task[Any]]:
    task = asyncio.create_task(coro, name=name)
    try:
        yield task
    finally:
        await stop(task)


async def take(queue: asyncio.Queue[Event | StreamInterrupted], n: int) -> list[Any]:
    return [await asyncio.wait_for(queue.get(), 5.0) for _ in range(n)]


@pytest.fixture
async def router(redis_backend: aioredis.Redis) -> AsyncIterator[ReplyRouter]:
    rt = ReplyRouter(redis_backend, REPLY, queue_size=8, block_ms=200)
    async with running(rt.run(), "reply-router"):
        yield rt


# ---------------------------------------------------------------------- routing


async def test_router_routes_in_order_to_each_request(
    router: ReplyRouter, redis_backend: aioredis.Redis
) -> None:
    q1, q2 = router.open("r1"), router.open("r2")
    assert router.open_requests() == 2
    events: list[Event] = []
    for seq in range(3):
        events += [tok("r1", seq), tok("r2", seq, index=1)]
    events += [fin("r1", 3), ErrorEvent("r2", 1, 3, 0, 500, "server_error", "engine_error", "x")]
    await send(redis_backend, *events)

    got1 = await take(q1, 4)
    got2 = await take(q2, 4)
    assert got1 == [tok("r1", 0), tok("r1", 1), tok("r1", 2), fin("r1", 3)]
    assert [e.seq for e in got2] == [0, 1, 2, 3]
    assert all(e.request_id == "r2" for e in got2)
    assert isinstance(got2[-1], ErrorEvent)
    assert q1.empty() and q2.empty()
    assert router.connected.is_set()


async def test_router_drops_unknown_and_closed_requests(
    router: ReplyRouter, redis_backend: aioredis.Redis
) -> None:
    queue = router.open("known")
    await send(redis_backend, tok("stranger", 0), tok("known", 0))
    assert await take(queue, 1) == [tok("known", 0)]

    router.close("known")
    router.close("never-opened")  # harmless
    assert router.open_requests() == 0
    await send(redis_backend, tok("known", 1))
    # Undecodable entries are skipped too, and the router keeps going.
    await redis_backend.xadd(REPLY, {b"v": b"1", b"m": b"\xc1"})
    await redis_backend.xadd(REPLY, {b"v": b"2", b"m": encode(tok("late", 99))[b"m"]})
    await redis_backend.xadd(REPLY, {b"unrelated": b"1"})
    late = router.open("late")
    await send(redis_backend, tok("late", 0))
    assert await take(late, 1) == [tok("late", 0)]
    assert queue.empty()


async def test_router_survives_an_entry_with_invalid_utf8(redis_backend: aioredis.Redis) -> None:
    """msgspec raises UnicodeDecodeError for it; the router must treat it as undecodable."""
    rt = ReplyRouter(redis_backend, REPLY, block_ms=200)
    queue = rt.open("r")
    async with running(rt.run()) as task:
        await redis_backend.xadd(REPLY, {b"v": b"1", b"m": b"\x91\xaa" + b"\x00" * 9 + b"\x80"})
        await send(redis_backend, tok("r", 0))
        assert await asyncio.wait_for(queue.get(), 2.0) == tok("r", 0)
        assert not task.done()


async def test_router_overflow_yields_request_overflow(
    router: ReplyRouter, redis_backend: aioredis.Redis
) -> None:
    slow = router.open("slow")
    fine = router.open("fine")
    # The queue holds 8: the 9th event overflows it.
    await send(redis_backend, *(tok("slow", seq) for seq in range(9)), tok("fine", 0))

    assert await take(fine, 1) == [tok("fine", 0)]
    [item] = await take(slow, 1)
    assert isinstance(item, StreamInterrupted)
    assert "slowly" in item.reason
    assert slow.empty()
    assert router.open_requests() == 1  # the overflowed request was closed
    await send(redis_backend, tok("slow", 9), tok("fine", 1))
    assert await take(fine, 1) == [tok("fine", 1)]
    assert slow.empty()


async def test_router_reads_events_written_before_it_started(
    redis_backend: aioredis.Redis,
) -> None:
    await send(redis_backend, tok("early", 0))
    rt = ReplyRouter(redis_backend, REPLY)
    queue = rt.open("early")
    async with running(rt.run()):
        assert await take(queue, 1) == [tok("early", 0)]


async def test_router_gets_what_a_run_journal_writes(
    router: ReplyRouter, redis_backend: aioredis.Redis
) -> None:
    queue = JobQueue(redis_backend)
    await queue.ensure_group(JOBS)
    now = time.time()
    job = GenerateJob(
        request_id="r1",
        index=0,
        model="m",
        prompt_token_ids=[1],
        sampling=SamplingOptions(max_tokens=4),
        reply_to=REPLY,
        deadline_unix=now + 60,
        created_unix=now,
    )
    await queue.submit(JOBS, [job], max_depth=10)
    [delivery] = await queue.read([JOB_STREAM], "w1", count=1, block_ms=100)
    requests = router.open("r1")

    journal = RunJournal(redis_backend, consumer="w1")
    async with running(journal.run(), "journal"):
        lease = await journal.begin(delivery)
        for _ in range(3):
            seq = lease.take_seq()
            journal.publish(lease, tok("r1", seq), [seq])
        journal.finish(lease, fin("r1", lease.take_seq()))
        await journal.flush()

    assert await take(requests, 4) == [tok("r1", 0), tok("r1", 1), tok("r1", 2), fin("r1", 3)]
    assert await redis_backend.xlen(JOBS) == 0


async def test_interrupt_all_ends_every_open_request(
    router: ReplyRouter, redis_backend: aioredis.Redis
) -> None:
    unread = router.open("unread")
    idle = router.open("idle")
    marker = router.open("marker")
    await send(redis_backend, tok("unread", 0), tok("unread", 1), tok("marker", 0))
    assert await take(marker, 1) == [tok("marker", 0)]  # so everything before it is routed
    assert unread.qsize() == 2

    router.interrupt_all("maintenance")
    assert router.open_requests() == 0
    for queue in (unread, idle):
        [item] = await take(queue, 1)  # queued events are replaced by the interruption
        assert isinstance(item, StreamInterrupted)
        assert item.reason == "maintenance"
        assert queue.empty()
    # Late events of the interrupted requests go nowhere; new requests still work.
    fresh = router.open("fresh")
    await send(redis_backend, tok("unread", 2), tok("fresh", 0))
    assert await take(fresh, 1) == [tok("fresh", 0)]
    assert unread.empty()


# --------------------------------------------------------------------- watchdog


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port  # nothing listens there any more: connections are refused


class _Flaky:
    """Delegates to a real client unless ``down`` is set; then every read fails."""

    def __init__(self, inner: aioredis.Redis, *, down: bool = False) -> None:
        self.inner = inner
        self.down = down
        self.failed_reads = 0

    async def xread(self, *args: Any, **kwargs: Any) -> Any:
        if self.down:
            self.failed_reads += 1
            raise RedisConnectionError("Connection refused")
        return await self.inner.xread(*args, **kwargs)

    async def xtrim(self, *args: Any, **kwargs: Any) -> Any:
        return await self.inner.xtrim(*args, **kwargs)


async def expect_interrupted(
    queue: asyncio.Queue[Event | StreamInterrupted], *, not_before_s: float, within_s: float
) -> StreamInterrupted:
    started = time.monotonic()
    item = await asyncio.wait_for(queue.get(), within_s)
    elapsed = time.monotonic() - started
    assert isinstance(item, StreamInterrupted), item
    assert elapsed >= not_before_s - 0.05, f"interrupted after only {elapsed:.2f}s"
    assert "Redis" in item.reason
    return item


async def refused_connections() -> None:
    """Redis refuses connections from the start: open requests end after the limit."""
    block_s, outage_s = 0.1, 0.3
    limit = block_s + outage_s
    redis = aioredis.Redis(port=closed_port(), socket_connect_timeout=0.2, socket_timeout=0.5)
    rt = ReplyRouter(
        redis,
        REPLY,
        block_ms=int(block_s * 1000),
        outage_limit_s=outage_s,
        watchdog_tick_s=WATCHDOG_TICK_S,
    )
    first, second = rt.open("r1"), rt.open("r2")
    try:
        async with running(rt.run(), "reply-router"):
            await expect_interrupted(
                first, not_before_s=limit, within_s=limit + WATCHDOG_TICK_S + 1.0
            )
            [item] = await take(second, 1)
            assert isinstance(item, StreamInterrupted)
            assert rt.open_requests() == 0
            assert not rt.connected.is_set()
            # While Redis stays down, a request opened later is ended at the next check.
            third = rt.open("r3")
            await expect_interrupted(third, not_before_s=0, within_s=WATCHDOG_TICK_S + 1.0)
    finally:
        await redis.aclose()


async def outage_then_recovery() -> None:
    """Reads fail (ConnectionError) past the limit, then Redis answers again."""
    backend = FakeRedis()
    flaky = _Flaky(backend, down=True)
    block_s, outage_s = 0.1, 0.3
    limit = block_s + outage_s
    rt = ReplyRouter(
        flaky,
        REPLY,
        block_ms=int(block_s * 1000),
        outage_limit_s=outage_s,  # type: ignore[arg-type]
        watchdog_tick_s=WATCHDOG_TICK_S,
    )
    queue = rt.open("r1")
    async with running(rt.run(), "reply-router"):
        await expect_interrupted(queue, not_before_s=limit, within_s=limit + WATCHDOG_TICK_S + 1.0)
        assert flaky.failed_reads > 1  # it kept retrying, with backoff
        flaky.down = False
        await asyncio.wait_for(rt.connected.wait(), 3.0)
        fresh = rt.open("r2")
        await send(backend, tok("r2", 0), tok("r1", 5))
        assert await take(fresh, 1) == [tok("r2", 0)]
        assert queue.empty()
    await backend.aclose()


async def brief_outage() -> None:
    """An outage shorter than block + limit, across watchdog checks, ends nothing."""
    backend = FakeRedis()
    flaky = _Flaky(backend)
    block_s, outage_s = 0.1, 3.0
    rt = ReplyRouter(
        flaky,
        REPLY,
        block_ms=int(block_s * 1000),
        outage_limit_s=outage_s,  # type: ignore[arg-type]
        watchdog_tick_s=WATCHDOG_TICK_S,
    )
    queue = rt.open("r1")
    reconnects: list[int] = []

    async def reconnected() -> None:
        reconnects.append(flaky.failed_reads)

    rt.on_reconnect = reconnected
    async with running(rt.run(), "reply-router"):
        await send(backend, tok("r1", 0))
        assert await take(queue, 1) == [tok("r1", 0)]
        assert reconnects == []  # the first read is no reconnect
        flaky.down = True
        await send(backend, tok("r1", 1), tok("r1", 2))
        checks = rt.watchdog_checks

        async def looked_while_down() -> bool:
            return flaky.failed_reads >= 1 and rt.watchdog_checks >= checks + 2

        await eventually(looked_while_down, what="watchdog checks during the outage")
        flaky.down = False
        assert await take(queue, 2) == [tok("r1", 1), tok("r1", 2)]
        assert flaky.failed_reads >= 1
        assert rt.open_requests() == 1
        assert rt.connected.is_set()
        # Once per outage, when reads work again (Redis may have lost writes meanwhile).
        assert reconnects == [flaky.failed_reads]
    await backend.aclose()


async def test_watchdog_ends_open_requests_only_when_redis_stays_unreachable() -> None:
    """Three independent scenarios, run side by side."""
    await asyncio.gather(refused_connections(), outage_then_recovery(), brief_outage())


# ----------------------------------------------------------------- cancellation


def production_like_client(target: RedisTarget) -> aioredis.Redis:
    """For real Redis, a client built like the gateway's (socket timeouts, retries)."""
    return target.connect() if target.kind == "fake" else connect(target.url)


async def test_cancel_and_wait_stops_a_busy_router_every_time(redis_target: RedisTarget) -> None:
    """Shutdown must not hang even when one cancel is swallowed: on Python 3.11,
    ``asyncio.wait_for`` (redis-py wraps socket writes in it) can swallow a cancel that
    lands as a write completes, so one ``task.cancel()`` of a Redis loop does not always
    stop it. Shutdown paths use ``shared.tasks.cancel_and_wait``, which cancels until done."""
    await redis_target.flush()
    client = production_like_client(redis_target)
    writer = redis_target.connect()
    try:
        # Each swallowed cancel costs cancel_and_wait one 0.2 s round: fewer on fakeredis.
        for attempt in range(20 if redis_target.kind == "real" else 10):
            rt = ReplyRouter(client, REPLY, block_ms=300)
            queue = rt.open("r")
            task = asyncio.create_task(rt.run(), name="reply-router")
            await send(writer, tok("r", attempt))
            await take(queue, 1)
            # The router is starting its next XREAD right now.
            # Called directly (no wrapper task): the first cancel lands at once, mid-command.
            started = time.monotonic()
            await cancel_and_wait([task], timeout_s=5)
            assert task.cancelled(), f"attempt {attempt}: {task!r}"
            assert time.monotonic() - started < 4.0  # not the 5 s give-up
            watchdogs = [
                t for t in asyncio.all_tasks() if t.get_name() == "reply-watchdog" and not t.done()
            ]
            if watchdogs:
                await asyncio.wait(watchdogs, timeout=1.0)
            assert all(t.done() for t in watchdogs), "the router left its watchdog running"
    finally:
        await writer.flushdb()
        await client.aclose()
        await writer.aclose()
