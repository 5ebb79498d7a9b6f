"""The fenced run journal (workers/journal/run_journal.py) and JobQueue.reclaim, on both
backends."""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis.asyncio as aioredis
from hypothesis import given, settings
from hypothesis import strategies as st
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from shared.connections.connect import connect
from shared.protocol import (
    ErrorEvent,
    Event,
    FinishEvent,
    GenerateJob,
    SamplingOptions,
    TokenEvent,
    decode,
    decode_events,
)
from shared.queue import names
from shared.queue.job_queue import Delivery, JobQueue, JobStream
from shared.roles import Role
from shared.tasks import cancel_and_wait
from tests.conftest import RedisTarget
from tests.journal_faults import FaultyScripts
from tests.support.second_redis import PrivateRedis
from workers.journal.run_journal import RunJournal, RunLease
from workers.journal.scripts import WritePart, WriteTail
from workers.journal.writes import JobWrites, pack_tokens, unpack_tokens

STAGE = Role.AGGREGATED
JOBS = JobStream("m", STAGE)
STREAM = JOBS.name


def run_keys(job_id: str) -> tuple[str, str]:
    """The run hash and emitted-token log of ``job_id`` at this stage."""
    return names.job_run(job_id, STAGE), names.job_emitted(job_id, STAGE)


REPLY = names.reply_stream("gw-test")
DONE = names.stream_done_counter(STREAM)


def make_job(request_id: str, index: int = 0, *, reply_to: str = REPLY) -> GenerateJob:
    now = time.time()
    return GenerateJob(
        request_id=request_id,
        index=index,
        model="m",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingOptions(max_tokens=16),
        reply_to=reply_to,
        deadline_unix=now + 60,
        created_unix=now,
    )


async def deliver(
    redis: aioredis.Redis, *jobs: GenerateJob, consumer: str = "wa"
) -> list[Delivery]:
    queue = JobQueue(redis)
    await queue.ensure_group(STREAM)
    await queue.submit(STREAM, list(jobs), max_depth=100)
    deliveries = await queue.read([JOBS], consumer, count=len(jobs), block_ms=100)
    assert [d.job for d in deliveries] == list(jobs)
    return deliveries


def tok(lease: RunLease, token_ids: list[int]) -> TokenEvent:
    job = lease.delivery.job
    return TokenEvent(
        job.request_id, job.index, lease.take_seq(), lease.attempt, token_ids, f"{token_ids}"
    )


def fin(lease: RunLease) -> FinishEvent:
    job = lease.delivery.job
    return FinishEvent(job.request_id, job.index, lease.take_seq(), lease.attempt, "stop", 3, 0)


def emit(journal: RunJournal, lease: RunLease, *token_lists: list[int]) -> list[Event]:
    """Publish one TokenEvent per list, numbered like SequenceRun numbers them."""
    events: list[Event] = []
    for token_ids in token_lists:
        event = tok(lease, token_ids)
        journal.publish(lease, event, token_ids)
        events.append(event)
    return events


async def entries(redis: aioredis.Redis, stream: str) -> list[tuple[bytes, dict[bytes, bytes]]]:
    found: list[tuple[bytes, dict[bytes, bytes]]] = cast(Any, await redis.xrange(stream))
    return found


async def entry_ids(redis: aioredis.Redis, stream: str = STREAM) -> list[str]:
    return [entry_id.decode() for entry_id, _ in await entries(redis, stream)]


async def replies(redis: aioredis.Redis, stream: str = REPLY) -> list[Any]:
    """The events on a reply stream (typed Any: tests read seq/attempt off any kind)."""
    return [event for _, fields in await entries(redis, stream) for event in decode_events(fields)]


async def emitted(redis: aioredis.Redis, job_id: str) -> list[int]:
    data: bytes | None = cast(Any, await redis.get(names.job_emitted(job_id, STAGE)))
    return unpack_tokens(data or b"")


async def pending(redis: aioredis.Redis) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = cast(
        Any, await redis.xpending_range(STREAM, names.JOB_GROUP, "-", "+", 100)
    )
    return found


class Journal:
    """A running RunJournal plus what it reported as fenced, on scripts that fail on demand."""

    def __init__(self, redis: aioredis.Redis, consumer: str, **options: Any) -> None:
        self.consumer = consumer
        self.fenced: list[str] = []
        self.scripts = FaultyScripts(redis)
        self.journal = RunJournal(
            redis,
            consumer=consumer,
            on_fenced=self.fenced.append,
            scripts=self.scripts,
            **options,
        )
        self.task: asyncio.Task[None] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.journal, name)


@contextlib.asynccontextmanager
async def journals(
    redis: aioredis.Redis, *consumers: str, **options: Any
) -> AsyncIterator[list[Journal]]:
    running = [Journal(redis, consumer, **options) for consumer in consumers]
    for journal in running:
        journal.task = asyncio.create_task(
            journal.journal.run(), name=f"journal-{journal.consumer}"
        )
    try:
        yield running
    finally:
        tasks = [j.task for j in running if j.task is not None]
        await cancel_and_wait(tasks)
        for task in tasks:
            if not task.cancelled() and (error := task.exception()) is not None:
                raise error


@pytest.fixture
async def wa(redis_backend: aioredis.Redis) -> AsyncIterator[Journal]:
    async with journals(redis_backend, "wa") as (journal,):
        yield journal


