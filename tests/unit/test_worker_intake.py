"""The intake checks between a delivery and the engine, through a running worker: jobs of
gone clients are dropped, late ones fail with 504, jobs that failed too often are
dead-lettered, and a job taken over mid-stream resumes (or ends cleanly when it may not)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis

from shared.protocol import ErrorEvent, FinishEvent, GenerateJob, TokenEvent, decode
from shared.queue import names
from shared.queue.liveness import WorkerRegistry
from tests.conftest import RedisTarget
from tests.unit.finish_events import unstamped
from tests.unit.worker_harness import (
    FAST_JANITOR,
    STAGE,
    STREAM,
    FakeEngine,
    earlier_run,
    entries,
    make_job,
    run_keys,
    with_sampling,
    worker,
)
from tests.waiting import eventually

# ----------------------------------------------------------------- gone clients, deadline


async def test_cancel_flag_set_before_dequeue_drops_the_job(redis_target: RedisTarget) -> None:
    async with worker(redis_target) as w:
        await w.redis.set(names.cancel_flag("gone"), b"1")
        await w.submit(make_job("gone"), make_job("gone", 1))
        await w.submit(make_job("stays"))
        await w.final_events("stays")
        await w.drained()
        assert await w.events("gone") == []
        assert all(not job.startswith("gone/") for job in w.engine.started)


async def test_job_of_a_dead_gateway_is_dropped(redis_target: RedisTarget) -> None:
    async with worker(redis_target, gateway_alive=False, gateway_liveness_ttl_s=0.0) as w:
        await w.submit(make_job("orphan"))
        await w.drained()
        assert await w.events("orphan") == []
        assert w.engine.started == []


async def test_a_gateway_key_missing_for_a_moment_does_not_drop_its_job(
    redis_target: RedisTarget,
) -> None:
    """A stalled gateway or a restarted Redis must not make a live gateway's client hang."""
    async with worker(redis_target, gateway_alive=False, gateway_liveness_ttl_s=60.0) as w:
        await w.submit(make_job("kept"))
        assert isinstance((await w.final_events("kept"))[-1], FinishEvent)


async def test_deadline_passed_in_queue_gives_504(redis_target: RedisTarget) -> None:
    async with worker(redis_target) as w:
        await w.submit(make_job("late", deadline_in_s=-1.0))
        [event] = await w.final_events("late")
        assert isinstance(event, ErrorEvent)
        assert (event.status, event.type, event.code, event.seq) == (
            504,
            "timeout",
            "deadline_exceeded",
            0,
        )
        await w.drained()
        assert w.engine.started == []


# ----------------------------------------------------------- resume and migration


async def test_reclaimed_job_resumes_after_the_tokens_already_sent(
    redis_target: RedisTarget,
) -> None:
    job = with_sampling(make_job("r1", max_tokens=16), min_tokens=5)
    before: list[TokenEvent] = []

    async def crashed_worker(redis: aioredis.Redis) -> None:
        events, _ = await earlier_run(redis, job, tokens=[[100], [101, 102]])
        before.extend(events)

    engine = FakeEngine(tokens=4)
    async with worker(
        redis_target, engine, setup=crashed_worker, claim_idle_s=0.1, timing=FAST_JANITOR
    ) as w:
        events = await w.final_events("r1")
        await w.drained()
        await reported_reclaims(w.redis, 1)

    [(job_id, prompt, sampling)] = engine.requests
    assert job_id == "r1/0"
    assert prompt == [1, 2, 3, 100, 101, 102]
    assert (sampling.max_tokens, sampling.min_tokens) == (13, 2)
    assert msgspec.structs.replace(sampling, max_tokens=16, min_tokens=5) == job.sampling
    assert events[:2] == before
    assert [e.seq for e in events] == list(range(7))
    assert [e.attempt for e in events] == [0, 0, 1, 1, 1, 1, 1]
    assert unstamped(events[-1]) == FinishEvent("r1", 0, 6, 1, "stop", 3, 7)


async def reported_reclaims(redis: aioredis.Redis, count: int) -> None:
    """The worker's heartbeat reports the jobs it reclaimed (conveyor_worker_reclaims)."""
    registry = WorkerRegistry(redis, ttl_s=60)

    async def reported() -> bool:
        return any(w.reclaims == count for w in await registry.live_workers())

    await eventually(reported, what=f"{count} reclaim(s) in the heartbeat")


async def test_resumed_job_with_no_room_left_finishes_with_length(
    redis_target: RedisTarget,
) -> None:
    job = make_job("full", max_tokens=2)

    async def handed_back(redis: aioredis.Redis) -> None:
        await earlier_run(redis, job, tokens=[[100], [101]], hand_back=True)

    engine = FakeEngine(tokens=4)
    async with worker(redis_target, engine, setup=handed_back) as w:
        events = await w.final_events("full")
        await w.drained()
    assert engine.requests == []
    # Handed back, not crashed: the run that finishes it keeps attempt 0.
    assert unstamped(events[-1]) == FinishEvent("full", 0, 2, 0, "length", 3, 2)


