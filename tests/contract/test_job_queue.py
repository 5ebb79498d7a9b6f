"""JobQueue contract: the same tests against fakeredis and a real Redis."""

from __future__ import annotations

import asyncio
import json
import time

import msgspec
import pytest
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.protocol import (
    PAYLOAD_FIELD,
    VERSION,
    VERSION_FIELD,
    CancelCommand,
    GenerateJob,
    SamplingOptions,
    encode,
)
from shared.queue import names
from shared.queue.job_queue import Admission, JobQueue, JobStream
from shared.roles import Role
from tests.conftest import RedisTarget

JOBS = JobStream("m", Role.AGGREGATED)
STREAM = JOBS.name


def make_job(request_id: str, index: int = 0, *, model: str = "m") -> GenerateJob:
    now = time.time()
    return GenerateJob(
        request_id=request_id,
        index=index,
        model=model,
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingOptions(max_tokens=8, seed=index),
        reply_to=names.reply_stream("gw-test"),
        deadline_unix=now + 60,
        created_unix=now,
    )


@pytest.fixture
async def queue(redis_backend: aioredis.Redis) -> JobQueue:
    q = JobQueue(redis_backend)
    await q.ensure_group(STREAM)
    return q


async def pending_count(redis: aioredis.Redis, stream: str = STREAM) -> int:
    info = await redis.xpending(stream, names.JOB_GROUP)
    return int(info["pending"])


async def test_submit_read_ack_round_trip(queue: JobQueue, redis_backend: aioredis.Redis) -> None:
    jobs = [make_job("r1", 0), make_job("r1", 1)]
    result = await queue.submit(STREAM, jobs, max_depth=10)
    assert result.outcome is Admission.QUEUED
    assert result.detail == "2"

    deliveries = await queue.read([JOBS], "c1", count=10, block_ms=100)
    assert [d.job for d in deliveries] == jobs
    assert all(d.stream == STREAM for d in deliveries)
    assert len({d.entry_id for d in deliveries}) == 2
    assert await pending_count(redis_backend) == 2

    for delivery in deliveries:
        await queue.ack(delivery.stream, delivery.entry_id)
    assert await pending_count(redis_backend) == 0
    assert await queue.depth(STREAM) == 0
    assert await queue.read([JOBS], "c1", count=10, block_ms=10) == []


async def test_xlen_counts_queued_plus_in_flight(queue: JobQueue) -> None:
    await queue.submit(STREAM, [make_job(f"r{i}") for i in range(3)], max_depth=10)
    await queue.submit(STREAM, [make_job("r9")], max_depth=10)
    assert await queue.depth(STREAM) == 4

    in_flight = await queue.read([JOBS], "c1", count=2, block_ms=100)
    assert len(in_flight) == 2
    assert await queue.depth(STREAM) == 4  # read does not shrink the stream

    for delivery in in_flight:
        await queue.ack(delivery.stream, delivery.entry_id)
    assert await queue.depth(STREAM) == 2
    rest = await queue.read([JOBS], "c1", count=10, block_ms=100)
    for delivery in rest:
        await queue.ack(delivery.stream, delivery.entry_id)
    assert await queue.depth(STREAM) == 0


async def test_depth_cap_refuses_whole_request(queue: JobQueue) -> None:
    first = await queue.submit(STREAM, [make_job("a", i) for i in range(3)], max_depth=4)
    assert first.outcome is Admission.QUEUED

    # Two more jobs would make 5 > 4: nothing of the request is queued.
    refused = await queue.submit(STREAM, [make_job("b", 0), make_job("b", 1)], max_depth=4)
    assert refused.outcome is Admission.FULL
    assert refused.detail == "3"
    assert await queue.depth(STREAM) == 3

    # Exactly filling the cap is allowed.
    last = await queue.submit(STREAM, [make_job("c")], max_depth=4)
    assert last.outcome is Admission.QUEUED
    assert last.detail == "4"
    assert (await queue.submit(STREAM, [make_job("d")], max_depth=4)).outcome is Admission.FULL

    deliveries = await queue.read([JOBS], "c1", count=10, block_ms=100)
    assert sorted(d.job.request_id for d in deliveries) == ["a", "a", "a", "c"]


async def test_request_larger_than_cap_is_refused_on_empty_queue(queue: JobQueue) -> None:
    result = await queue.submit(STREAM, [make_job("big", i) for i in range(5)], max_depth=4)
    assert result.outcome is Admission.FULL
    assert await queue.depth(STREAM) == 0


async def test_idempotency_key_gives_duplicate(
    queue: JobQueue, redis_backend: aioredis.Redis
) -> None:
    first = await queue.submit(
        STREAM, [make_job("orig", 0), make_job("orig", 1)], max_depth=10, idempotency_key="k1"
    )
    assert first.outcome is Admission.QUEUED
    again = await queue.submit(STREAM, [make_job("retry")], max_depth=10, idempotency_key="k1")
    assert again.outcome is Admission.DUPLICATE
    assert again.detail == "orig"
    assert await queue.depth(STREAM) == 2

    # The key expires with its TTL and is scoped by model.
    ttl = await redis_backend.ttl(names.idempotency("m", "k1"))
    assert 0 < ttl <= 3600
    other_model = await queue.submit(
        STREAM, [make_job("x", model="other")], max_depth=10, idempotency_key="k1"
    )
    assert other_model.outcome is Admission.QUEUED
    # No key: a different request is never deduplicated.
    plain = await queue.submit(STREAM, [make_job("plain")], max_depth=10)
    assert plain.outcome is Admission.QUEUED
    assert await queue.depth(STREAM) == 4