@pytest.fixture
async def joining(redis_backend: aioredis.Redis) -> AsyncIterator[Journal]:
    """A journal that joins a job's waiting token events (the workers' default)."""
    async with journals(redis_backend, "wj", join_tokens=True) as (journal,):
        yield journal


# ------------------------------------------------------------------------- begin


async def run_fields(redis: aioredis.Redis) -> dict[bytes, bytes]:
    """The run hash of ``r1/0``, less the start time the status page reads (``began_ms``:
    the clock's, checked here only for its shape)."""
    run: dict[bytes, bytes] = cast(Any, await redis.hgetall(names.job_run("r1/0", STAGE)))
    began = run.pop(b"began_ms", None)
    assert began is None or began.isdigit()
    return run


async def test_begin_on_a_fresh_delivery(wa: Journal, redis_backend: aioredis.Redis) -> None:
    [delivery] = await deliver(redis_backend, make_job("r1"))
    lease = await wa.begin(delivery)
    assert (lease.attempt, lease.next_seq, lease.emitted) == (0, 0, [])
    assert lease.job_id == "r1/0"
    assert lease.fence.startswith("wa/")
    run = await run_fields(redis_backend)
    assert run == {b"owner": lease.fence.encode(), b"starts": b"1"}
    assert await redis_backend.get(names.job_emitted("r1/0", STAGE)) == b""
    for key in run_keys("r1/0"):
        assert 3500 * 1000 < await redis_backend.pttl(key) <= 3600 * 1000
    # Each begin gets its own fence, even on the same worker.
    again = await wa.begin(delivery)
    assert again.fence != lease.fence


@pytest.mark.redis
async def test_begin_takes_one_round_trip_and_survives_a_redis_without_its_scripts(
    tmp_path: Path,
) -> None:
    """A private server: ``SCRIPT FLUSH`` would drop every other client's scripts on the
    shared one."""
    server = PrivateRedis.start_in(tmp_path)
    redis = connect(server.url)
    try:
        async with journals(redis, "wa") as (journal,):
            first = await journal.begin_all(await deliver(redis, make_job("r1"), make_job("r2")))
            deliveries = await deliver(redis, make_job("r3"))
            await redis.config_resetstat()
            second = await journal.begin_all(deliveries)
            stats: dict[str, Any] = cast(Any, await redis.info("commandstats"))
            assert "cmdstat_script" not in stats  # no SCRIPT EXISTS before the calls
            assert stats["cmdstat_evalsha"]["calls"] == 1
            await redis.script_flush()
            third = await journal.begin_all(await deliver(redis, make_job("r4")))
        assert [lease.job_id for lease in first + second + third] == [
            "r1/0",
            "r2/0",
            "r3/0",
            "r4/0",
        ]
        assert all((lease.attempt, lease.next_seq) == (0, 0) for lease in first + second + third)
        assert await redis.hget(names.job_run("r4/0", STAGE), "owner") == third[0].fence.encode()
    finally:
        await redis.aclose()
        server.kill()


# --------------------------------------------------------------------- publishing


async def test_publish_and_flush_write_events_tokens_and_seq(
    wa: Journal, redis_backend: aioredis.Redis
) -> None:
    [delivery] = await deliver(redis_backend, make_job("r1"))
    lease = await wa.begin(delivery)
    events = emit(wa.journal, lease, [10], [11, 12], [])
    await wa.flush()
    assert await replies(redis_backend) == events
    assert await emitted(redis_backend, "r1/0") == [10, 11, 12]
    assert await redis_backend.hget(names.job_run("r1/0", STAGE), "seq") == b"3"

    more = emit(wa.journal, lease, [-5, 2**31 - 1])
    await wa.flush()
    assert await replies(redis_backend) == events + more
    assert await emitted(redis_backend, "r1/0") == [10, 11, 12, -5, 2**31 - 1]
    assert await redis_backend.hget(names.job_run("r1/0", STAGE), "seq") == b"4"
    # Publishing does not finish the job: its entry is still queued and pending.
    assert await redis_backend.xlen(STREAM) == 1
    assert len(await pending(redis_backend)) == 1
    assert wa.fenced == []


async def test_token_events_waiting_together_leave_as_one(
    joining: Journal, redis_backend: aioredis.Redis
) -> None:
    [delivery] = await deliver(redis_backend, make_job("r1"))
    lease = await joining.begin(delivery)
    emit(joining.journal, lease, [10], [11, 12], [])
    assert lease.next_seq == 1  # the joined event keeps the first seq
    await joining.flush()
    [event] = await replies(redis_backend)
    assert (event.seq, event.token_ids, event.text) == (0, [10, 11, 12], "[10][11, 12][]")
    assert await emitted(redis_backend, "r1/0") == [10, 11, 12]
    assert await redis_backend.hget(names.job_run("r1/0", STAGE), "seq") == b"1"

    # Written already: the next one is an event of its own, numbered on.
    emit(joining.journal, lease, [13])
    joining.finish(lease, fin(lease))
    await joining.flush()
    assert [(e.seq, type(e).__name__) for e in await replies(redis_backend)] == [
        (0, "TokenEvent"),
        (1, "TokenEvent"),
        (2, "FinishEvent"),
    ]


