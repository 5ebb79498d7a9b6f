"""A request whose gateway died reaches the SQL ledger once, from what its workers sent
(open record at admission -> sent tally -> sweep -> conveyor:usage -> consumer -> SQL).

Runs on fakeredis and the real Redis, each against SQLite and PostgreSQL."""

from __future__ import annotations

import time

import redis.asyncio as aioredis

from gateway.control.ledger import LedgerConsumer
from gateway.control.orphan_usage import OrphanUsageSweep
from gateway.db.engine import Database
from shared.queue import names
from shared.queue.job_queue import JobQueue, OpenedBy
from shared.queue.liveness import GatewayWatch
from shared.queue.open_requests import OpenRequest, OpenRequests, SentTally, orphan_record
from tests.contract.test_run_journal import STREAM, make_job
from tests.db.test_ledger import FAST, rows

DEAD = "gw-dead"


async def test_a_dead_gateways_request_is_one_ledger_row(
    redis_backend: aioredis.Redis, database: Database
) -> None:
    received = time.time() - 5
    opened = OpenRequest(key_id="key_a", model="m", prompt_tokens=7, n=1, received_unix=received)
    queue = JobQueue(redis_backend)
    await queue.ensure_group(STREAM)
    job = make_job("r1", reply_to=names.reply_stream(DEAD))
    await queue.submit(STREAM, [job], max_depth=10, opened=OpenedBy(DEAD, opened))
    first_ms = int((received + 1) * 1000)
    await redis_backend.hset(
        names.sent_tally("r1"), mapping={"c": 9, "t": first_ms, "f:0": "stop|4|1"}
    )

    sweep = OrphanUsageSweep(redis_backend, "gw-live", GatewayWatch(redis_backend, grace_s=0.0))
    assert await sweep.sweep() == 1
    # The dead gateway was only stalled, and writes its own row late: still one row.
    late = orphan_record("r1", opened, SentTally(completion_tokens=3))
    await OpenRequests(redis_backend).close(DEAD, late)
    consumer = LedgerConsumer(redis_backend, database.sessions, "gw-live", FAST)
    await consumer.ensure_group()
    while await consumer.step():
        pass
    [row] = await rows(database)
    assert (row.request_id, row.key_id, row.model, row.status) == ("r1", "key_a", "m", "completed")
    assert (row.prompt_tokens, row.completion_tokens, row.cached_prompt_tokens) == (7, 9, 4)
    assert (row.finish_reason, row.migrations, row.n) == ("stop", 1, 1)
    assert row.first_token_at is not None
    assert abs(row.first_token_at.timestamp() - (received + 1)) < 0.01
    assert consumer.status.duplicates_skipped == 1
