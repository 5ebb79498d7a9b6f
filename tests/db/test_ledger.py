"""The usage ledger path: record_usage -> conveyor:usage -> consumer -> usage_records.

Runs on fakeredis and the real Redis, each against SQLite and PostgreSQL."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from sqlalchemy import func, select

from gateway.control import ledger
from gateway.control.ledger import LedgerConsumer, LedgerPolicy
from gateway.control.ledger_retention import purge_once
from gateway.db.engine import Database, open_database
from gateway.db.models import UsageRow
from shared.queue import names
from shared.queue.usage import UsageRecord, encode_usage, record_usage
from tests.conftest import RedisTarget

UNREACHABLE_DB = "postgresql+asyncpg://postgres@127.0.0.1:1/nothing"
FAST = LedgerPolicy(batch_size=256, block_ms=50, backoff_initial_s=0.05, backoff_max_s=0.2)


def usage(i: int, **fields: Any) -> UsageRecord:
    now = time.time()
    values: dict[str, Any] = {
        "request_id": f"req-{i}",
        "key_id": "key_a",
        "model": "m1",
        "prompt_tokens": 10,
        "completion_tokens": i,
        "status": "completed",
        "received_unix": now - 1,
        "first_token_unix": now - 0.5,
        "finished_unix": now,
        "finish_reason": "stop",
    }
    return UsageRecord(**{**values, **fields})


@pytest.fixture
async def redis(redis_target: RedisTarget) -> AsyncIterator[aioredis.Redis]:
    client = redis_target.connect()
    await client.flushdb()
    try:
        yield client
    finally:
        await client.flushdb()
        await client.aclose()


async def rows(database: Database) -> list[UsageRow]:
    async with database.sessions() as session:
        return list(await session.scalars(select(UsageRow).order_by(UsageRow.request_id)))


async def row_count(database: Database) -> int:
    async with database.sessions() as session:
        return int((await session.execute(select(func.count()).select_from(UsageRow))).scalar_one())


async def pending(redis: aioredis.Redis) -> int:
    info: Any = await redis.xpending(names.USAGE_STREAM, names.USAGE_GROUP)
    return int(info["pending"])


async def test_rows_arrive_in_batches_and_leave_the_stream(
    redis: aioredis.Redis, database: Database
) -> None:
    for i in range(600):
        await record_usage(redis, usage(i))
    consumer = LedgerConsumer(redis, database.sessions, "gw-1", FAST)
    await consumer.ensure_group()
    handled = [await consumer.step() for _ in range(4)]
    assert handled == [256, 256, 88, 0]
    assert await row_count(database) == 600
    assert await redis.xlen(names.USAGE_STREAM) == 0 and await pending(redis) == 0
    first = (await rows(database))[0]
    assert (first.request_id, first.key_id, first.status, first.n) == (
        "req-0",
        "key_a",
        "completed",
        1,
    )
    assert first.finished_at - first.received_at == timedelta(seconds=1)
    assert consumer.status.rows_written == 600 and consumer.status.db_ok


async def test_a_record_sent_twice_is_counted_once(
    redis: aioredis.Redis, database: Database
) -> None:
    consumer = LedgerConsumer(redis, database.sessions, "gw-1", FAST)
    await consumer.ensure_group()
    await record_usage(redis, usage(1))
    await record_usage(redis, usage(1, completion_tokens=999))  # a retry
    await consumer.step()
    await record_usage(redis, usage(1))  # and a later one
    await consumer.step()
    [only] = await rows(database)
    assert only.completion_tokens == 1
    assert consumer.status.duplicates_skipped == 2


async def test_a_gateway_dying_between_commit_and_ack_doubles_nothing(
    redis: aioredis.Redis, database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    dying = LedgerConsumer(redis, database.sessions, "gw-dead", FAST)
    await dying.ensure_group()
    for i in range(10):
        await record_usage(redis, usage(i))

    async def no_ack(_: Any) -> None:
        raise RedisConnectionError("the process died here")

    monkeypatch.setattr(dying, "_ack", no_ack)
    with pytest.raises(RedisConnectionError):
        await dying.step()
    assert await row_count(database) == 10 and await pending(redis) == 10

    heir = LedgerConsumer(
        redis, database.sessions, "gw-2", LedgerPolicy(block_ms=50, claim_idle_ms=0)
    )
    assert await heir.step() == 10  # reclaimed from the dead consumer, written again: no-op
    assert await row_count(database) == 10
    assert heir.status.duplicates_skipped == 10
    assert await redis.xlen(names.USAGE_STREAM) == 0 and await pending(redis) == 0


async def test_gone_consumers_with_nothing_pending_are_forgotten(
    redis: aioredis.Redis, database: Database, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = LedgerConsumer(redis, database.sessions, "gw-old", FAST)
    await old.ensure_group()
    await old.step()  # registers "gw-old" in the group
    monkeypatch.setattr(ledger, "FORGET_AFTER_MS", 0)
    await asyncio.sleep(0.01)
    new = LedgerConsumer(redis, database.sessions, "gw-new", FAST)
    await new.step()
    consumers = {
        c["name"] for c in await redis.xinfo_consumers(names.USAGE_STREAM, names.USAGE_GROUP)
    }
    assert consumers == {b"gw-new"}


async def test_entries_that_cannot_be_written_go_to_the_dead_letter_stream(
    redis: aioredis.Redis, database: Database
) -> None:
    consumer = LedgerConsumer(redis, database.sessions, "gw-1", FAST)
    await consumer.ensure_group()
    await record_usage(redis, usage(1))
    await redis.xadd(names.USAGE_STREAM, {b"v": b"1", b"m": b"\xc1garbage"})
    await redis.xadd(names.USAGE_STREAM, {b"v": b"99", b"m": b""})
    await redis.xadd(names.USAGE_STREAM, encode_usage(usage(2, model="m" * 201)))  # too long
    await record_usage(redis, usage(3))
    assert await consumer.step() == 5
    assert [r.request_id for r in await rows(database)] == ["req-1", "req-3"]
    dead: Any = await redis.xrange(names.USAGE_DEAD_LETTER)
    assert len(dead) == 3 and all(b"error" in fields for _, fields in dead)
    assert consumer.status.dead_lettered == 3
    assert await redis.xlen(names.USAGE_STREAM) == 0 and await pending(redis) == 0


async def test_a_database_outage_delays_rows_and_loses_none(
    redis: aioredis.Redis, database: Database
) -> None:
    consumer = LedgerConsumer(redis, database.sessions, "gw-1", FAST)
    task = asyncio.create_task(consumer.run())
    down = open_database(UNREACHABLE_DB)
    try:
        for i in range(5):
            await record_usage(redis, usage(i))
        await _until(lambda: consumer.status.rows_written == 5)
        consumer._sessions = down.sessions  # the database goes away
        for i in range(5, 25):
            await record_usage(redis, usage(i))
        await _until(lambda: not consumer.status.db_ok)
        await asyncio.sleep(0.5)
        assert await row_count(database) == 5
        assert await redis.xlen(names.USAGE_STREAM) == 20  # waiting in Redis
        consumer._sessions = database.sessions  # and comes back
        await _until(lambda: consumer.status.rows_written == 25, within_s=5)
        assert consumer.status.db_ok and consumer.status.duplicates_skipped == 0
        assert [r.request_id for r in await rows(database)] == sorted(f"req-{i}" for i in range(25))
        assert await redis.xlen(names.USAGE_STREAM) == 0 and await pending(redis) == 0
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await down.dispose()


async def test_retention_runs_once_per_interval_across_gateways(
    redis: aioredis.Redis, database: Database
) -> None:
    consumer = LedgerConsumer(redis, database.sessions, "gw-1", FAST)
    await consumer.ensure_group()
    old = time.time() - 40 * 86400
    await record_usage(redis, usage(1, received_unix=old, first_token_unix=old, finished_unix=old))
    await record_usage(redis, usage(2))
    await consumer.step()
    now = datetime.now(UTC)
    assert await purge_once(redis, database.sessions, 30, now=now) == 1
    assert await purge_once(redis, database.sessions, 30, now=now) is None  # another gateway
    assert [r.request_id for r in await rows(database)] == ["req-2"]


async def _until(condition: Callable[[], bool], *, within_s: float = 3.0) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within_s} s")
        await asyncio.sleep(0.02)
