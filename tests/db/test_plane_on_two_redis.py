"""The control plane of a gateway over two Redis (docs/operations/several-hosts.md, "More than one
Redis"): a model's
usage rows, a dead gateway's requests and the LoRA desired state are handled on the Redis
the model lives on; the SQL ledger is one."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import fakeredis
from fakeredis.aioredis import FakeRedis

from gateway.catalog.served_models import ServedModel
from gateway.control.plane import ControlPlane
from gateway.db.engine import Database
from shared.connections.model_redis import ModelRedis
from shared.queue import names
from shared.queue.job_queue import JobQueue, OpenedBy
from shared.queue.lora_registry import adapter_stream, desired_generation, read_desired
from shared.queue.open_requests import OpenRequest
from shared.roles import Role
from shared.settings import Settings
from tests.contract.test_run_journal import STREAM, make_job
from tests.db.test_ledger import rows
from tests.db.test_lora_routes import ADMIN, ADMIN_KEY
from tests.gateway.fake_lora_worker import WORKER_ID, FakeLoraWorker
from tests.gateway.harness import CHAT, EMBED_MODEL, USER, live_gateway
from tests.support.sql import SqlTarget

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
    job = make_job("r1", reply_to=names.reply_stream(DEAD))
    await queue.submit(STREAM, [job], max_depth=10, opened=OpenedBy(DEAD, opened))
    await shard.hset(names.sent_tally("r1"), mapping={"c": 3, "f:0": "stop|0|0"})

    assert await plane.orphan_usage.sweep() == 0  # the home Redis's sweep: nothing there
    await sweep.sweep()  # first sighting of the missing liveness key
    await asyncio.sleep(0.1)
    assert await sweep.sweep() == 1
    assert plane.orphan_rows() == 1
    assert await shard.xlen(names.USAGE_STREAM) == 1 and await home.xlen(names.USAGE_STREAM) == 0
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


async def test_an_adapter_of_a_model_on_its_own_redis_is_published_and_served_there(
    served_model: ServedModel, sql_target: SqlTarget, database: Database, tmp_path: Path
) -> None:
    home_server, shard_server = fakeredis.FakeServer(), fakeredis.FakeServer()
    models = ModelRedis(
        "redis://home:6379/0",
        {"tiny": "redis://shard:6379/0"},
        lambda url: FakeRedis(server=shard_server),
        home=FakeRedis(server=home_server),
    )
    async with live_gateway(
        served_model,
        workers=[(Role.EMBED, EMBED_MODEL)],
        model_redis=models,
        redis_url="redis://home:6379/0",
        database_url=sql_target.url,
        admin_key=ADMIN_KEY,
        lora_load_timeout_s=2.0,
        lora_roots=str(tmp_path),
    ) as live:
        cells = live.state.cells
        plane = ControlPlane(
            live.state.settings,
            live.redis,
            "gw-test",
            bases=live.state.catalog.bases,
            cells=[cell.redis for cell in cells.others()],
            redis_for=models.for_model,
        )
        await plane.start()
        live.state.attach(plane)
        shard = cells.for_model("tiny").redis
        worker = FakeLoraWorker(shard, "tiny")  # the model's worker: only its own Redis
        await worker.start()
        await cells.for_model("tiny").directory.refresh()
        try:
            folder = tmp_path / "a1"
            folder.mkdir()
            body = {"name": "a1", "path": str(folder), "base_model": "tiny"}
            added = await live.client.post("/admin/loras", json=body, headers=ADMIN)
            assert added.status_code == 200, added.text
            assert added.json()["loaded_on"] == [WORKER_ID]
            desired = await read_desired(shard, "tiny")
            assert desired is not None and set(desired.specs) == {"a1"}
            assert await read_desired(live.redis, "tiny") is None
            await cells.for_model("tiny").directory.refresh()
            answered = await live.client.post(
                CHAT, json={"model": "a1", "messages": USER, "max_tokens": 2}, headers=ADMIN
            )
            assert answered.status_code == 200, answered.text
            [job] = worker.readers["a1"].generate_jobs()
            assert job.reply_to == cells.for_model("tiny").router.stream
            assert await shard.exists(adapter_stream("a1")) == 1
            assert await live.redis.exists(adapter_stream("a1")) == 0
            listed = (await live.client.get("/admin/loras", headers=ADMIN)).json()["data"]
            assert [a["workers"] for a in listed] == [{WORKER_ID: "loaded"}]
        finally:
            await worker.stop()
            await plane.stop()
