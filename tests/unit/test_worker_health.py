"""A worker's health: its registry entry, the engine monitor, the idle canary."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator
from typing import Any

from shared.errors import EngineDead, EngineError
from shared.protocol import (
    ErrorEvent,
    FinishEvent,
    GenerateJob,
    SamplingOptions,
    TokenEvent,
    decode,
)
from shared.queue import names
from shared.queue.job_queue import Delivery, JobQueue
from shared.queue.liveness import WorkerRegistry
from shared.tasks import cancel_and_wait
from tests.conftest import RedisTarget
from tests.unit.worker_harness import (
    JOBS,
    MODEL,
    STREAM,
    FakeEngine,
    Timing,
    entries,
    has_events,
    make_job,
    worker,
)
from tests.waiting import eventually
from workers.engines.base import Handoff, PromptTokenStats, StepOutput
from workers.health.canary import Canary
from workers.intake.checks import dead_letter
from workers.journal.run_journal import RunJournal
from workers.roles import generate


async def test_heartbeat_registers_the_worker(redis_target: RedisTarget) -> None:
    engine = FakeEngine()
    engine.prompt_stats = PromptTokenStats(computed=40, from_local_cache=8, transferred=24)
    async with worker(redis_target, engine, max_slots=3) as w:

        async def registered() -> bool:
            return bool(await w.redis.exists(names.worker_heartbeat("w-test")))

        await eventually(registered, what="the heartbeat")
        [registration] = await WorkerRegistry(w.redis, ttl_s=3.0).live_workers()
        assert registration.model == MODEL
        assert registration.role == "aggregated"  # the wire format of a role
        assert registration.slots == 3
        assert registration.draining is False
        assert registration.can_decode_alone is True
        assert registration.embedding_cache is None
        assert (registration.prompt_tokens_computed, registration.prompt_tokens_transferred) == (
            40,
            24,
        )


async def test_engine_found_dead_by_the_health_check_stops_the_worker(
    redis_target: RedisTarget,
) -> None:
    engine = FakeEngine(tokens=100_000, step_s=0.01)
    async with worker(
        redis_target, engine, shutdown_grace_s=30.0, timing=Timing(health_check_s=0.05)
    ) as w:
        await w.submit(make_job("running", max_tokens=1000))
        await eventually(functools.partial(has_events, w, "running", 2), what="the job to stream")
        engine.dead = True
        await asyncio.wait_for(asyncio.shield(w.task), 5.0)
        assert w.runtime.engine_dead is True
        assert all(isinstance(e, TokenEvent) for e in await w.events("running"))
        assert await w.redis.xlen(STREAM) == 1
        assert (await w.redis.xpending(STREAM, names.JOB_GROUP))["pending"] == 0
        assert engine.running() == 0


# ------------------------------------------------------------------------ canary


class ProbeEngine(FakeEngine):
    """Answers a canary with one token, or hangs / fails when told to."""

    def __init__(self) -> None:
        super().__init__(tokens=1, step_s=0.0)
        self.hang = False
        self.error: BaseException | None = None

    async def generate(
        self,
        job_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        *,
        handoff: Handoff | None = None,
        images: object = None,
        adapter: str | None = None,
    ) -> AsyncIterator[StepOutput]:
        self.requests.append((job_id, list(prompt_token_ids), sampling))
        if self.hang:
            await asyncio.Event().wait()
        if self.error is not None:
            raise self.error
        yield StepOutput([7], "x", None, "length", len(prompt_token_ids))


def canary(engine: ProbeEngine, *, idle_s: float) -> Canary:
    return Canary(generate.probe(engine), idle_s=idle_s, timeout_s=0.05, tick_s=0.01)


async def test_canary_marks_the_worker_not_ready_while_the_engine_hangs() -> None:
    engine = ProbeEngine()
    probe = canary(engine, idle_s=0.0)
    assert probe.healthy
    assert await probe.probe() is True

    engine.hang = True
    started = time.monotonic()
    assert await probe.probe() is False
    assert time.monotonic() - started < 5  # the probe's timeout ends it, not the hang
    assert probe.healthy is False

    engine.hang = False
    assert await probe.probe() is True
    assert probe.healthy is True

    engine.error = EngineError("sampler crashed")
    assert await probe.probe() is False
    assert probe.healthy is False
    [(job_id, prompt, sampling)] = engine.requests[:1]
    assert job_id.startswith("canary-")
    assert (prompt, sampling.max_tokens, sampling.temperature) == ([0], 1, 0.0)


async def test_canary_probes_only_an_idle_worker() -> None:
    idle, busy, recent = ProbeEngine(), ProbeEngine(), ProbeEngine()
    for engine in (idle, busy, recent):
        engine.hang = True
    canaries = {
        "idle": (canary(idle, idle_s=0.0), False),
        "busy": (canary(busy, idle_s=0.0), True),
        "recent": (canary(recent, idle_s=3600.0), False),
    }
    tasks = [
        asyncio.create_task(probe.run(functools.partial(bool, is_busy)))
        for probe, is_busy in canaries.values()
    ]
    try:

        async def idle_probed() -> bool:
            return not canaries["idle"][0].healthy

        await eventually(idle_probed, timeout_s=3.0, what="the idle worker's canary")
        # The idle one has been probed: the others had as many ticks, and were left alone.
    finally:
        await cancel_and_wait(tasks)
    assert idle.requests
    assert busy.requests == [] and canaries["busy"][0].healthy
    assert recent.requests == [] and canaries["recent"][0].healthy


# ------------------------------------------------------------ engine crashes and charges


class CrashEngine(FakeEngine):
    """Dies as soon as it is given ``poison``; a dead engine takes no new sequence."""

    async def generate(
        self,
        job_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        *,
        handoff: Handoff | None = None,
        images: object = None,
        adapter: str | None = None,
    ) -> AsyncIterator[StepOutput]:
        if job_id.startswith("poison/") or self.dead:
            self.started.append(job_id)
            self.dead = True
            raise EngineDead("the engine process exited")
        async for step in super().generate(
            job_id, prompt_token_ids, sampling, handoff=handoff, images=images, adapter=adapter
        ):
            yield step


def _request_id(fields: dict[bytes, bytes]) -> str:
    job = decode(fields)
    assert isinstance(job, GenerateJob)
    return job.request_id


async def _queue_in_order(w: Any, *request_ids: str) -> None:
    """Put the stream's entries back in this order (the poison first in the batch)."""
    found = {_request_id(fields): (eid, fields) for eid, fields in await entries(w.redis, STREAM)}
    for request_id in request_ids:
        eid, fields = found[request_id]
        await w.redis.xdel(STREAM, eid)
        await w.redis.xadd(STREAM, fields)


