"""Usage of a request whose gateway died (shared/queue/open_requests.py,
gateway/control/orphan_usage.py):
admission opens it, the run journal tallies what it sent, a sweep on a live gateway
writes its row exactly once. On fakeredis and the real Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
import redis.asyncio as aioredis

from gateway.control.orphan_usage import OrphanUsageSweep
from shared.protocol import ErrorEvent, FinishEvent
from shared.queue import names
from shared.queue.job_queue import Admission, JobQueue, OpenedBy
from shared.queue.key_limits import BudgetPeriod, LimitCharge, Limits
from shared.queue.liveness import GatewayWatch
from shared.queue.open_requests import (
    Finish,
    OpenRequest,
    OpenRequests,
    SentTally,
    decode_open,
    encode_open,
    orphan_record,
)
from shared.queue.usage import UsageRecord, decode_usage
from tests.contract.test_run_journal import JOBS, STREAM, Journal, journals, make_job, tok

DEAD = "gw-dead"
OPENED = OpenRequest(key_id="key_a", model="m", prompt_tokens=3, n=2, received_unix=1000.0)


@pytest.fixture
async def wa(redis_backend: aioredis.Redis) -> AsyncIterator[Journal]:
    async with journals(redis_backend, "wa") as (journal,):
        yield journal


async def admit(redis: aioredis.Redis, request_id: str, gateway: str = DEAD) -> None:
    """Queue a 2-choice request opened by ``gateway`` and run it on worker ``wa``: choice
    0 sends 2 + 3 tokens and finishes (4 prompt tokens cached); choice 1 sends 1 token and
    is still running."""
    queue = JobQueue(redis)
    await queue.ensure_group(STREAM)
    reply_to = names.reply_stream(gateway)
    jobs = [make_job(request_id, index, reply_to=reply_to) for index in (0, 1)]
    await queue.submit(STREAM, jobs, max_depth=100, opened=OpenedBy(gateway, OPENED))


async def run_jobs(redis: aioredis.Redis, journal: Journal) -> None:
    deliveries = await JobQueue(redis).read([JOBS], "wa", count=2, block_ms=100)
    first, second = await journal.begin_all(deliveries)
    for lease, token_lists in ((first, ([1, 2], [3, 4, 5])), (second, ([6],))):
        for token_ids in token_lists:
            journal.publish(lease, tok(lease, token_ids), token_ids)
    job = first.delivery.job
    journal.finish(first, FinishEvent(job.request_id, 0, first.take_seq(), 0, "length", 3, 5, 4))
    await journal.flush()


async def usage_entries(redis: aioredis.Redis) -> list[UsageRecord]:
    found: Any = await redis.xrange(names.USAGE_STREAM)
    return [decode_usage(fields) for _, fields in found]


def sweep(redis: aioredis.Redis, gateway_id: str) -> OrphanUsageSweep:
    return OrphanUsageSweep(redis, gateway_id, GatewayWatch(redis, grace_s=0.0))


async def test_admission_opens_and_the_journal_tallies_what_it_sent(
    redis_backend: aioredis.Redis, wa: Journal
) -> None:
    await admit(redis_backend, "r1")
    await run_jobs(redis_backend, wa)
    book = OpenRequests(redis_backend)
    opened = await book.opened(DEAD)
    assert decode_open(opened["r1"]) == OPENED
    assert 86_000 < await redis_backend.ttl(names.open_requests(DEAD)) <= 86_400
    assert await redis_backend.smembers(names.GATEWAY_SET) == {DEAD.encode()}
    sent = await book.sent("r1")
    assert sent.completion_tokens == 6
    assert sent.finishes == {0: Finish("length", 4, 0)}
    assert sent.first_token_unix is not None and abs(sent.first_token_unix - time.time()) < 60
    assert await redis_backend.pttl(names.sent_tally("r1")) > 3_000_000


async def test_a_dead_gateways_request_gets_one_row_from_what_was_sent(
    redis_backend: aioredis.Redis, wa: Journal
) -> None:
    await admit(redis_backend, "r1")
    await run_jobs(redis_backend, wa)
    sweeps = [sweep(redis_backend, "gw-a"), sweep(redis_backend, "gw-b")]
    written = await asyncio.gather(*(s.sweep() for s in sweeps), sweeps[0].sweep())
    assert sum(written) == 1
    [record] = await usage_entries(redis_backend)
    assert (record.request_id, record.key_id, record.model, record.n) == ("r1", "key_a", "m", 2)
    assert (record.prompt_tokens, record.completion_tokens) == (3, 6)
    assert (record.cached_prompt_tokens, record.status) == (3, "failed")  # capped at the prompt
    assert record.finish_reason == "length"
    assert await redis_backend.exists(names.open_requests(DEAD), names.sent_tally("r1")) == 0


async def test_the_sweep_settles_a_dead_gateways_limit_reservation(
    redis_backend: aioredis.Redis, wa: Journal
) -> None:
    limits = Limits(tpm=1000, max_concurrent=2, budget_tokens=5000, budget_period=BudgetPeriod.DAY)
    charge = LimitCharge("key_a", limits, "r1", cost_tokens=100, now_unix=time.time())
    opened = OpenedBy(DEAD, msgspec.structs.replace(OPENED, reservation=charge.reservation()))
    queue = JobQueue(redis_backend)
    await queue.ensure_group(STREAM)
    jobs = [make_job("r1", index, reply_to=names.reply_stream(DEAD)) for index in (0, 1)]
    admitted = await queue.submit(STREAM, jobs, max_depth=100, charge=charge, opened=opened)
    assert admitted.outcome is Admission.QUEUED, admitted
    tpm_key, conc_key, budget_key = charge.reservation().counters
    assert [await redis_backend.get(k) for k in (tpm_key, budget_key)] == [b"100", b"100"]
    assert await redis_backend.zcard(conc_key) == 1
    await run_jobs(redis_backend, wa)

    assert await sweep(redis_backend, "gw-a").sweep() == 1
    used = b"9"  # 3 prompt tokens + the 6 the workers sent; the rest was given back
    assert [await redis_backend.get(k) for k in (tpm_key, budget_key)] == [used, used]
    assert await redis_backend.zcard(conc_key) == 0


async def test_a_live_gateway_is_never_swept(redis_backend: aioredis.Redis, wa: Journal) -> None:
    await admit(redis_backend, "r1")
    await redis_backend.set(names.gateway_heartbeat(DEAD), b"1", px=10_000)
    assert await sweep(redis_backend, "gw-a").sweep() == 0
    assert await sweep(redis_backend, DEAD).sweep() == 0  # nor its own, by itself
    assert await usage_entries(redis_backend) == []
    assert await redis_backend.hexists(names.open_requests(DEAD), "r1")


async def test_a_request_its_gateway_closed_is_not_counted_again(
    redis_backend: aioredis.Redis, wa: Journal
) -> None:
    await admit(redis_backend, "r1")
    await run_jobs(redis_backend, wa)
    record = orphan_record("r1", OPENED, SentTally(completion_tokens=6))
    await OpenRequests(redis_backend).close(DEAD, record)  # the gateway's own row
    assert await redis_backend.exists(names.open_requests(DEAD), names.sent_tally("r1")) == 0
    assert await sweep(redis_backend, "gw-a").sweep() == 0
    assert len(await usage_entries(redis_backend)) == 1


async def test_an_unreadable_open_entry_is_dropped(redis_backend: aioredis.Redis) -> None:
    await redis_backend.hset(names.open_requests(DEAD), "r9", b"9:junk")
    await redis_backend.sadd(names.GATEWAY_SET, DEAD)  # as admission does
    assert await sweep(redis_backend, "gw-a").sweep() == 0
    assert await redis_backend.exists(names.open_requests(DEAD)) == 0
    assert await redis_backend.smembers(names.GATEWAY_SET) == set()  # nothing left to sweep


def test_orphan_record_status_and_reasons() -> None:
    one = OpenRequest(key_id=None, model="m", prompt_tokens=5, n=1, received_unix=1.0)
    done = SentTally(4, 2.0, {0: Finish("stop", None, 1)})
    record = orphan_record("r", one, done)
    assert (record.status, record.finish_reason, record.migrations) == ("completed", "stop", 1)
    assert record.cached_prompt_tokens is None and record.first_token_unix == 2.0
    failed = orphan_record("r", one, SentTally(4, None, {0: Finish("error", None, 0)}))
    assert failed.status == "failed"
    assert orphan_record("r", one, SentTally()).finish_reason is None


def test_open_record_round_trip_and_version() -> None:
    assert decode_open(encode_open(OPENED)) == OPENED
    with pytest.raises(Exception, match="version"):
        decode_open(b"2:" + encode_open(OPENED)[2:])


async def test_an_error_event_is_tallied_as_a_finish(
    redis_backend: aioredis.Redis, wa: Journal
) -> None:
    await admit(redis_backend, "r2")
    deliveries = await JobQueue(redis_backend).read([JOBS], "wa", count=2, block_ms=100)
    lease = (await wa.begin_all(deliveries))[1]
    wa.finish(lease, ErrorEvent("r2", 1, lease.take_seq(), 0, 500, "server_error", None, "x"))
    await wa.flush()
    assert (await OpenRequests(redis_backend).sent("r2")).finishes == {1: Finish("error", None, 0)}