@pytest.mark.parametrize(
    "sampling",
    [
        {"json_schema": '{"type": "object"}', "temperature": 0.0},
        {"json_object": True, "seed": 7},
    ],
    ids=["json-schema-greedy", "json-object-seeded"],
)
async def test_deterministic_guided_job_is_replayed_not_appended(
    redis_target: RedisTarget, sampling: dict[str, Any]
) -> None:
    """A grammar cannot continue after appended tokens: the prompt runs again and the
    tokens the client has are regenerated, checked and not sent twice."""
    job = with_sampling(make_job("forced", max_tokens=16), **sampling)
    before: list[TokenEvent] = []

    async def crashed_worker(redis: aioredis.Redis) -> None:
        events, _ = await earlier_run(redis, job, tokens=[[100], [101]])
        before.extend(events)

    engine = FakeEngine(tokens=4)  # regenerates 100, 101, then 102, 103
    async with worker(
        redis_target, engine, setup=crashed_worker, claim_idle_s=0.1, timing=FAST_JANITOR
    ) as w:
        events = await w.final_events("forced")
        await w.drained()

    [(_, prompt, resumed_sampling)] = engine.requests
    # the migrated job finds its request's stored schema (queued once, apart from the job)
    as_queued = msgspec.structs.replace(resumed_sampling, json_schema_stored=False)
    assert (prompt, as_queued) == ([1, 2, 3], job.sampling)
    assert events[:2] == before
    tokens = [e.token_ids for e in events if isinstance(e, TokenEvent)]
    assert tokens == [[100], [101], [102], [103]]
    assert [e.seq for e in events] == list(range(5))
    assert unstamped(events[-1]) == FinishEvent("forced", 0, 4, 1, "stop", 3, 4)


@pytest.mark.parametrize("tokens_per_step", [2, 3], ids=["ends-on-a-step", "straddles-a-step"])
async def test_a_replay_whose_steps_group_tokens_sends_only_what_is_new(
    redis_target: RedisTarget, tokens_per_step: int
) -> None:
    """A busy engine puts several tokens in one step; a step that holds the last tokens
    sent and new ones is cut, text included, where the client's stream ended."""
    job = with_sampling(make_job("forced", max_tokens=16), json_object=True, temperature=0.0)
    before: list[TokenEvent] = []

    async def crashed_worker(redis: aioredis.Redis) -> None:
        events, _ = await earlier_run(redis, job, tokens=[[100], [101]])
        before.extend(events)

    engine = FakeEngine(tokens=5, tokens_per_step=tokens_per_step)
    async with worker(
        redis_target, engine, setup=crashed_worker, claim_idle_s=0.1, timing=FAST_JANITOR
    ) as w:
        events = await w.final_events("forced")
        await w.drained()
    assert events[: len(before)] == before
    sent = [e for e in events if isinstance(e, TokenEvent)]
    assert [t for e in sent for t in e.token_ids] == [100, 101, 102, 103, 104]
    assert "".join(e.text for e in sent) == "<0><1><2><3><4>"
    assert unstamped(events[-1]).completion_tokens == 5


@pytest.mark.parametrize(
    ("earlier", "why"),
    [([[100], [999]], "differed"), ([[100], [101], [102], [103], [104]], "ended before")],
    ids=["diverged", "shorter"],
)
async def test_a_replay_that_does_not_match_ends_with_a_clean_error(
    redis_target: RedisTarget, earlier: list[list[int]], why: str
) -> None:
    job = with_sampling(make_job("forced", max_tokens=16), json_object=True, temperature=0.0)

    async def crashed_worker(redis: aioredis.Redis) -> None:
        await earlier_run(redis, job, tokens=earlier)

    async with worker(
        redis_target,
        FakeEngine(tokens=4),
        setup=crashed_worker,
        claim_idle_s=0.1,
        timing=FAST_JANITOR,
    ) as w:
        events = await w.final_events("forced")
        await w.drained()
        assert await w.redis.exists(*run_keys("forced/0")) == 0
    *tokens, error = events
    assert [e.token_ids for e in tokens if isinstance(e, TokenEvent)] == earlier
    assert isinstance(error, ErrorEvent)
    assert (error.code, error.seq) == ("migration_failed", len(earlier))
    assert why in error.message


