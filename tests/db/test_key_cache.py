"""The gateway's in-memory key cache: resolution, revocation across gateways, outages."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime, timedelta

import pytest

from gateway.control.key_cache import ADMIN_PRINCIPAL, KeyCache
from gateway.control.key_service import KeyService, KeySpec
from gateway.control.records import Limits, Scope
from gateway.db.engine import Database, open_database
from shared.errors import InvalidApiKey
from tests.conftest import RedisTarget

ADMIN_SECRET = "admin-secret-for-tests-0123456789"
UNREACHABLE_DB = "postgresql+asyncpg://postgres@127.0.0.1:1/nothing"


@pytest.fixture
async def service(database: Database, redis_target: RedisTarget) -> AsyncIterator[KeyService]:
    await redis_target.flush()
    redis = redis_target.connect()
    try:
        yield KeyService(database.sessions, redis)
    finally:
        await redis.aclose()
        await redis_target.flush()


async def test_resolve(database: Database, service: KeyService) -> None:
    created = await service.create(
        KeySpec("team-a", frozenset({Scope.INFERENCE}), frozenset({"m1"}), Limits(rpm=7))
    )
    revoked = await service.create(KeySpec("gone", frozenset({Scope.INFERENCE})))
    await service.revoke(revoked.record.id)
    cache = KeyCache(database.sessions, None, admin_secret=ADMIN_SECRET)
    assert await cache.reload()

    principal = cache.resolve(created.secret)
    assert not isinstance(principal, InvalidApiKey)
    assert (principal.key_id, principal.name, principal.limits.rpm) == (
        created.record.id,
        "team-a",
        7,
    )
    assert principal.has_scope(Scope.INFERENCE) and not principal.has_scope(Scope.ADMIN)
    assert principal.may_use("m1") and not principal.may_use("m2")
    assert cache.resolve(ADMIN_SECRET) is ADMIN_PRINCIPAL
    assert ADMIN_PRINCIPAL.has_scope(Scope.METRICS)

    for bad in (None, "", revoked.secret, created.secret[:-1] + "x", ADMIN_SECRET + "x"):
        outcome = cache.resolve(bad)
        assert isinstance(outcome, InvalidApiKey), bad
        assert outcome.status == 401 and outcome.code == "invalid_api_key"
        assert not bad or bad not in outcome.message  # masked, never the secret
    assert cache.status().keys == 1


async def test_an_expired_key_stops_working_while_cached(
    database: Database, service: KeyService
) -> None:
    now = [time.time()]
    cache = KeyCache(database.sessions, None, clock=lambda: now[0])
    expires = datetime.now(UTC) + timedelta(hours=1)
    created = await service.create(KeySpec("t", frozenset({Scope.INFERENCE}), expires_at=expires))
    await cache.reload()
    assert not isinstance(cache.resolve(created.secret), InvalidApiKey)
    now[0] = expires.timestamp() + 1
    outcome = cache.resolve(created.secret)
    assert isinstance(outcome, InvalidApiKey) and "expired" in outcome.message


async def test_a_revocation_reaches_every_gateway_at_the_next_poll(
    database: Database, service: KeyService, redis_target: RedisTarget
) -> None:
    clients = [redis_target.connect(), redis_target.connect()]
    caches = [KeyCache(database.sessions, client) for client in clients]
    tasks = [asyncio.create_task(cache.run()) for cache in caches]
    try:
        created = await service.create(KeySpec("t", frozenset({Scope.INFERENCE})))
        await _until(lambda: all(_accepts(c, created.secret) for c in caches), within_s=5.0)
        started = time.monotonic()
        await service.revoke(created.record.id)
        # Bounded well under the 30 s full reload: the generation poll (250 ms) carried it.
        await _until(lambda: not any(_accepts(c, created.secret) for c in caches), within_s=5.0)
        elapsed = time.monotonic() - started
        print(f"revocation seen by both caches after {elapsed * 1000:.0f} ms")
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for client in clients:
            await client.aclose()


async def test_a_database_outage_keeps_the_known_keys(
    database: Database, service: KeyService
) -> None:
    known = await service.create(KeySpec("known", frozenset({Scope.INFERENCE})))
    cache = KeyCache(database.sessions, None)
    assert await cache.reload()
    down = open_database(UNREACHABLE_DB)
    cache._sessions = down.sessions  # the database goes away
    try:
        later = await service.create(KeySpec("later", frozenset({Scope.INFERENCE})))
        assert not await cache.reload()
        status = cache.status()
        assert status.loaded and not status.db_ok and status.error and status.keys == 1
        assert not isinstance(cache.resolve(known.secret), InvalidApiKey)
        assert isinstance(cache.resolve(later.secret), InvalidApiKey)
    finally:
        await down.dispose()
    cache._sessions = database.sessions  # and comes back
    assert await cache.reload()
    assert cache.status().db_ok and cache.status().keys == 2
    assert not isinstance(cache.resolve(later.secret), InvalidApiKey)


async def test_a_cache_that_never_loaded_says_so() -> None:
    down = open_database(UNREACHABLE_DB)
    try:
        cache = KeyCache(down.sessions, None, admin_secret=ADMIN_SECRET)
        assert not await cache.reload()
        assert not cache.status().loaded and not cache.status().db_ok
        assert cache.resolve(ADMIN_SECRET) is ADMIN_PRINCIPAL  # never stored: still works
    finally:
        await down.dispose()


def _accepts(cache: KeyCache, secret: str) -> bool:
    return not isinstance(cache.resolve(secret), InvalidApiKey)


async def _until(condition: Callable[[], bool], *, within_s: float) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within_s} s")
        await asyncio.sleep(0.01)
