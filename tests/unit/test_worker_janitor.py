"""The janitor, through a running worker: jobs whose gateway died are aborted, a stall holds
reclaim back, an own job Redis lost the ack of runs again. (Reclaiming a dead worker's jobs:
test_worker_intake.py, where the reclaimed job resumes or is refused.)"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
import redis

from shared.protocol import FinishEvent, GenerateJob, encode
from shared.queue import names
from tests.conftest import RedisTarget
from tests.unit.worker_harness import (
    GATEWAY,
    STREAM,
    FakeEngine,
    Harness,
    Timing,
    make_job,
    worker,
)
from tests.waiting import eventually
from workers.intake.janitor import (
    JANITOR_INTERVAL_S,
    LOST_CONFIRM_S,
    LOST_ENTRY_IDLE_MS,
    SAFETY_NET_LOG,
    STALL_S,
    stall_check,
)

WORKER = "w-test"


async def test_running_job_is_aborted_once_its_gateway_stays_gone(
    redis_target: RedisTarget,
) -> None:
    engine = FakeEngine(tokens=100_000, step_s=0.01)
    async with worker(
        redis_target, engine, gateway_liveness_ttl_s=0.5, timing=Timing(orphan_check_s=0.1)
    ) as w:
        await w.submit(make_job("orphaned", max_tokens=100_000))

        async def streaming() -> bool:
            return engine.running() == 1

        await eventually(streaming, what="the job to stream")
        await w.redis.delete(names.gateway_heartbeat(GATEWAY))

        async def aborted() -> bool:
            return engine.running() == 0 and w.runtime.active_jobs() == 0

        await eventually(aborted, what="the orphaned job to be aborted", timeout_s=5.0)


def test_without_a_heartbeat_thread_a_late_pass_is_a_stall() -> None:
    stalled = stall_check(None, ttl_s=1.5, interval_s=0.5)
    assert not stalled(0.5)
    assert not stalled(0.5 + STALL_S)
    assert stalled(0.5 + STALL_S + 0.01)


async def _pending_to_this_worker(w: Harness, job: GenerateJob) -> None:
    """The job is in the worker's pending list but the worker never got it: what Redis
    leaves behind when it loses an ack the worker saw succeed (or a read's reply)."""
    async with w.redis.pipeline(transaction=True) as pipe:
        pipe.xadd(STREAM, encode(job))
        pipe.xreadgroup(names.JOB_GROUP, WORKER, {STREAM: ">"}, count=1)
        await pipe.execute()


async def _warm(w: Harness) -> None:
    await w.submit(make_job("warm"))
    await w.final_events("warm")


def _lines(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if text in r.getMessage()]


async def test_an_own_job_redis_lost_the_ack_of_runs_again_after_the_trouble(
    redis_target: RedisTarget, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker stalls (as Redis does in a fail-over), then finds a job pending to it
    that it holds no trace of: it runs the job again within seconds, as the fail-over's
    loss, not the 30 s stale-entry safety net."""
    async with worker(redis_target, FakeEngine(tokens=3), worker_id=WORKER) as w:
        await _warm(w)
        time.sleep(JANITOR_INTERVAL_S + STALL_S + 0.2)  # noqa: ASYNC251 (the worker stalls)
        await _pending_to_this_worker(w, make_job("lost"))
        started = time.monotonic()
        events = await w.final_events("lost", timeout_s=10.0)
        took_s = time.monotonic() - started
        await w.drained()
    assert isinstance(events[-1], FinishEvent)
    assert [job_id for job_id, _, _ in w.engine.requests].count("lost/0") == 1
    assert took_s < 5.0
    assert _lines(caplog, "Redis lost their acks")
    assert not _lines(caplog, SAFETY_NET_LOG)


async def test_an_own_job_pending_with_no_trouble_runs_but_is_logged_as_the_safety_net(
    redis_target: RedisTarget, caplog: pytest.LogCaptureFixture
) -> None:
    async with worker(redis_target, FakeEngine(tokens=3), worker_id=WORKER) as w:
        await _warm(w)
        await _pending_to_this_worker(w, make_job("lost"))
        events = await w.final_events("lost", timeout_s=10.0)
        await w.drained()
    assert isinstance(events[-1], FinishEvent)
    assert _lines(caplog, SAFETY_NET_LOG)
    assert not _lines(caplog, "Redis lost their acks")


async def test_jobs_starting_running_or_writing_are_never_taken_for_lost(
    redis_target: RedisTarget, caplog: pytest.LogCaptureFixture
) -> None:
    """Long runs (renewed, idle past the lost-entry age between renewals never) and a
    stream of short ones, with the check on every 20 ms pass: each job runs once."""
    caplog.set_level(logging.WARNING)
    engine = FakeEngine(tokens=300, step_s=0.01)
    async with worker(redis_target, engine, worker_id=WORKER, timing=Timing(janitor_s=0.02)) as w:
        await w.submit(*(make_job(f"long{i}", max_tokens=250) for i in range(3)))
        for i in range(20):
            await w.submit(make_job(f"short{i}", max_tokens=2))
            await w.final_events(f"short{i}")
        for i in range(3):
            await w.final_events(f"long{i}", timeout_s=15.0)
        await w.drained()
    ran = [job_id for job_id, _, _ in engine.requests]
    assert len(ran) == len(set(ran)) == 23
    assert not _lines(caplog, SAFETY_NET_LOG)
    assert not _lines(caplog, "Redis lost their acks")


@pytest.mark.redis
@pytest.mark.parametrize("redis_target", ["real"], indirect=True)
async def test_a_read_whose_reply_waited_out_a_stall_is_started_once(
    redis_target: RedisTarget, caplog: pytest.LogCaptureFixture
) -> None:
    """Redis hands the worker a job while the worker's event loop stalls: the entry is
    idle past the lost-entry age before the worker has read the reply. The janitor's
    next pass sees it idle and not in hand, but waits to see it so again: by then the
    consumer has it, and it runs once. (Real Redis: fakeredis serves no blocked read
    while the loop stalls.)"""
    caplog.set_level(logging.WARNING)
    engine = FakeEngine(tokens=3)
    producer = redis.Redis.from_url(redis_target.url)
    try:
        async with worker(redis_target, engine, worker_id=WORKER) as w:
            await _warm(w)
            await asyncio.sleep(0.2)  # the worker's next read is waiting on Redis
            producer.xadd(STREAM, encode(make_job("late")))
            time.sleep(LOST_ENTRY_IDLE_MS / 1000 + 0.5)  # noqa: ASYNC251 (the worker stalls)
            await w.final_events("late")
            await asyncio.sleep(LOST_CONFIRM_S + 2 * JANITOR_INTERVAL_S)
            await w.drained()
    finally:
        producer.close()
    assert [job_id for job_id, _, _ in engine.requests].count("late/0") == 1
    assert not _lines(caplog, SAFETY_NET_LOG)
    assert not _lines(caplog, "Redis lost their acks")