async def test_idempotency_keys_are_scoped_per_api_key(queue: JobQueue) -> None:
    first = await queue.submit(
        STREAM, [make_job("alice-1")], max_depth=10, idempotency_key="k", idempotency_owner="a"
    )
    other = await queue.submit(
        STREAM, [make_job("bob-1")], max_depth=10, idempotency_key="k", idempotency_owner="b"
    )
    assert (first.outcome, other.outcome) == (Admission.QUEUED, Admission.QUEUED)
    anonymous = await queue.submit(STREAM, [make_job("anon")], max_depth=10, idempotency_key="k")
    assert anonymous.outcome is Admission.QUEUED
    again = await queue.submit(
        STREAM, [make_job("bob-2")], max_depth=10, idempotency_key="k", idempotency_owner="b"
    )
    assert (again.outcome, again.detail) == (Admission.DUPLICATE, "bob-1")


async def test_a_retried_admission_queues_once(queue: JobQueue) -> None:
    """The gateway retries admission through a Redis blip; a try that landed counts."""
    jobs = [make_job("once", 0), make_job("once", 1)]
    first = await queue.submit(STREAM, jobs, max_depth=10)
    retry = await queue.submit(STREAM, jobs, max_depth=10)
    assert first.outcome is retry.outcome is Admission.QUEUED
    assert await queue.depth(STREAM) == 2


async def test_refused_request_does_not_claim_idempotency_key(queue: JobQueue) -> None:
    await queue.submit(STREAM, [make_job("fill")], max_depth=1)
    full = await queue.submit(STREAM, [make_job("a")], max_depth=1, idempotency_key="k")
    assert full.outcome is Admission.FULL
    retried = await queue.submit(STREAM, [make_job("b")], max_depth=2, idempotency_key="k")
    assert retried.outcome is Admission.QUEUED


async def test_submit_needs_jobs(queue: JobQueue) -> None:
    with pytest.raises(ValueError, match="at least one job"):
        await queue.submit(STREAM, [], max_depth=10)


async def test_two_consumers_never_share_an_entry(redis_target: RedisTarget) -> None:
    await redis_target.flush()
    first, second = redis_target.connect(), redis_target.connect()
    try:
        q1, q2 = JobQueue(first), JobQueue(second)
        await q1.ensure_group(STREAM)
        await q1.submit(STREAM, [make_job(f"r{i}") for i in range(20)], max_depth=100)

        async def drain(q: JobQueue, consumer: str) -> list[str]:
            seen: list[str] = []
            while True:
                got = await q.read([JOBS], consumer, count=3, block_ms=20)
                if not got:
                    return seen
                seen.extend(d.entry_id for d in got)

        a, b = await asyncio.gather(drain(q1, "w1"), drain(q2, "w2"))
        assert not set(a) & set(b)
        assert len(a) + len(b) == 20
        assert len(set(a) | set(b)) == 20
    finally:
        await first.aclose()
        await second.aclose()
        await redis_target.flush()


async def test_undecodable_entries_are_dropped(
    queue: JobQueue, redis_backend: aioredis.Redis
) -> None:
    good = make_job("good")
    await redis_backend.xadd(STREAM, {VERSION_FIELD: VERSION, PAYLOAD_FIELD: b"\xc1garbage"})
    await redis_backend.xadd(STREAM, {VERSION_FIELD: b"99", PAYLOAD_FIELD: b"x"})
    await redis_backend.xadd(STREAM, {b"other": b"field"})
    await redis_backend.xadd(STREAM, encode(CancelCommand("not-a-job")))  # type: ignore[arg-type]
    await queue.submit(STREAM, [good], max_depth=100)

    deliveries = await queue.read([JOBS], "c1", count=10, block_ms=100)
    assert [d.job for d in deliveries] == [good]
    # The bad entries were acked and deleted, not left pending forever.
    assert await queue.depth(STREAM) == 1
    assert await pending_count(redis_backend) == 1


async def test_entry_with_invalid_utf8_is_dropped(
    queue: JobQueue, redis_backend: aioredis.Redis
) -> None:
    """A payload msgspec rejects with UnicodeDecodeError is dropped like any bad entry."""
    await redis_backend.xadd(
        STREAM, {VERSION_FIELD: VERSION, PAYLOAD_FIELD: b"\x91\xaa" + b"\x00" * 9 + b"\x80"}
    )
    good = make_job("good")
    await queue.submit(STREAM, [good], max_depth=100)
    deliveries = await queue.read([JOBS], "c1", count=10, block_ms=100)
    assert [d.job for d in deliveries] == [good]
    assert await queue.depth(STREAM) == 1
    assert await pending_count(redis_backend) == 1


