"""PostgreSQL unreachable mid-run (a TCP proxy between Conveyor and the real server is
cut, then restored): known keys keep working, ledger rows wait in Redis and arrive once
it is back, none lost or doubled; the control plane reports the outage."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio as aioredis
from sqlalchemy import func, select

from gateway.control.key_cache import KeyCache
from gateway.control.key_service import KeyService, KeySpec
from gateway.control.ledger import LedgerConsumer, LedgerPolicy
from gateway.control.plane import ControlPlane
from gateway.control.records import Scope
from gateway.db.engine import Database
from gateway.db.models import UsageRow
from gateway.db.schema import upgrade_to_head
from shared.errors import InvalidApiKey
from shared.queue import names
from shared.queue.usage import UsageRecord, record_usage
from shared.settings import Settings
from tests.conftest import RedisTarget
from tests.support.sql import SqlTarget
from tests.support.tcp_proxy import TcpProxy

pytestmark = pytest.mark.postgres

POLICY = LedgerPolicy(block_ms=100, backoff_initial_s=0.05, backoff_max_s=0.5)


def usage(i: int) -> UsageRecord:
    now = time.time()
    return UsageRecord(
        request_id=f"req-{i}",
        key_id="key_a",
        model="m",
        prompt_tokens=3,
        completion_tokens=i,
        status="completed",
        received_unix=now,
        finished_unix=now,
    )


@pytest.fixture
async def direct(postgres_target: SqlTarget) -> AsyncIterator[Database]:
    db = postgres_target.open()
    await upgrade_to_head(db.engine)
    try:
        yield db
    finally:
        await db.dispose()


@pytest.fixture
async def proxy(postgres_target: SqlTarget) -> AsyncIterator[TcpProxy]:
    relay = TcpProxy(*postgres_target.host_port)
    await relay.start()
    try:
        yield relay
    finally:
        await relay.close()


@pytest.fixture
async def redis(redis_target: RedisTarget) -> AsyncIterator[aioredis.Redis]:
    client = redis_target.connect()
    await client.flushdb()
    try:
        yield client
    finally:
        await client.flushdb()
        await client.aclose()


async def test_an_outage_delays_rows_stops_no_known_key_and_loses_nothing(
    postgres_target: SqlTarget, direct: Database, proxy: TcpProxy, redis: aioredis.Redis
) -> None:
    settings = Settings(
        database_url=postgres_target.url_via("127.0.0.1", proxy.port),
        auth="on",
        redis_url="redis://unused",
    )
    plane = ControlPlane(settings, redis, "gw-outage")
    plane.ledger = LedgerConsumer(redis, plane.database.sessions, "gw-outage", POLICY)
    plane.keys = KeyCache(plane.database.sessions, redis, poll_s=0.05, retry_max_s=0.2)
    service = KeyService(direct.sessions, redis)
    known = await service.create(KeySpec("known", frozenset({Scope.INFERENCE})))
    await plane.start()
    try:
        for i in range(10):
            await record_usage(redis, usage(i))
        await _until(lambda: plane.ledger.status.rows_written == 10)
        assert (await plane.readiness())[0] == []

        await proxy.cut()  # ---------------------------------------------- outage
        for i in range(10, 30):
            await record_usage(redis, usage(i))
        await service.create(KeySpec("bumps the generation", frozenset({Scope.INFERENCE})))
        await _until(lambda: not plane.ledger.status.db_ok and not plane.keys.status().db_ok)
        assert not isinstance(plane.keys.resolve(known.secret), InvalidApiKey)
        problems, report = await plane.readiness()
        assert problems == []  # known keys serve, rows wait: the gateway stays ready
        assert report["database"]["reachable"] is False and report["database"]["error"]
        assert report["ledger"]["backlog"] == 20
        await asyncio.sleep(1.0)
        assert await _rows(direct) == 10

        await proxy.restore()  # ------------------------------------------ back
        await _until(lambda: plane.ledger.status.rows_written == 30, within_s=10)
        await _until(lambda: plane.keys.status().db_ok and plane.keys.status().keys == 2)
        assert await _rows(direct) == 30
        assert plane.ledger.status.duplicates_skipped == 0
        assert await redis.xlen(names.USAGE_STREAM) == 0
        info: Any = await redis.xpending(names.USAGE_STREAM, names.USAGE_GROUP)
        assert info["pending"] == 0
        assert (await plane.readiness())[1]["database"]["reachable"] is True
    finally:
        await plane.stop()


async def _rows(database: Database) -> int:
    async with database.sessions() as session:
        return int((await session.execute(select(func.count()).select_from(UsageRow))).scalar_one())


async def _until(condition: Callable[[], bool], *, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within_s} s")
        await asyncio.sleep(0.02)
