"""The worker loop end to end, on fakeredis and on the real Redis: jobs stream and are
acked, slots are respected, failures end cleanly, and the way out (stop, a dead engine,
a journal that gave up) hands unfinished jobs back.

Cancels: test_worker_cancels.py; intake checks, resume and migration:
test_worker_intake.py; reclaim and orphans: test_worker_janitor.py; heartbeat, engine
monitor and canary: test_worker_health.py.
"""

from __future__ import annotations

import asyncio
import functools

import msgspec
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from shared.errors import EngineDead, EngineError
from shared.protocol import ErrorEvent, FinishEvent, TokenEvent
from shared.queue import names
from tests.conftest import RedisTarget
from tests.journal_faults import FaultyScripts
from tests.unit.finish_events import unstamped
from tests.unit.worker_harness import (
    STAGE,
    STREAM,
    FakeEngine,
    Timing,
    earlier_run,
    emitted_tokens,
    has_events,
    make_job,
    run_keys,
    worker,
)
from tests.waiting import eventually


async def test_job_streams_tokens_then_finish_and_is_acked(redis_target: RedisTarget) -> None:
    async with worker(redis_target, FakeEngine(tokens=4)) as w:
        await w.submit(make_job("r1", max_tokens=16))
        events = await w.final_events("r1")
        *tokens, finish = events
        assert [type(e) for e in tokens] == [TokenEvent] * 4
        assert [e.seq for e in events] == [0, 1, 2, 3, 4]
        assert [e.token_ids for e in tokens] == [[100], [101], [102], [103]]  # type: ignore[union-attr]
        assert "".join(e.text for e in tokens) == "<0><1><2><3>"  # type: ignore[union-attr]
        assert unstamped(finish) == FinishEvent("r1", 0, 4, 0, "stop", 3, 4)
        await w.drained()
        assert w.engine.running() == 0
        assert w.engine.started == ["r1/0"]
        # Nothing of the finished run is left behind.
        assert await w.redis.exists(*run_keys("r1/0")) == 0


async def test_max_tokens_gives_length(redis_target: RedisTarget) -> None:
    async with worker(redis_target, FakeEngine(tokens=50)) as w:
        await w.submit(make_job("r1", max_tokens=3))
        events = await w.final_events("r1")
        assert len(events) == 4
        assert isinstance(events[-1], FinishEvent)
        assert events[-1].finish_reason == "length"
        assert events[-1].completion_tokens == 3
        await w.drained()


async def test_choices_of_one_request_are_numbered_separately(redis_target: RedisTarget) -> None:
    async with worker(redis_target, FakeEngine(tokens=3)) as w:
        await w.submit(*(make_job("r1", index) for index in range(3)))
        events = await w.final_events("r1", sequences=3)
        for index in range(3):
            mine = [e for e in events if e.index == index]
            assert [e.seq for e in mine] == [0, 1, 2, 3]
            assert isinstance(mine[-1], FinishEvent)
        await w.drained()


async def test_deadline_passing_while_generating_gives_504(redis_target: RedisTarget) -> None:
    engine = FakeEngine(tokens=100_000, step_s=0.01)
    async with worker(redis_target, engine) as w:
        await w.submit(make_job("slow", max_tokens=100_000, deadline_in_s=0.3))
        events = await w.final_events("slow")
        *tokens, last = events
        assert tokens and all(isinstance(e, TokenEvent) for e in tokens)
        assert isinstance(last, ErrorEvent)
        assert last.status == 504
        assert [e.seq for e in events] == list(range(len(events)))
        await w.drained()
        assert engine.running() == 0