async def test_ensure_group_is_idempotent(redis_backend: aioredis.Redis) -> None:
    q = JobQueue(redis_backend)
    fresh = JobStream("fresh", Role.AGGREGATED)
    stream = fresh.name
    await q.ensure_group(stream)  # creates the stream (MKSTREAM)
    await q.submit(stream, [make_job("r")], max_depth=10)
    await q.ensure_group(stream)
    await q.ensure_group(stream)
    groups = await redis_backend.xinfo_groups(stream)
    assert [g["name"] for g in groups] == [names.JOB_GROUP.encode()]
    # Re-creating did not reset the group: the entry is still delivered once.
    assert len(await q.read([fresh], "c", count=10, block_ms=50)) == 1
    assert await q.read([fresh], "c", count=10, block_ms=10) == []


async def test_read_spans_several_streams(queue: JobQueue) -> None:
    other = JobStream("m2", Role.PREFILL)
    await queue.ensure_group(other.name)
    await queue.submit(STREAM, [make_job("a")], max_depth=10)
    await queue.submit(other.name, [make_job("b", model="m2")], max_depth=10)
    deliveries = await queue.read([JOBS, other], "c", count=10, block_ms=50)
    assert {(d.stream, d.role, d.job.request_id) for d in deliveries} == {
        (STREAM, Role.AGGREGATED, "a"),
        (other.name, Role.PREFILL, "b"),
    }


# ----------------------------------------------------------------- bookkeeping


operation = st.one_of(
    st.tuples(st.just("submit"), st.integers(1, 3)),
    st.tuples(st.just("read"), st.integers(1, 4)),
    st.tuples(st.just("ack"), st.integers(0, 5)),
)


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(ops=st.lists(operation, max_size=12))
async def test_queue_bookkeeping(redis_target: RedisTarget, ops: list[tuple[str, int]]) -> None:
    """XLEN == submitted - acked, and pending == read - acked, whatever the order."""
    max_depth = 6
    client = redis_target.connect()
    try:
        await client.flushdb()
        q = JobQueue(client)
        await q.ensure_group(STREAM)
        submitted = acked = 0
        unacked: list[str] = []
        for step, (op, amount) in enumerate(ops):
            if op == "submit":
                jobs = [make_job(f"r{step}", i) for i in range(amount)]
                result = await q.submit(STREAM, jobs, max_depth=max_depth)
                if submitted - acked + amount <= max_depth:
                    assert result.outcome is Admission.QUEUED
                    submitted += amount
                else:
                    assert result.outcome is Admission.FULL
            elif op == "read":
                got = await q.read([JOBS], "c", count=amount, block_ms=1)
                expected = min(amount, submitted - acked - len(unacked))
                assert len(got) == expected
                unacked.extend(d.entry_id for d in got)
            elif unacked:
                entry_id = unacked.pop(amount % len(unacked))
                await q.ack(STREAM, entry_id)
                acked += 1
            assert await q.depth(STREAM) == submitted - acked
            assert await pending_count(client) == len(unacked)
    finally:
        await client.flushdb()
        await client.aclose()


def guided_job(request_id: str, index: int, schema: str) -> GenerateJob:
    job = make_job(request_id, index)
    sampling = msgspec.structs.replace(job.sampling, json_schema=schema, temperature=0.0)
    return msgspec.structs.replace(job, sampling=sampling)


async def stored_bytes(redis: aioredis.Redis, request_id: str) -> int:
    """What a request's jobs and its stored schema take in Redis (values only)."""
    entries = await redis.xrange(STREAM)
    jobs = sum(len(value) for _, fields in entries for value in fields.values())
    return jobs + int(await redis.strlen(names.json_schema(request_id)))


async def test_a_json_schema_is_stored_once_per_request_not_once_per_job(
    queue: JobQueue, redis_backend: aioredis.Redis
) -> None:
    schema = json.dumps({"type": "object", "description": "x" * (64 * 1024 - 64)})
    jobs = [guided_job("big", i, schema) for i in range(128)]
    result = await queue.submit(STREAM, jobs, max_depth=1000)
    assert result.outcome is Admission.QUEUED
    assert await stored_bytes(redis_backend, "big") < len(schema) * 2  # not 128 copies
    assert 60 < await redis_backend.ttl(names.json_schema("big")) <= 121  # deadline + margin
    read = await queue.read([JOBS], "c1", count=200, block_ms=10)
    assert len(read) == 128
    assert all(isinstance(d.job, GenerateJob) for d in read)
    assert {d.job.sampling.json_schema for d in read} == {schema}  # type: ignore[union-attr]


async def test_a_refused_request_stores_no_schema(
    queue: JobQueue, redis_backend: aioredis.Redis
) -> None:
    refused = await queue.submit(
        STREAM, [guided_job("full", i, '{"type": "object"}') for i in range(3)], max_depth=2
    )
    assert refused.outcome is Admission.FULL
    assert await redis_backend.exists(names.json_schema("full")) == 0
    assert await queue.depth(STREAM) == 0
