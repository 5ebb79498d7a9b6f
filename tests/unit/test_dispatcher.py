"""Admission rides out a short Redis outage and gives up cleanly on a long one."""

from __future__ import annotations

from typing import Any

import fakeredis.aioredis
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.dispatch.dispatcher import AdmissionPolicy, Dispatcher
from gateway.dispatch.plan import Deadline, Generation, RequestPlan
from gateway.dispatch.reply_router import ReplyRouter
from gateway.dispatch.worker_directory import WorkerDirectory
from shared.protocol import GenerateJob, SamplingOptions
from shared.queue.job_queue import Admission, AdmissionResult
from shared.queue.liveness import WorkerRegistry


def dispatcher(retry_s: float) -> Dispatcher:
    redis = fakeredis.aioredis.FakeRedis()
    return Dispatcher(
        redis,
        ReplyRouter(redis, "conveyor:reply:gw-test"),
        WorkerDirectory(WorkerRegistry(redis, ttl_s=3.0)),
        AdmissionPolicy(
            queue_max_depth=10,
            idempotency_ttl_s=60,
            disagg_min_prompt_tokens=128,
            admission_retry_s=retry_s,
        ),
    )


def job() -> GenerateJob:
    return GenerateJob(
        request_id="r1",
        index=0,
        model="m",
        prompt_token_ids=[1, 2],
        sampling=SamplingOptions(max_tokens=4),
        reply_to="conveyor:reply:gw-test",
        deadline_unix=0.0,
        created_unix=0.0,
    )


PLAN = RequestPlan("r1", "m", Generation((), ()), Deadline(0.0, 0.0), None)


class FlakyQueue:
    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.calls = 0

    async def submit(self, *_: Any, **__: Any) -> AdmissionResult:
        self.calls += 1
        if self.calls <= self.failures:
            raise RedisConnectionError("Connection refused")
        return AdmissionResult(Admission.QUEUED, "1")


async def test_admission_retries_through_a_short_outage() -> None:
    d = dispatcher(retry_s=5.0)
    d._queue = FlakyQueue(failures=2)  # type: ignore[assignment]
    result = await d._admit("conveyor:jobs:m:aggregated", [job()], PLAN)
    assert result.outcome is Admission.QUEUED
    assert d._queue.calls == 3  # type: ignore[attr-defined]


async def test_admission_gives_up_after_its_retry_window() -> None:
    d = dispatcher(retry_s=0.3)
    d._queue = FlakyQueue(failures=1000)  # type: ignore[assignment]
    with pytest.raises(RedisConnectionError):
        await d._admit("conveyor:jobs:m:aggregated", [job()], PLAN)
    assert 1 < d._queue.calls < 10  # type: ignore[attr-defined]