async def test_only_the_last_numbered_event_of_the_same_job_joins(
    joining: Journal, redis_backend: aioredis.Redis
) -> None:
    first, second = await deliver(redis_backend, make_job("r1"), make_job("r2"))
    a, b = await joining.begin(first), await joining.begin(second)
    emit(joining.journal, a, [1])
    emit(joining.journal, b, [2])
    emit(joining.journal, a, [3])
    skipped = tok(a, [4])  # numbered, then another event was numbered before it came
    late = tok(a, [5])
    joining.journal.publish(a, late, [5])
    joining.journal.publish(a, skipped, [4])
    await joining.flush()
    found = [(e.request_id, e.seq, e.token_ids) for e in await replies(redis_backend)]
    assert found == [("r1", 0, [1, 3]), ("r1", 2, [5]), ("r1", 1, [4]), ("r2", 0, [2])]


async def test_flush_with_nothing_published_returns(wa: Journal) -> None:
    await asyncio.wait_for(wa.flush(), 1.0)


async def test_one_script_call_per_loop_pass_for_many_jobs(
    wa: Journal, redis_backend: aioredis.Redis
) -> None:
    other_reply = names.reply_stream("gw-other")
    d1, d2, d3 = await deliver(
        redis_backend, make_job("a"), make_job("b", reply_to=other_reply), make_job("c")
    )
    leases = [await wa.begin(d) for d in (d1, d2, d3)]
    a = emit(wa.journal, leases[0], *([i] for i in range(30)))
    b = emit(wa.journal, leases[1], [7])
    c = emit(wa.journal, leases[2], [8], [9])
    wa.journal.finish(leases[2], fin(leases[2]))
    await wa.flush()
    assert wa.scripts.write_calls == 1
    got = await replies(redis_backend)
    assert [e for e in got if e.request_id == "a"] == a
    assert [e for e in got if e.request_id == "c"][:2] == c
    assert await replies(redis_backend, other_reply) == b
    assert await emitted(redis_backend, "a/0") == list(range(30))
    assert await emitted(redis_backend, "b/0") == [7]
    assert await redis_backend.exists(*run_keys("c/0")) == 0
    assert await redis_backend.xlen(STREAM) == 2


# ------------------------------------------------------------------------ finishing


async def test_finish_with_event_writes_it_and_acks_the_job(
    wa: Journal, redis_backend: aioredis.Redis
) -> None:
    first, second = await deliver(redis_backend, make_job("r1"), make_job("r2"))
    lease = await wa.begin(first)
    events = emit(wa.journal, lease, [5], [6])
    final = fin(lease)
    wa.journal.finish(lease, final)
    await wa.flush()
    assert await replies(redis_backend) == [*events, final]
    assert await entry_ids(redis_backend) == [second.entry_id]
    assert [p["message_id"] for p in await pending(redis_backend)] == [second.entry_id.encode()]
    assert await redis_backend.exists(*run_keys("r1/0")) == 0
    assert await redis_backend.get(DONE) == b"1"

    other = await wa.begin(second)
    error = ErrorEvent("r2", 0, other.take_seq(), 0, 500, "server_error", "engine_error", "x")
    wa.journal.finish(other, error)
    await wa.flush()
    assert (await replies(redis_backend))[-1] == error
    assert await redis_backend.get(DONE) == b"2"
    assert await redis_backend.xlen(STREAM) == 0
    assert wa.fenced == []


async def test_finish_without_event_acks_silently(
    wa: Journal, redis_backend: aioredis.Redis
) -> None:
    [delivery] = await deliver(redis_backend, make_job("gone"))
    lease = await wa.begin(delivery)
    wa.journal.finish(lease)  # the client left
    await wa.flush()
    assert await replies(redis_backend) == []
    assert await redis_backend.xlen(STREAM) == 0
    assert await pending(redis_backend) == []
    assert await redis_backend.exists(*run_keys("gone/0")) == 0
    assert await redis_backend.get(DONE) == b"1"


# ------------------------------------------------------------------------ sent tally

TALLY = names.sent_tally("r1")
TTL_MS = 100_000
"""The journals below run with a 100 s TTL: they set the tally's again every 10 s."""


class Clock:
    """The journal's wall clock, moved by hand (seconds)."""

    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def timed(redis_backend: aioredis.Redis, clock: Clock) -> AsyncIterator[Journal]:
    """A journal on ``clock`` whose TTLs are 100 s."""
    async with journals(redis_backend, "wt", run_ttl_s=TTL_MS / 1000, clock=clock) as (journal,):
        yield journal


async def tally(redis: aioredis.Redis) -> tuple[dict[bytes, bytes], int]:
    """The sent tally of ``r1`` and its TTL (ms)."""
    fields: dict[bytes, bytes] = cast(Any, await redis.hgetall(TALLY))
    return fields, await redis.pttl(TALLY)


async def step(journal: Journal, lease: RunLease, *token_lists: list[int]) -> None:
    emit(journal.journal, lease, *token_lists)
    await journal.flush()


async def test_the_first_token_time_is_recorded_once(
    timed: Journal, clock: Clock, redis_backend: aioredis.Redis
) -> None:
    [delivery] = await deliver(redis_backend, make_job("r1"))
    lease = await timed.begin(delivery)
    await step(timed, lease, [])  # no tokens: no first token yet
    assert await redis_backend.exists(TALLY) == 0
    clock.now = 1_000.5
    await step(timed, lease, [1])
    for now in (1_001.0, 1_020.0):  # later writes, refreshing the TTL or not
        clock.now = now
        await step(timed, lease, [2, 3])
    fields, _ = await tally(redis_backend)
    assert fields == {b"c": b"5", b"t": b"1000500"}

    # A run that takes the job over records it with HSETNX again: the first one stays.
    await redis_backend.pexpire(TALLY, 50_000)
    clock.now = 1_021.0
    taken = await timed.begin(delivery)
    await step(timed, taken, [4])
    fields, ttl = await tally(redis_backend)
    assert fields == {b"c": b"6", b"t": b"1000500"}
    assert TTL_MS - 5_000 < ttl <= TTL_MS


