"""Per-key limits counted inside queue admission: fakeredis and a real Redis."""

from __future__ import annotations

import time

import pytest
import redis.asyncio as aioredis

from shared.queue import names
from shared.queue.job_queue import Admission, JobQueue, JobStream
from shared.queue.key_limits import (
    BudgetPeriod,
    KeyLimitCounters,
    LimitCharge,
    LimitKind,
    Limits,
    period_ttl_s,
)
from shared.roles import Role
from tests.contract.test_job_queue import make_job

JOBS = JobStream("m", Role.AGGREGATED)
NOW = 1_790_000_000.0  # a fixed moment: windows and periods are deterministic


@pytest.fixture
async def queue(redis_backend: aioredis.Redis) -> JobQueue:
    q = JobQueue(redis_backend)
    await q.ensure_group(JOBS.name)
    return q


def charge(request_id: str, limits: Limits, cost: int = 10, now: float = NOW) -> LimitCharge:
    return LimitCharge("key_a", limits, request_id, cost, now)


async def admit(
    queue: JobQueue,
    request_id: str,
    limits: Limits,
    cost: int = 10,
    now: float = NOW,
    jobs: int = 1,
) -> tuple[Admission, str]:
    result = await queue.submit(
        JOBS.name,
        [make_job(request_id, i) for i in range(jobs)],
        max_depth=100,
        charge=charge(request_id, limits, cost, now),
    )
    return result.outcome, result.detail


async def test_requests_per_minute(queue: JobQueue, redis_backend: aioredis.Redis) -> None:
    limits = Limits(rpm=2)
    assert (await admit(queue, "r1", limits))[0] is Admission.QUEUED
    assert (await admit(queue, "r2", limits))[0] is Admission.QUEUED
    assert await admit(queue, "r3", limits) == (Admission.LIMITED, LimitKind.REQUESTS.value)
    assert await redis_backend.xlen(JOBS.name) == 2  # the refused request queued nothing
    assert (await admit(queue, "r4", limits, now=NOW + 60))[0] is Admission.QUEUED  # next minute


async def test_tokens_per_minute_reserve_and_settle(
    queue: JobQueue, redis_backend: aioredis.Redis
) -> None:
    limits = Limits(tpm=100)
    assert (await admit(queue, "r1", limits, cost=80))[0] is Admission.QUEUED
    assert await admit(queue, "r2", limits, cost=30) == (Admission.LIMITED, "tokens")
    await KeyLimitCounters(redis_backend).settle(charge("r1", limits, cost=80), used_tokens=20)
    assert (await admit(queue, "r2", limits, cost=30))[0] is Admission.QUEUED


async def test_concurrency_slot_is_freed_by_settle_or_by_its_lease(
    queue: JobQueue, redis_backend: aioredis.Redis
) -> None:
    limits = Limits(max_concurrent=1)
    now = time.time()
    assert (await admit(queue, "r1", limits, now=now))[0] is Admission.QUEUED
    assert await admit(queue, "r2", limits, now=now) == (Admission.LIMITED, "concurrency")
    await KeyLimitCounters(redis_backend).settle(charge("r1", limits, now=now), used_tokens=10)
    assert (await admit(queue, "r2", limits, now=now))[0] is Admission.QUEUED
    # r2's gateway dies: nobody renews its lease, and 16 s later the slot is free again
    assert await admit(queue, "r3", limits, now=now + 1) == (Admission.LIMITED, "concurrency")
    assert (await admit(queue, "r3", limits, now=now + 16))[0] is Admission.QUEUED


async def test_renewed_slot_outlives_its_first_lease(
    queue: JobQueue, redis_backend: aioredis.Redis
) -> None:
    limits = Limits(max_concurrent=1)
    now = time.time()
    await admit(queue, "r1", limits, now=now)
    await KeyLimitCounters(redis_backend).renew("key_a", ["r1"], now + 10)
    assert await admit(queue, "r2", limits, now=now + 16) == (Admission.LIMITED, "concurrency")


async def test_budget_per_period(queue: JobQueue) -> None:
    limits = Limits(budget_tokens=50, budget_period=BudgetPeriod.DAY)
    assert (await admit(queue, "r1", limits, cost=40))[0] is Admission.QUEUED
    assert await admit(queue, "r2", limits, cost=20) == (Admission.LIMITED, "budget")
    tomorrow = NOW + period_ttl_s(BudgetPeriod.DAY, NOW)
    assert (await admit(queue, "r2", limits, cost=20, now=tomorrow))[0] is Admission.QUEUED


async def test_usage_and_headers_after_admission(queue: JobQueue) -> None:
    limits = Limits(rpm=10, tpm=1000)
    result = await queue.submit(
        JOBS.name, [make_job("r1")], max_depth=100, charge=charge("r1", limits, cost=120)
    )
    assert result.usage is not None
    headers = result.usage.headers()
    assert headers["x-ratelimit-limit-requests"] == "10"
    assert headers["x-ratelimit-remaining-requests"] == "9"
    assert headers["x-ratelimit-remaining-tokens"] == "880"
    assert headers["x-ratelimit-reset-tokens"].endswith("s")


async def test_a_retried_admission_is_not_charged_twice(
    queue: JobQueue, redis_backend: aioredis.Redis
) -> None:
    limits = Limits(rpm=5)
    await admit(queue, "r1", limits)
    await admit(queue, "r1", limits)  # its first reply was lost: the retry lands again
    assert int(await redis_backend.get(names.key_window("key_a", "rpm", int(NOW // 60)))) == 1
    assert await redis_backend.xlen(JOBS.name) == 1


async def test_full_queue_charges_nothing(queue: JobQueue, redis_backend: aioredis.Redis) -> None:
    limits = Limits(rpm=5)
    result = await queue.submit(
        JOBS.name,
        [make_job("r1", i) for i in range(3)],
        max_depth=2,
        charge=charge("r1", limits),
    )
    assert result.outcome is Admission.FULL
    assert await redis_backend.get(names.key_window("key_a", "rpm", int(NOW // 60))) is None