async def test_max_slots_is_respected(redis_target: RedisTarget) -> None:
    engine = FakeEngine(tokens=5, step_s=0.01)
    async with worker(redis_target, engine, max_slots=2) as w:
        await w.submit(*(make_job(f"r{i}") for i in range(6)))

        async def all_done() -> bool:
            return len(engine.completed) == 6

        await eventually(all_done, what="six jobs")
        assert engine.peak == 2
        for i in range(6):
            assert isinstance((await w.final_events(f"r{i}"))[-1], FinishEvent)
        await w.drained()


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (EngineError("kv cache exploded"), 500, "engine_error"),
        (RuntimeError("adapter bug"), 500, "engine_error"),
    ],
    ids=["engine-error", "unexpected-exception"],
)
async def test_engine_failure_mid_stream_gives_error_event(
    redis_target: RedisTarget, error: BaseException, status: int, code: str
) -> None:
    engine = FakeEngine(tokens=10)
    engine.fail = (2, error)
    async with worker(redis_target, engine) as w:
        await w.submit(make_job("bad"))
        events = await w.final_events("bad")
        assert [type(e) for e in events] == [TokenEvent, TokenEvent, ErrorEvent]
        last = events[-1]
        assert isinstance(last, ErrorEvent)
        assert (last.seq, last.status, last.code) == (2, status, code)
        await w.drained()
        # The worker keeps serving.
        engine.fail = None
        await w.submit(make_job("next"))
        assert isinstance((await w.final_events("next"))[-1], FinishEvent)


async def test_handoff_goes_to_a_fresh_decode_but_not_to_a_resumed_one(
    redis_target: RedisTarget,
) -> None:
    fresh = msgspec.structs.replace(make_job("fresh"), handoff={"room": 7})
    resumed = msgspec.structs.replace(make_job("resumed"), handoff={"room": 8})

    async def crashed_mid_stream(redis: aioredis.Redis) -> None:
        await earlier_run(redis, resumed, tokens=[[100]], hand_back=True)

    engine = FakeEngine(tokens=2)
    async with worker(redis_target, engine, setup=crashed_mid_stream) as w:
        await w.submit(fresh)
        await w.final_events("fresh")
        await w.final_events("resumed")
    handoffs = dict(zip(engine.started, engine.handoffs, strict=True))
    # A resumed run recomputes prompt + emitted tokens: the prefilled KV is stale.
    assert handoffs == {"fresh/0": {"room": 7}, "resumed/0": None}


# ------------------------------------------------------------------ stop and hand back


async def test_stop_lets_running_jobs_finish(redis_target: RedisTarget) -> None:
    engine = FakeEngine(tokens=20, step_s=0.01)
    async with worker(redis_target, engine, shutdown_grace_s=5.0) as w:
        await w.submit(make_job("r1"))

        async def started() -> bool:
            return engine.running() == 1

        await eventually(started, what="the job to start")
        w.runtime.stop()
        await asyncio.wait_for(asyncio.shield(w.task), 5.0)
        assert isinstance((await w.events("r1"))[-1], FinishEvent)
        await w.drained()
        assert await w.redis.exists(names.worker_heartbeat("w-test")) == 0


async def test_stop_without_grace_hands_running_jobs_back(redis_target: RedisTarget) -> None:
    engine = FakeEngine(tokens=100_000, step_s=0.01)
    async with worker(redis_target, engine, shutdown_grace_s=0.0) as w:
        await w.submit(make_job("moving", max_tokens=1000))
        await eventually(functools.partial(has_events, w, "moving", 3), what="the job to stream")
        w.runtime.stop()
        await asyncio.wait_for(asyncio.shield(w.task), 5.0)

        sent = await w.events("moving")
        assert all(isinstance(e, TokenEvent) for e in sent)  # no finish, no error
        assert [e.seq for e in sent] == list(range(len(sent)))
        journaled = await emitted_tokens(w.redis, "moving/0")
        assert journaled == [t for e in sent for t in e.token_ids]
        run = await w.redis.hgetall(names.job_run("moving/0", STAGE))
        assert b"owner" not in run
        assert int(run[b"seq"]) == len(sent)
        assert run[b"starts"] == b"0"  # a hand-back is not a failed delivery
        assert await w.redis.xlen(STREAM) == 1  # queued again...
        pending = await w.redis.xpending(STREAM, names.JOB_GROUP)
        assert pending["pending"] == 0  # ...and the delivery it had is acked
        assert engine.cancelled == ["moving/0"]
        assert await w.redis.exists(names.worker_heartbeat("w-test")) == 0

        # Another worker picks it up and continues where this one stopped.
        successor = FakeEngine(tokens=3)
        async with worker(redis_target, successor, fresh=False, worker_id="w-next") as w2:
            events = await w2.final_events("moving")
            await w2.drained()
        assert events[: len(sent)] == sent
        assert [e.seq for e in events] == list(range(len(sent) + 4))
        [(_, prompt, sampling)] = successor.requests
        assert prompt == [1, 2, 3, *journaled]
        assert sampling.max_tokens == 1000 - len(journaled)
        # The successor's run keeps the attempt number of the run that handed it back.
        assert unstamped(events[-1]) == FinishEvent(
            "moving", 0, len(sent) + 3, 0, "stop", 3, len(sent) + 3
        )
        assert {e.attempt for e in events} == {0}