async def test_the_tally_ttl_is_set_on_the_first_tokens_then_once_the_bound_passed(
    timed: Journal, clock: Clock, redis_backend: aioredis.Redis
) -> None:
    [delivery] = await deliver(redis_backend, make_job("r1"))
    lease = await timed.begin(delivery)
    await step(timed, lease, [1])
    _, ttl = await tally(redis_backend)
    assert TTL_MS - 5_000 < ttl <= TTL_MS

    await redis_backend.pexpire(TALLY, 50_000)  # to see which writes set it again
    clock.now = 1_009.999  # less than a tenth of the TTL since it was set
    await step(timed, lease, [2])
    _, ttl = await tally(redis_backend)
    assert ttl <= 50_000
    clock.now = 1_010.0
    await step(timed, lease, [3])
    _, ttl = await tally(redis_backend)
    assert TTL_MS - 5_000 < ttl <= TTL_MS

    await redis_backend.pexpire(TALLY, 50_000)
    clock.now = 1_019.0  # counted from the last time it was set, not the first
    await step(timed, lease, [4])
    _, ttl = await tally(redis_backend)
    assert ttl <= 50_000
    assert (await tally(redis_backend))[0][b"c"] == b"4"


async def test_a_write_without_a_tail_leaves_the_first_token_time_and_the_ttl(
    timed: Journal, clock: Clock, redis_backend: aioredis.Redis
) -> None:
    [delivery] = await deliver(redis_backend, make_job("r1"))
    lease = await timed.begin(delivery)
    await step(timed, lease, [1])
    await redis_backend.hset(TALLY, "t", "7")
    await redis_backend.pexpire(TALLY, 50_000)
    clock.now = 1_001.0
    await step(timed, lease, [2, 3], [4])
    fields, ttl = await tally(redis_backend)
    assert fields == {b"c": b"4", b"t": b"7"}
    assert ttl <= 50_000
    assert await emitted(redis_backend, "r1/0") == [1, 2, 3, 4]
    assert await redis_backend.hget(names.job_run("r1/0", STAGE), "seq") == b"3"


async def test_a_tally_deleted_while_the_job_runs_comes_back_with_a_ttl(
    timed: Journal, clock: Clock, redis_backend: aioredis.Redis
) -> None:
    """Its gateway closed the request (and deleted the tally) before the job stopped."""
    [delivery] = await deliver(redis_backend, make_job("r1"))
    lease = await timed.begin(delivery)
    await step(timed, lease, [1])
    await redis_backend.delete(TALLY)
    clock.now = 1_001.0
    await step(timed, lease, [2])
    fields, ttl = await tally(redis_backend)
    assert fields == {b"c": b"1"}
    assert TTL_MS - 5_000 < ttl <= TTL_MS


async def test_a_finish_acks_deletes_and_records_its_note(
    timed: Journal, clock: Clock, redis_backend: aioredis.Redis
) -> None:
    [delivery] = await deliver(redis_backend, make_job("r1"))
    lease = await timed.begin(delivery)
    await step(timed, lease, [1])
    await redis_backend.pexpire(TALLY, 50_000)
    clock.now = 1_001.0
    final = FinishEvent("r1", 0, lease.take_seq(), 0, "length", 3, 1, 2)
    timed.journal.finish(lease, final)
    await timed.flush()
    assert (await replies(redis_backend))[-1] == final
    assert await redis_backend.xlen(STREAM) == 0
    assert await pending(redis_backend) == []
    assert await redis_backend.exists(*run_keys("r1/0")) == 0
    assert await redis_backend.get(DONE) == b"1"
    fields, ttl = await tally(redis_backend)
    assert fields == {b"c": b"1", b"t": b"1000000", b"f:0": b"length|2|0"}
    assert TTL_MS - 5_000 < ttl <= TTL_MS


def test_only_a_first_stale_or_finishing_write_carries_a_tail() -> None:
    delivery = Delivery(STREAM, "1-0", make_job("r1"), STAGE)
    lease = RunLease(delivery, "wt/1", 0, 0, [])

    def part(now_ms: int, *token_lists: list[int], final: bool = False) -> WritePart:
        writes = JobWrites(lease)
        for token_ids in token_lists:
            writes.add(tok(lease, token_ids))
            writes.tokens.extend(token_ids)
        if final:
            writes.add(fin(lease))
            writes.finish = True
        return writes.row(now_ms, refresh_ms=10_000)

    row, tail, events = part(1_000, [])
    assert (row.tail, tail, len(events)) == (0, None, 1)  # no tokens: nothing to touch
    row, tail, _ = part(1_001, [1])
    assert row.tail == 1 and tail == WriteTail(first_token_ms=1_001)
    row, tail, events = part(11_000, [2], [3])
    assert (row.tail, tail, row.sent_tokens, len(events)) == (0, None, 2, 2)
    row, tail, _ = part(11_001, [4])
    assert row.tail == 1 and tail == WriteTail()  # the bound passed: only the TTL
    row, tail, _ = part(11_002, [5], final=True)
    assert row.tail == 1 and tail == WriteTail(
        ack_stream=STREAM,
        ack_entry="1-0",
        done_key=DONE,
        finish_field="f:0",
        finish_value="stop||0",
    )