async def test_an_engine_crash_charges_only_the_jobs_it_was_running(
    redis_target: RedisTarget,
) -> None:
    """A job that kills every engine is dead-lettered after ``max_deliveries`` crashes;
    the neighbour read in the same batch, which never reached those engines, is not
    charged and completes."""
    await redis_target.flush()
    for crash in range(4):
        engine = CrashEngine(tokens=2)
        async with worker(redis_target, engine, fresh=False, max_deliveries=3) as w:
            if crash == 0:
                await w.submit(make_job("poison"), make_job("neighbour"))
            else:
                await _queue_in_order(w, "poison", "neighbour")
            if crash < 3:
                await asyncio.wait_for(asyncio.shield(w.task), 5.0)
                assert w.runtime.engine_dead is True
                assert "neighbour/0" not in engine.started
                continue
            [poisoned] = await w.final_events("poison")
            done = await w.final_events("neighbour")
            await w.drained()
            dead = await entries(w.redis, names.dead_letter_stream(STREAM))
    await redis_target.flush()
    assert isinstance(poisoned, ErrorEvent)
    assert (poisoned.code, poisoned.attempt) == ("job_failed_repeatedly", 3)
    assert [_request_id(fields) for _, fields in dead] == ["poison"]
    assert isinstance(done[-1], FinishEvent)
    assert engine.completed == ["neighbour/0"]


async def test_the_dead_letter_stream_keeps_only_its_newest_entries(
    redis_target: RedisTarget,
) -> None:
    await redis_target.flush()
    redis = redis_target.connect()
    try:
        [delivery] = await _read_one(redis)
        lease = await RunJournal(redis, consumer="w").begin(delivery)
        for n in range(12):
            await dead_letter(redis, lease, f"crash {n}", max_len=5)
            assert await redis.xlen(names.dead_letter_stream(STREAM)) <= 5
        reasons = [f[b"reason"] for _, f in await entries(redis, names.dead_letter_stream(STREAM))]
        assert reasons == [f"crash {n}".encode() for n in range(7, 12)]
    finally:
        await redis_target.flush()
        await redis.aclose()


async def _read_one(redis: Any) -> list[Delivery]:
    queue = JobQueue(redis)
    await queue.ensure_group(STREAM)
    await queue.submit(STREAM, [make_job("dead")], max_depth=10)
    return await queue.read([JOBS], "w", count=1, block_ms=100)