async def test_hand_backs_never_dead_letter_a_job(redis_target: RedisTarget) -> None:
    """Rolling restarts: every worker is stopped mid-stream and hands the job back."""
    hand_backs = 4
    strict = {"max_deliveries": 1, "migration_limit": 1}  # ONE counted failure would end it
    await redis_target.flush()
    sent: list[TokenEvent] = []
    try:
        for n in range(hand_backs):
            engine = FakeEngine(tokens=100_000, step_s=0.005)
            async with worker(redis_target, engine, fresh=False, worker_id=f"w-{n}", **strict) as w:
                if n == 0:
                    await w.submit(make_job("rolling", max_tokens=1000))

                streamed_more = functools.partial(has_events, w, "rolling", len(sent) + 2)
                await eventually(streamed_more, what=f"worker {n} to stream")
                w.runtime.stop()
                await asyncio.wait_for(asyncio.shield(w.task), 5.0)
                sent = await w.events("rolling")
                assert all(isinstance(e, TokenEvent) for e in sent)
                assert engine.cancelled == ["rolling/0"]
                assert await w.redis.hget(names.job_run("rolling/0", STAGE), "starts") == b"0"

        last = FakeEngine(tokens=3)
        async with worker(redis_target, last, fresh=False, worker_id="w-last", **strict) as w:
            events = await w.final_events("rolling")
            await w.drained()
            assert await w.redis.xlen(names.dead_letter_stream(STREAM)) == 0
    finally:
        await redis_target.flush()
    assert events[: len(sent)] == sent
    assert isinstance(events[-1], FinishEvent)
    assert events[-1].finish_reason == "stop"
    assert [e.seq for e in events] == list(range(len(events)))
    assert {e.attempt for e in events} == {0}
    [(_, prompt, _)] = last.requests
    assert prompt == [1, 2, 3, *(t for e in sent for t in e.token_ids)]


async def test_engine_dead_mid_stream_stops_the_worker_and_hands_jobs_back(
    redis_target: RedisTarget,
) -> None:
    engine = FakeEngine(tokens=10)
    engine.fail = (2, EngineDead("CUDA error: device lost"))
    async with worker(redis_target, engine, shutdown_grace_s=30.0) as w:
        await w.submit(make_job("a"), make_job("b"))
        await asyncio.wait_for(asyncio.shield(w.task), 5.0)
        assert w.runtime.engine_dead is True
        assert w.task.exception() is None
        for request_id in ("a", "b"):
            sent = await w.events(request_id)
            assert [type(e) for e in sent] == [TokenEvent, TokenEvent]  # no error to clients
            assert await emitted_tokens(w.redis, f"{request_id}/0") == [100, 101]
        assert await w.redis.xlen(STREAM) == 2
        assert (await w.redis.xpending(STREAM, names.JOB_GROUP))["pending"] == 0


async def test_a_job_that_kills_the_engine_is_dead_lettered(redis_target: RedisTarget) -> None:
    """An engine death is no graceful hand-back: it counts toward max_deliveries."""
    await redis_target.flush()
    try:
        for n in range(2):
            killed = FakeEngine()
            killed.fail = (0, EngineDead("CUDA error: an illegal memory access"))
            async with worker(
                redis_target, killed, fresh=False, worker_id=f"w-{n}", max_deliveries=2
            ) as w:
                if n == 0:
                    await w.submit(make_job("killer"))
                await asyncio.wait_for(asyncio.shield(w.task), 5.0)
                assert w.runtime.engine_dead is True
                assert killed.started == ["killer/0"]

        engine = FakeEngine()
        async with worker(
            redis_target, engine, fresh=False, worker_id="w-next", max_deliveries=2
        ) as w:
            events = await w.final_events("killer")
            dead_letters = await w.redis.xlen(names.dead_letter_stream(STREAM))
    finally:
        await redis_target.flush()
    assert engine.started == []
    assert isinstance(events[-1], ErrorEvent)
    assert (events[-1].code, events[-1].attempt) == ("job_failed_repeatedly", 2)
    assert dead_letters == 1