# ------------------------------------------------------------------------- fencing


async def test_takeover_continues_the_journal_and_fences_the_first_lease(
    redis_backend: aioredis.Redis,
) -> None:
    [delivery] = await deliver(redis_backend, make_job("r1"))
    async with journals(redis_backend, "wa", "wb") as (wa, wb):
        zombie = await wa.begin(delivery)
        before = emit(wa.journal, zombie, [1], [2, 3])
        await wa.flush()

        # Worker B reclaims the job (same entry) and begins a new run of it.
        [reclaimed] = await JobQueue(redis_backend).reclaim(JOBS, "wb", min_idle_ms=0, count=10)
        assert reclaimed == delivery
        owner = await wb.begin(reclaimed)
        assert (owner.attempt, owner.next_seq, owner.emitted) == (1, 2, [1, 2, 3])

        # The first lease wakes up: nothing it writes lands, and it is told so.
        late = emit(wa.journal, zombie, [99])
        wa.journal.finish(zombie, fin(zombie))
        await wa.flush()
        assert wa.fenced == ["r1/0"]
        assert await replies(redis_backend) == before
        assert await emitted(redis_backend, "r1/0") == [1, 2, 3]
        assert await redis_backend.xlen(STREAM) == 1  # its finish did not ack the job
        assert late[0].seq == 2

        # The owner continues the numbering and finishes the job.
        after = emit(wb.journal, owner, [4])
        final = fin(owner)
        wb.journal.finish(owner, final)
        await wb.flush()
        assert await replies(redis_backend) == [*before, *after, final]
        assert [e.seq for e in await replies(redis_backend)] == [0, 1, 2, 3]
        assert [e.attempt for e in await replies(redis_backend)] == [0, 0, 1, 1]
        assert await redis_backend.xlen(STREAM) == 0
        assert wb.fenced == []


# ---------------------------------------------------------------------- hand back


async def test_hand_back_requeues_the_job_and_keeps_its_journal(
    redis_backend: aioredis.Redis,
) -> None:
    [delivery] = await deliver(redis_backend, make_job("r1"))
    async with journals(redis_backend, "wa", "wb") as (wa, wb):
        lease = await wa.begin(delivery)
        before = emit(wa.journal, lease, [1, 2], [3])
        await wa.flush()
        assert await wa.hand_back(lease) is True

        [(raw_id, fields)] = await entries(redis_backend, STREAM)
        new_id = raw_id.decode()
        assert new_id != delivery.entry_id
        assert decode(fields) == delivery.job
        assert await pending(redis_backend) == []  # the old entry is acked and gone
        # The owner is gone and the start is given back: a hand-back is no failed delivery.
        assert await run_fields(redis_backend) == {
            b"starts": b"0",
            b"seq": b"2",
        }

        # Writes of the handed-back lease are fenced from now on.
        emit(wa.journal, lease, [42])
        await wa.flush()
        assert wa.fenced == ["r1/0"]

        [again] = await JobQueue(redis_backend).read([JOBS], "wb", count=1, block_ms=100)
        assert again.entry_id == new_id and again.job == delivery.job
        resumed = await wb.begin(again)
        # The next run continues the journal with the SAME attempt number.
        assert (resumed.attempt, resumed.next_seq, resumed.emitted) == (0, 2, [1, 2, 3])
        final = fin(resumed)
        wb.journal.finish(resumed, final)
        await wb.flush()
        assert await replies(redis_backend) == [*before, final]
        assert [e.attempt for e in await replies(redis_backend)] == [0, 0, 0]
        assert await redis_backend.xlen(STREAM) == 0


async def test_hand_backs_keep_the_attempt_and_crashes_raise_it(
    redis_backend: aioredis.Redis,
) -> None:
    """``attempt`` counts failed runs (a lease taken over), never graceful hand-backs."""
    queue = JobQueue(redis_backend)
    [delivery] = await deliver(redis_backend, make_job("r1"))
    attempts: list[int] = []
    async with journals(redis_backend, "wa") as (wa,):
        for step in ("hand back", "hand back", "crash", "hand back", "crash", "hand back"):
            lease = await wa.begin(delivery)
            attempts.append(lease.attempt)
            emit(wa.journal, lease, [lease.attempt])
            await wa.flush()
            if step == "hand back":
                assert await wa.hand_back(lease) is True
                [delivery] = await queue.read([JOBS], "wa", count=1, block_ms=100)
            # else: the run dies without a word; the next begin takes the job over.
        last = await wa.begin(delivery)
        assert wa.fenced == []
    assert attempts == [0, 0, 0, 1, 1, 2]
    assert (last.attempt, last.next_seq, last.emitted) == (2, 6, attempts)
    assert await redis_backend.hget(names.job_run("r1/0", STAGE), "starts") == b"3"


async def test_a_failed_hand_back_counts_as_a_failed_run(redis_backend: aioredis.Redis) -> None:
    """hand_back(failed=True) (after an engine death) keeps the start: the attempt rises."""
    queue = JobQueue(redis_backend)
    [delivery] = await deliver(redis_backend, make_job("r1"))
    async with journals(redis_backend, "wa") as (wa,):
        lease = await wa.begin(delivery)
        emit(wa.journal, lease, [7])
        await wa.flush()
        assert await wa.hand_back(lease, failed=True) is True
        assert await pending(redis_backend) == []
        [again] = await queue.read([JOBS], "wa", count=1, block_ms=100)
        assert again.job == delivery.job and again.entry_id != delivery.entry_id
        resumed = await wa.begin(again)
        assert (resumed.attempt, resumed.next_seq, resumed.emitted) == (1, 1, [7])
        assert await wa.hand_back(lease, failed=True) is False  # fenced: changes nothing
    assert await redis_backend.hget(names.job_run("r1/0", STAGE), "starts") == b"2"


