"""The control plane of a gateway over two Redis (README "More than one Redis"): a model's
usage rows, a dead gateway's requests and the LoRA desired state are handled on the Redis
the model lives on; the SQL ledger is one."""

from __future__ import annotations

import asyncio
import time

from fakeredis.aioredis import FakeRedis

from gateway.control.plane import ControlPlane
from gateway.db.engine import Database
from shared import keys
from shared.adapters import desired_generation
from shared.job_queue import JobQueue, OpenedBy
from shared.open_requests import OpenRequest
from shared.settings import Settings
from tests.contract.test_run_journal import STREAM, make_job
from tests.db.conftest import SqlTarget
from tests.db.test_ledger import rows

DEAD = "gw-dead"


def _plane(sql_target: SqlTarget, home: FakeRedis, shard: FakeRedis) -> ControlPlane:
    settings = Settings(
        database_url=sql_target.url, redis_url="redis://home", gateway_liveness_ttl_s=0.05
    )
    return ControlPlane(
        settings,
        home,
        "gw-live",
        bases=lambda: ["tiny", "other"],
        cells=[shard],
        redis_for=lambda base: shard if base == "tiny" else home,
    )


async def test_a_dead_gateways_request_on_a_models_own_redis_is_settled_there(
    sql_target: SqlTarget, database: Database
) -> None:
    home, shard = FakeRedis(), FakeRedis()
    plane = _plane(sql_target, home, shard)
    ledger, sweep = plane.cell_usage[0]
    opened = OpenRequest(key_id="k", model="tiny", prompt_tokens=7, n=1, received_unix=time.time())
    queue = JobQueue(shard)
    await queue.ensure_group(STREAM)
    job = make_job("r1", reply_to=keys.reply_stream(DEAD))
    await queue.submit(STREAM, [job], max_depth=10, opened=OpenedBy(DEAD, opened))
    await shard.hset(keys.sent_tally("r1"), mapping={"c": 3, "f:0": "stop|0|0"})

    assert await plane.orphan_usage.sweep() == 0  # the home Redis's sweep: nothing there
    await sweep.sweep()  # first sighting of the missing liveness key
    await asyncio.sleep(0.1)
    assert await sweep.sweep() == 1
    assert plane.orphan_rows() == 1
    assert await shard.xlen(keys.USAGE_STREAM) == 1 and await home.xlen(keys.USAGE_STREAM) == 0
    assert await plane.backlog() == 1
    await ledger.ensure_group()
    while await ledger.step():
        pass
    [row] = await rows(database)
    assert (row.request_id, row.model, row.completion_tokens) == ("r1", "tiny", 3)
    assert len(plane.ledgers()) == 2
    await plane.database.dispose()


async def test_a_base_models_adapters_are_published_to_its_redis(
    sql_target: SqlTarget, database: Database
) -> None:
    home, shard = FakeRedis(), FakeRedis()
    plane = _plane(sql_target, home, shard)
    await plane.lora.publish_all()
    assert await desired_generation(shard, "tiny") == 1
    assert await desired_generation(home, "tiny") is None
    assert await desired_generation(home, "other") == 1
    assert await desired_generation(shard, "other") is None
    await plane.database.dispose()