async def test_a_journal_that_gave_up_stops_the_worker_and_its_jobs_are_reclaimed(
    redis_target: RedisTarget,
) -> None:
    engine = FakeEngine(tokens=100_000, step_s=0.01)

    def writes_down(redis: aioredis.Redis) -> FaultyScripts:
        scripts = FaultyScripts(redis)
        scripts.writes_down = True
        return scripts

    async with worker(
        redis_target,
        engine,
        shutdown_grace_s=30.0,
        scripts=writes_down,
        timing=Timing(janitor_s=0.02, journal_retry_s=0.1),
    ) as w:
        await w.submit(make_job("stranded", max_tokens=100_000))
        # Nobody calls stop(): the worker sees its journal give up and exits at once
        # (the grace period would only let jobs publish into a journal nobody sends).
        await asyncio.wait_for(asyncio.shield(w.task), 2.0)
        assert w.task.exception() is None
        assert (w.runtime.journal_failed, w.runtime.engine_dead) == (True, False)
        assert engine.running() == 0
        assert engine.cancelled == ["stranded/0"]
        assert await w.events("stranded") == []  # nothing it streamed ever landed
        # Not handed back: the job stays pending to this worker for another to reclaim.
        [pending] = await w.redis.xpending_range(STREAM, names.JOB_GROUP, "-", "+", 10)
        assert pending["consumer"] == b"w-test"

        successor = FakeEngine(tokens=3)
        async with worker(
            redis_target,
            successor,
            fresh=False,
            worker_id="w-next",
            claim_idle_s=0.05,
            timing=Timing(janitor_s=0.02),
        ) as w2:
            events = await w2.final_events("stranded")
            await w2.drained()
    assert [e.seq for e in events] == [0, 1, 2, 3]
    # The lost run counts as a failed one; nothing was journaled, so it restarts.
    assert unstamped(events[-1]) == FinishEvent("stranded", 0, 3, 1, "stop", 3, 3)
    assert successor.requests[0][1] == [1, 2, 3]


# ------------------------------------------------------------- bursts and start failures


async def test_a_burst_of_jobs_in_one_read_starts_on_a_few_connections(
    redis_target: RedisTarget,
) -> None:
    """64 deliveries in one read are leased in one round trip, not one connection each:
    with a pool of 8 connections (the old code needed 2 per delivery) all run at once."""
    if redis_target.kind == "fake":
        pytest.skip("fakeredis has no connection pool to exhaust")
    small_pool = aioredis.ConnectionPool.from_url(redis_target.url, max_connections=8)

    def connect_small() -> aioredis.Redis:
        return aioredis.Redis(connection_pool=small_pool)

    target = RedisTarget(kind="real", url=redis_target.url)
    target.connect = connect_small  # type: ignore[method-assign]
    async with worker(target, FakeEngine(tokens=2), max_slots=64) as w:
        jobs = [make_job("burst", index=i, max_tokens=2) for i in range(64)]
        await w.submit(*jobs)
        # Bounded well under the 30 s stale-entry reclaim that the old code waited for.
        await w.final_events("burst", sequences=64, timeout_s=10.0)
        await w.drained()
    await small_pool.aclose()


async def test_a_start_that_fails_is_tried_again_at_once(redis_target: RedisTarget) -> None:
    """Redis fails the lease of a fresh delivery: the worker starts it again right away
    instead of leaving it pending for the stale-entry reclaim (30 s)."""
    faulty: list[FaultyScripts] = []

    def flaky_begins(redis: aioredis.Redis) -> FaultyScripts:
        scripts = FaultyScripts(redis)
        scripts.fail_begins += [RedisConnectionError("Too many connections")] * 2
        faulty.append(scripts)
        return scripts

    async with worker(redis_target, FakeEngine(tokens=2), scripts=flaky_begins) as w:
        await w.submit(make_job("flaky", max_tokens=2))
        # Bounded well under the 30 s stale-entry reclaim.
        events = await w.final_events("flaky", timeout_s=10.0)
        assert faulty[0].fail_begins == []  # both failures happened
        assert events[-1].attempt == 0  # started again by the worker, not reclaimed
        await w.drained()