async def test_repeated_hand_backs_never_drive_the_start_count_down(
    redis_backend: aioredis.Redis,
) -> None:
    queue = JobQueue(redis_backend)
    [delivery] = await deliver(redis_backend, make_job("r1"))
    async with journals(redis_backend, "wa") as (wa,):
        for _ in range(5):
            lease = await wa.begin(delivery)
            assert lease.attempt == 0
            assert await wa.hand_back(lease) is True
            assert await wa.hand_back(lease) is False  # a second hand-back is fenced: no -1
            [delivery] = await queue.read([JOBS], "wa", count=1, block_ms=100)
    assert await redis_backend.hget(names.job_run("r1/0", STAGE), "starts") == b"0"
    assert await entry_ids(redis_backend) == [delivery.entry_id]


async def test_hand_back_by_a_fenced_out_lease_does_nothing(
    redis_backend: aioredis.Redis,
) -> None:
    [delivery] = await deliver(redis_backend, make_job("r1"))
    async with journals(redis_backend, "wa", "wb") as (wa, wb):
        zombie = await wa.begin(delivery)
        owner = await wb.begin(delivery)
        assert await wa.hand_back(zombie) is False
        assert await entry_ids(redis_backend) == [delivery.entry_id]
        assert len(await pending(redis_backend)) == 1
        assert (
            await redis_backend.hget(names.job_run("r1/0", STAGE), "owner") == owner.fence.encode()
        )
        assert await wb.hand_back(owner) is True


# ------------------------------------------------------------- refresh and reclaim


async def test_refresh_renews_owned_leases_and_reports_lost_ones(
    redis_backend: aioredis.Redis,
) -> None:
    kept, lost = await deliver(redis_backend, make_job("kept"), make_job("lost"))
    async with journals(redis_backend, "wa", "wb") as (wa, wb):
        assert await wa.refresh([]) == []
        mine = await wa.begin(kept)
        stolen = await wa.begin(lost)
        await wb.begin(lost)  # another run took "lost" over
        await asyncio.sleep(0.3)

        assert await wa.refresh([mine, stolen]) == ["lost/0"]
        idle = {
            p["message_id"].decode(): p["time_since_delivered"]
            for p in await pending(redis_backend)
        }
        assert idle[kept.entry_id] < 200
        assert idle[lost.entry_id] >= 300  # a lost lease is not renewed
        assert wa.fenced == []  # refresh reports; the caller stops the job


async def test_reclaim_takes_idle_entries_but_not_refreshed_ones(
    redis_backend: aioredis.Redis,
) -> None:
    queue = JobQueue(redis_backend)
    alive, dead = await deliver(redis_backend, make_job("alive"), make_job("dead"))
    async with journals(redis_backend, "wa") as (wa,):
        lease = await wa.begin(alive)
        assert await queue.reclaim(JOBS, "wb", min_idle_ms=300, count=10) == []
        await asyncio.sleep(0.4)
        assert await wa.refresh([lease]) == []
        reclaimed = await queue.reclaim(JOBS, "wb", min_idle_ms=300, count=10)
    assert [d.job for d in reclaimed] == [dead.job]
    assert reclaimed[0].entry_id == dead.entry_id
    owners = {p["message_id"].decode(): p["consumer"] for p in await pending(redis_backend)}
    assert owners == {alive.entry_id: b"wa", dead.entry_id: b"wb"}
    # Reclaiming again right away finds nothing: the entry's idle time restarted.
    assert await queue.reclaim(JOBS, "wc", min_idle_ms=300, count=10) == []


async def test_reclaim_respects_count_and_skips_deleted_entries(
    redis_backend: aioredis.Redis,
) -> None:
    queue = JobQueue(redis_backend)
    deliveries = await deliver(redis_backend, *(make_job(f"r{i}") for i in range(4)))
    await redis_backend.xdel(STREAM, deliveries[0].entry_id)  # pending, but its entry is gone
    await asyncio.sleep(0.05)
    first = await queue.reclaim(JOBS, "wb", min_idle_ms=10, count=2)
    rest = await queue.reclaim(JOBS, "wb", min_idle_ms=10, count=10)
    # (Under load ``rest`` may take ``first``'s entries again: they idled 10 ms more.)
    assert {d.job.request_id for d in first + rest} == {"r1", "r2", "r3"}
    assert len(first) <= 2
    owners = {p["message_id"].decode(): p["consumer"] for p in await pending(redis_backend)}
    assert deliveries[0].entry_id not in owners or owners[deliveries[0].entry_id] == b"wa"


# -------------------------------------------------------------------- token packing


@settings(max_examples=50)
@given(st.lists(st.integers(-(2**31), 2**31 - 1), max_size=200))
def test_pack_unpack_round_trip(token_ids: list[int]) -> None:
    packed = pack_tokens(token_ids)
    assert len(packed) == 4 * len(token_ids)
    assert unpack_tokens(packed) == token_ids


