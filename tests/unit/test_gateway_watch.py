"""A gateway counts as gone only after its key stayed missing for the whole grace period."""

from __future__ import annotations

import fakeredis.aioredis

from shared.queue import names
from shared.queue.liveness import GatewayWatch


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def watch(
    grace_s: float = 10.0, redis: fakeredis.aioredis.FakeRedis | None = None
) -> tuple[GatewayWatch, Clock]:
    clock = Clock()
    redis = redis or fakeredis.aioredis.FakeRedis()
    return GatewayWatch(redis, grace_s=grace_s, clock=clock), clock


def test_a_gateway_missing_for_less_than_the_grace_is_not_gone() -> None:
    gateways, clock = watch()
    assert gateways.observe({"gw-a": False}) == set()
    clock.now += 9.9
    assert gateways.observe({"gw-a": False}) == set()


def test_a_gateway_missing_for_the_whole_grace_is_gone() -> None:
    gateways, clock = watch()
    gateways.observe({"gw-a": False})
    clock.now += 10.0
    assert gateways.observe({"gw-a": False, "gw-b": True}) == {"gw-a"}


def test_one_sighting_restarts_the_grace() -> None:
    gateways, clock = watch()
    gateways.observe({"gw-a": False})
    clock.now += 8
    gateways.observe({"gw-a": True})
    clock.now += 8
    assert gateways.observe({"gw-a": False}) == set()


def test_zero_grace_trusts_one_check() -> None:
    gateways, _ = watch(grace_s=0.0)
    assert gateways.observe({"gw-a": False}) == {"gw-a"}


def test_long_dead_gateways_are_forgotten() -> None:
    gateways, clock = watch()
    gateways.observe({"gw-a": False})
    clock.now += 7200
    gateways.observe({"gw-b": True})
    assert gateways.observe({"gw-a": False}) == set()  # a fresh grace, not a memory leak


async def test_gone_reads_the_liveness_keys() -> None:
    redis = fakeredis.aioredis.FakeRedis()
    gateways, clock = watch(grace_s=1.0, redis=redis)
    await redis.set(names.gateway_heartbeat("gw-live"), b"1")
    assert await gateways.gone(["gw-live", "gw-dead"]) == set()
    clock.now += 1.0
    assert await gateways.gone(["gw-live", "gw-dead", "gw-dead"]) == {"gw-dead"}
    assert await gateways.gone([]) == set()