async def test_job_that_failed_max_deliveries_times_is_dead_lettered(
    redis_target: RedisTarget,
) -> None:
    job = make_job("poison")
    entry: list[str] = []

    async def crashed_twice(redis: aioredis.Redis) -> None:
        _, entry_id = await earlier_run(redis, job, tokens=[], runs=2)
        entry.append(entry_id)

    engine = FakeEngine()
    async with worker(
        redis_target,
        engine,
        setup=crashed_twice,
        max_deliveries=2,
        claim_idle_s=0.05,
        timing=FAST_JANITOR,
    ) as w:
        [event] = await w.final_events("poison")
        await w.drained()
        [(_, fields)] = await entries(w.redis, names.dead_letter_stream(STREAM))
        assert decode(fields) == job
        assert fields[b"entry"].decode() == entry[0]
        assert b"dead-letter" in fields[b"reason"]
        assert await w.redis.exists(names.job_run("poison/0", STAGE)) == 0
    assert isinstance(event, ErrorEvent)
    assert (event.status, event.type, event.code) == (500, "server_error", "job_failed_repeatedly")
    assert (event.seq, event.attempt) == (0, 2)
    assert engine.started == []


async def test_crashes_then_a_hand_back_count_only_the_crashes(redis_target: RedisTarget) -> None:
    job = make_job("poison")

    async def crashed_twice_then_handed_back(redis: aioredis.Redis) -> None:
        await earlier_run(redis, job, tokens=[], runs=3, hand_back=True)

    engine = FakeEngine()
    async with worker(
        redis_target, engine, setup=crashed_twice_then_handed_back, max_deliveries=2
    ) as w:
        [event] = await w.final_events("poison")
        await w.drained()
        assert await w.redis.xlen(names.dead_letter_stream(STREAM)) == 1
    assert isinstance(event, ErrorEvent)
    assert (event.code, event.attempt) == ("job_failed_repeatedly", 2)
    assert engine.started == []


async def test_job_that_failed_fewer_times_still_runs(redis_target: RedisTarget) -> None:
    async def crashed_once(redis: aioredis.Redis) -> None:
        await earlier_run(redis, make_job("retry"), tokens=[])

    engine = FakeEngine(tokens=2)
    async with worker(
        redis_target,
        engine,
        setup=crashed_once,
        max_deliveries=2,
        claim_idle_s=0.05,
        timing=FAST_JANITOR,
    ) as w:
        events = await w.final_events("retry")
        await w.drained()
        assert await w.redis.xlen(names.dead_letter_stream(STREAM)) == 0
    assert unstamped(events[-1]) == FinishEvent("retry", 0, 2, 1, "stop", 3, 2)
    # Nothing was emitted before: a restart from scratch, not a migration.
    assert engine.requests[0][1] == [1, 2, 3]


@pytest.mark.parametrize(
    ("policy", "sampling", "runs", "hand_back", "attempt"),
    [
        ({"migration_limit": 0}, {}, 1, True, 0),
        ({"migration_limit": 0}, {}, 1, False, 1),
        ({"migration_limit": 1}, {}, 2, False, 2),
        ({"migration_limit": 1}, {}, 3, True, 2),
        ({}, {"json_schema": '{"type": "object"}'}, 1, True, 0),
        ({}, {"json_object": True}, 1, False, 1),
    ],
    ids=[
        "migration-off-hand-back",
        "migration-off-crash",
        "over-the-limit",
        "over-the-limit-then-hand-back",
        "json-schema",
        "json-object",
    ],
)
async def test_resume_that_may_not_migrate_ends_with_a_clean_error(
    redis_target: RedisTarget,
    policy: dict[str, Any],
    sampling: dict[str, Any],
    runs: int,
    hand_back: bool,
    attempt: int,
) -> None:
    job = with_sampling(make_job("stuck"), **sampling)

    async def stopped_mid_stream(redis: aioredis.Redis) -> None:
        await earlier_run(redis, job, tokens=[[100], [101]], runs=runs, hand_back=hand_back)

    engine = FakeEngine()
    async with worker(
        redis_target,
        engine,
        setup=stopped_mid_stream,
        claim_idle_s=0.05,
        timing=FAST_JANITOR,
        **policy,
    ) as w:
        events = await w.final_events("stuck")
        await w.drained()
        assert await w.redis.exists(*run_keys("stuck/0")) == 0
    *tokens, error = events
    assert [e.seq for e in tokens] == [0, 1]
    assert isinstance(error, ErrorEvent)
    assert (error.status, error.code, error.seq, error.attempt) == (
        500,
        "migration_failed",
        2,
        attempt,
    )
    assert "mid-stream" in error.message
    assert engine.started == []


async def test_guided_job_without_emitted_tokens_may_restart(redis_target: RedisTarget) -> None:
    job: GenerateJob = with_sampling(make_job("guided"), json_schema='{"type": "object"}')

    async def crashed_before_a_token(redis: aioredis.Redis) -> None:
        await earlier_run(redis, job, tokens=[], hand_back=True)

    engine = FakeEngine(tokens=2)
    async with worker(redis_target, engine, setup=crashed_before_a_token) as w:
        events = await w.final_events("guided")
    assert isinstance(events[-1], FinishEvent)
    assert engine.started == ["guided/0"]