@settings(max_examples=50)
@given(st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=8), max_size=8))
def test_appending_packed_chunks_is_packing_the_concatenation(chunks: list[list[int]]) -> None:
    """The journal APPENDs one packed chunk per step: the log must read back whole."""
    log = b"".join(pack_tokens(chunk) for chunk in chunks)
    assert unpack_tokens(log) == [t for chunk in chunks for t in chunk]


def test_pack_refuses_ids_outside_int32() -> None:
    for bad in (2**31, -(2**31) - 1):
        with pytest.raises(struct.error):
            pack_tokens([bad])


# ----------------------------------------------------------------------- failures


def lose_one_reply(journal: Journal) -> list[Exception]:
    """The next write script runs, then its reply is lost (reset, socket timeout).

    Returns the pending failure: empty once it was raised (and the write retried).
    """
    lost = journal.scripts.lose_write_replies
    lost.append(RedisConnectionError("connection reset after the script ran"))
    return lost


async def test_a_failed_write_is_retried(wa: Journal, redis_backend: aioredis.Redis) -> None:
    [delivery] = await deliver(redis_backend, make_job("r1"))
    lease = await wa.begin(delivery)
    wa.scripts.fail_writes.append(RedisConnectionError("connection reset"))
    events = emit(wa.journal, lease, [1], [2])
    await asyncio.wait_for(wa.flush(), 5.0)
    assert wa.scripts.fail_writes == []
    assert await replies(redis_backend) == events
    assert await emitted(redis_backend, "r1/0") == [1, 2]


async def test_a_write_whose_reply_was_lost_is_not_applied_twice(
    wa: Journal, redis_backend: aioredis.Redis
) -> None:
    """The retry of a write that ran (its reply lost to a reset or a socket timeout)."""
    [delivery] = await deliver(redis_backend, make_job("r1"))
    lease = await wa.begin(delivery)
    lost_replies = lose_one_reply(wa)
    events = emit(wa.journal, lease, [1], [2])
    await asyncio.wait_for(wa.flush(), 5.0)
    assert lost_replies == []  # the reply was lost once, and the write retried
    assert await emitted(redis_backend, "r1/0") == [1, 2]
    assert await replies(redis_backend) == events
    assert await redis_backend.hget(names.job_run("r1/0", STAGE), "seq") == b"2"

    # Later writes still land (each carries a larger seq), and so does the finish.
    more = emit(wa.journal, lease, [3])
    final = fin(lease)
    wa.journal.finish(lease, final)
    await asyncio.wait_for(wa.flush(), 5.0)
    assert await replies(redis_backend) == [*events, *more, final]
    assert await redis_backend.xlen(STREAM) == 0
    assert await redis_backend.get(DONE) == b"1"
    assert wa.fenced == []


async def test_a_finish_whose_reply_was_lost_is_not_applied_twice(
    wa: Journal, redis_backend: aioredis.Redis
) -> None:
    first, second = await deliver(redis_backend, make_job("r1"), make_job("r2"))
    lease = await wa.begin(first)
    lost_replies = lose_one_reply(wa)
    events = emit(wa.journal, lease, [1])
    final = fin(lease)
    wa.journal.finish(lease, final)
    await asyncio.wait_for(wa.flush(), 5.0)
    assert lost_replies == []
    assert await replies(redis_backend) == [*events, final]
    assert await entry_ids(redis_backend) == [second.entry_id]
    assert await redis_backend.exists(*run_keys("r1/0")) == 0
    assert await redis_backend.get(DONE) == b"1"


async def test_a_finish_whose_reply_was_lost_is_not_reported_as_fenced(
    wa: Journal, redis_backend: aioredis.Redis
) -> None:
    [delivery] = await deliver(redis_backend, make_job("r1"))
    lease = await wa.begin(delivery)
    lost_replies = lose_one_reply(wa)
    wa.journal.finish(lease, fin(lease))
    await asyncio.wait_for(wa.flush(), 5.0)
    assert lost_replies == []
    assert wa.fenced == []


async def test_a_refreshed_lease_does_not_expire(redis_backend: aioredis.Redis) -> None:
    [delivery] = await deliver(redis_backend, make_job("long"))
    async with journals(redis_backend, "wa", run_ttl_s=0.4) as (wa,):
        lease = await wa.begin(delivery)
        for _ in range(6):  # the janitor refreshes every 0.5 s; here every 0.1 s
            assert await wa.refresh([lease]) == []
            for key in run_keys("long/0"):
                assert 300 < await redis_backend.pttl(key) <= 400
            emit(wa.journal, lease, [1])
            await wa.flush()
            await asyncio.sleep(0.1)
        assert wa.fenced == []
        assert await emitted(redis_backend, "long/0") == [1] * 6


async def test_refresh_renews_every_claim_and_sets_the_ttl_only_when_due(
    redis_backend: aioredis.Redis,
) -> None:
    now = [1_000.0]
    jobs = [make_job(f"r{i}") for i in range(3)]
    deliveries = await deliver(redis_backend, *jobs)
    async with journals(redis_backend, "wa", run_ttl_s=100.0, clock=lambda: now[0]) as (wa,):
        leases = [await wa.begin(d) for d in deliveries]
        await asyncio.sleep(0.3)
        for lease in leases:  # as if set long ago
            await redis_backend.pexpire(lease.run_key, 50_000)
        now[0] += 5.0  # less than a tenth of the TTL since the first renewal
        assert await wa.refresh(leases) == []
        assert await wa.refresh(leases) == []
        idle = [p["time_since_delivered"] for p in await pending(redis_backend)]
        assert len(idle) == 3 and max(idle) < 200  # every claim renewed (one XCLAIM)
        assert 40_000 < await redis_backend.pttl(leases[0].run_key) <= 50_000  # not due
        now[0] += 10.0
        assert await wa.refresh(leases) == []
        for lease in leases:
            assert 90_000 < await redis_backend.pttl(lease.run_key) <= 100_000
            assert 90_000 < await redis_backend.pttl(lease.emitted_key) <= 100_000


