"""Placement through running workers: a worker runs the jobs placed on it, steals another's
after the bound, moves a dead worker's unread jobs back, and moves its own back as it stops."""

from __future__ import annotations

import msgspec

from shared.protocol import FinishEvent
from shared.queue import names
from shared.queue.job_queue import JobStream
from shared.queue.liveness import WorkerRegistration
from shared.queue.worker_commands import Command, CommandStatus, send_worker_command
from tests.conftest import RedisTarget
from tests.unit.worker_harness import (
    FAST_JANITOR,
    MODEL,
    STAGE,
    STREAM,
    FakeEngine,
    Harness,
    make_job,
    worker,
)
from tests.waiting import eventually

POOL = JobStream(MODEL, STAGE)


async def place(w: Harness, worker_id: str, request_id: str) -> None:
    result = await w.queue.submit(
        STREAM, [make_job(request_id)], max_depth=100, placed_on=worker_id
    )
    assert result.placed_on == worker_id, result


async def registration(w: Harness, worker_id: str) -> WorkerRegistration:
    raw = await w.redis.get(names.worker_heartbeat(worker_id))
    assert raw is not None
    return msgspec.json.decode(raw, type=WorkerRegistration)


async def test_a_worker_runs_the_jobs_placed_on_it(redis_target: RedisTarget) -> None:
    async with worker(redis_target, worker_id="w1", placement=True) as w:

        async def registered() -> bool:
            return bool(await w.redis.exists(names.worker_heartbeat("w1")))

        await eventually(registered, what="the worker's heartbeat")
        assert (await registration(w, "w1")).reads_placed
        await place(w, "w1", "mine")
        events = await w.final_events("mine")
        assert isinstance(events[-1], FinishEvent)
        await w.drained()
        assert await w.redis.xlen(POOL.own("w1").name) == 0


async def test_an_idle_worker_steals_a_job_left_unread_past_the_bound(
    redis_target: RedisTarget,
) -> None:
    engine = FakeEngine()
    async with worker(
        redis_target, engine, worker_id="thief", placement=True, placement_steal_ms=50
    ) as w:
        await w.redis.set(names.worker_heartbeat("busy"), b"{}", px=60_000)  # never reads
        await place(w, "busy", "waiting")
        events = await w.final_events("waiting")
        assert isinstance(events[-1], FinishEvent)
        assert w.engine.started and w.runtime.active_jobs() == 0

        async def counted() -> bool:
            return (await registration(w, "thief")).steals == 1

        await eventually(counted, what="the steal in the heartbeat")
        assert await w.redis.xlen(POOL.own("busy").name) == 0  # acked there


async def test_a_dead_workers_unread_jobs_run_elsewhere(redis_target: RedisTarget) -> None:
    async with worker(
        redis_target,
        worker_id="alive",
        placement=True,
        placement_steal_ms=60_000,  # no steal: the janitor's requeue must do it
        timing=FAST_JANITOR,
    ) as w:
        await w.redis.set(names.worker_heartbeat("dead"), b"{}", px=60_000)
        await place(w, "dead", "orphan")
        await w.redis.delete(names.worker_heartbeat("dead"))
        events = await w.final_events("orphan")
        assert isinstance(events[-1], FinishEvent)

        async def forgotten() -> bool:
            members = await w.redis.smembers(names.placed_workers(STREAM))
            return b"dead" not in members

        await eventually(forgotten, what="the dead worker's stream to be forgotten")


async def test_a_stopping_worker_moves_its_unread_jobs_back(redis_target: RedisTarget) -> None:
    engine = FakeEngine(tokens=1_000, step_s=0.01)
    async with worker(redis_target, engine, worker_id="w1", placement=True, max_slots=1) as w:
        await eventually(
            lambda: _exists(w, names.worker_heartbeat("w1")), what="the worker's heartbeat"
        )
        await place(w, "w1", "running")

        async def running() -> bool:
            return engine.running() == 1

        await eventually(running, what="the first job to run")
        await place(w, "w1", "queued")  # no free slot: stays unread
        w.runtime.stop()

        async def moved() -> bool:
            shared = await w.redis.xrange(STREAM)
            return any(b"queued" in fields[b"m"] for _, fields in shared)

        await eventually(moved, what="the unread job on the shared stream")
        assert await w.redis.xlen(POOL.own("w1").name) <= 1  # only the running one


async def _exists(w: Harness, key: str) -> bool:
    return bool(await w.redis.exists(key))


async def test_a_paused_worker_moves_jobs_placed_on_it_back(redis_target: RedisTarget) -> None:
    async with worker(redis_target, worker_id="w1", placement=True, timing=FAST_JANITOR) as w:
        await w.listening()
        result = await send_worker_command(w.redis, "w1", Command.DRAIN, 5.0)
        assert result.status == CommandStatus.OK
        await place(w, "w1", "late")  # placed by a gateway that had not seen the drain yet

        async def moved() -> bool:
            shared = await w.redis.xrange(STREAM)
            return any(b"late" in fields[b"m"] for _, fields in shared)

        await eventually(moved, what="the placed job on the shared stream")
        assert await w.redis.xlen(POOL.own("w1").name) == 0
