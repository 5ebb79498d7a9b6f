"""A worker's health: its registry entry, the engine monitor, the idle canary."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import AsyncIterator

from shared.errors import EngineError
from shared.protocol import SamplingOptions, TokenEvent
from shared.queue import names
from shared.queue.liveness import WorkerRegistry
from shared.tasks import cancel_and_wait
from tests.conftest import RedisTarget
from tests.unit.worker_harness import (
    MODEL,
    STREAM,
    FakeEngine,
    Timing,
    has_events,
    make_job,
    worker,
)
from tests.waiting import eventually
from workers.engines.base import Handoff, PromptTokenStats, StepOutput
from workers.health.canary import Canary
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
    assert time.monotonic() - started < 0.5
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