async def test_an_unrefreshed_lease_expires(redis_backend: aioredis.Redis) -> None:
    """The TTL still bounds a run nobody renews (a dead worker's keys do not leak)."""
    [delivery] = await deliver(redis_backend, make_job("dead"))
    async with journals(redis_backend, "wa", run_ttl_s=0.2) as (wa,):
        lease = await wa.begin(delivery)
        emit(wa.journal, lease, [1])
        await wa.flush()
        await asyncio.sleep(0.3)
        assert await redis_backend.exists(*run_keys("dead/0")) == 0
        assert await wa.refresh([lease]) == ["dead/0"]  # and nothing recreates them
        assert await redis_backend.exists(*run_keys("dead/0")) == 0


async def test_flush_raises_after_the_journal_gave_up(
    redis_backend: aioredis.Redis,
) -> None:
    [delivery] = await deliver(redis_backend, make_job("r1"))
    scripts = FaultyScripts(redis_backend)
    journal = RunJournal(redis_backend, consumer="wa", retry_for_s=0.1, scripts=scripts)
    lease = await journal.begin(delivery)
    scripts.writes_down = True
    task = asyncio.create_task(journal.run())
    emit(journal, lease, [1])
    with pytest.raises(RedisConnectionError):
        await asyncio.wait_for(task, 5.0)
    with pytest.raises(RedisError, match="the journal stopped: Connection refused"):
        await asyncio.wait_for(journal.flush(), 0.3)
    emit(journal, lease, [2])  # a job that is still running publishes its next step
    journal.finish(lease, fin(lease))
    with pytest.raises(RedisError, match="the journal stopped"):
        await asyncio.wait_for(journal.flush(), 0.3)  # raises at once, never hangs
    # Nothing reached Redis: the run is as begin left it, for a takeover to restart.
    assert await replies(redis_backend) == []
    assert await run_fields(redis_backend) == {
        b"owner": lease.fence.encode(),
        b"starts": b"1",
    }


async def test_a_flush_waiting_when_the_journal_gives_up_raises(
    redis_backend: aioredis.Redis,
) -> None:
    """Not only a flush() started afterwards: its writes never reached Redis either."""
    [delivery] = await deliver(redis_backend, make_job("r1"))
    scripts = FaultyScripts(redis_backend)
    journal = RunJournal(redis_backend, consumer="wa", retry_for_s=0.1, scripts=scripts)
    lease = await journal.begin(delivery)
    scripts.writes_down = True
    task = asyncio.create_task(journal.run())
    try:
        emit(journal, lease, [1])
        waiting = asyncio.create_task(journal.flush())
        await asyncio.sleep(0)
        assert not waiting.done()  # the write is still being retried
        with pytest.raises(RedisError, match="the journal stopped: Connection refused"):
            await asyncio.wait_for(waiting, 5.0)
    finally:
        await cancel_and_wait([task])
        if not task.cancelled():
            task.exception()


async def test_two_workers_never_both_own_a_run(redis_target: RedisTarget) -> None:
    """Concurrent begins on separate connections: exactly one lease writes afterwards."""
    await redis_target.flush()
    clients = [redis_target.connect() for _ in range(4)]
    try:
        [delivery] = await deliver(clients[0], make_job("race"))
        racers = [Journal(client, f"w{i}") for i, client in enumerate(clients)]
        tasks = [asyncio.create_task(r.journal.run()) for r in racers]
        try:
            leases = await asyncio.gather(*(r.journal.begin(delivery) for r in racers))
            assert sorted(lease.attempt for lease in leases) == [0, 1, 2, 3]
            for racer, lease in zip(racers, leases, strict=True):
                emit(racer.journal, lease, [lease.attempt])
            await asyncio.gather(*(r.journal.flush() for r in racers))
        finally:
            await cancel_and_wait(tasks)
        assert sorted(len(r.fenced) for r in racers) == [0, 1, 1, 1]
        winner = leases[[len(r.fenced) for r in racers].index(0)]
        assert winner.attempt == 3  # the last begin owns the run
        assert await emitted(clients[0], "race/0") == [3]
    finally:
        await clients[0].flushdb()
        for client in clients:
            await client.aclose()


async def test_one_pass_leaves_one_entry_per_reply_stream(
    wa: Journal, redis_backend: aioredis.Redis
) -> None:
    """An engine step's events for one gateway travel as one entry, in order."""
    other = "conveyor:reply:gw-other"
    first, second, third = await deliver(
        redis_backend, make_job("a"), make_job("b"), make_job("c", reply_to=other)
    )
    leases = [await wa.begin(d) for d in (first, second, third)]
    mine = emit(wa.journal, leases[0], [1], [2]) + emit(wa.journal, leases[1], [3])
    theirs = emit(wa.journal, leases[2], [4])
    await asyncio.wait_for(wa.flush(), 5.0)
    assert len(await entries(redis_backend, REPLY)) == 1
    assert await replies(redis_backend) == mine
    assert await replies(redis_backend, other) == theirs
