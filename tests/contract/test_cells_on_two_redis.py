"""A gateway over two real Redis (gateway/dispatch/cells.py, shared/connections/model_redis.py):
the home
Redis (127.0.0.1:6379, a test database) and a private redis-server on a free port.

``tiny`` and ``tiny-embed-2`` live on the second Redis, ``tiny-embed`` on the home one. The
gateway (in process, real admission Lua, real reply routers) and the fake workers
(tests/gateway/fake_worker.py) talk to both over TCP. What is checked: each model's jobs,
replies, usage rows and key-limit counters are on its own Redis; key limits count per
Redis; killing the second Redis answers its models with 503 while the home one serves,
and a restart (AOF replayed) serves again.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import pytest
import redis
import redis.asyncio as aioredis

from gateway.catalog.served_models import ModelKind, ServedModel
from gateway.dispatch.plan import Deadline, Embedding, RequestPlan
from shared.connections.connect import connect
from shared.connections.model_redis import ModelRedis
from shared.errors import KeyRateLimited
from shared.queue import names
from shared.queue.key_limits import LimitCharge, Limits
from shared.roles import Role
from tests.gateway.fake_worker import silent
from tests.gateway.harness import BODIES, CHAT, EMBED_MODEL, EMBEDDINGS, LiveGateway, live_gateway
from tests.support.second_redis import PrivateRedis
from tests.waiting import eventually

pytestmark = [pytest.mark.redis, pytest.mark.timeout(120)]

HOME_URL = "redis://127.0.0.1:6379/11"
SHARDED_EMBED = "tiny-embed-2"


@pytest.fixture(scope="module")
def shard(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateRedis]:
    server = PrivateRedis.start_in(tmp_path_factory.mktemp("redis-2"))
    yield server
    server.kill()


@dataclass
class Cells:
    gateway: LiveGateway
    home: aioredis.Redis
    shard: aioredis.Redis
    server: PrivateRedis


@pytest.fixture
async def cells(served_model: ServedModel, shard: PrivateRedis) -> AsyncIterator[Cells]:
    if shard.process is None:
        shard.start()
    for url in (HOME_URL, shard.url):
        client = redis.Redis.from_url(url)
        client.flushdb()
        client.close()
    embed_2 = dataclasses.replace(served_model, name=SHARDED_EMBED, kind=ModelKind.EMBED)
    models = ModelRedis(HOME_URL, {"tiny": shard.url, SHARDED_EMBED: shard.url}, connect)
    workers = [(Role.AGGREGATED, "tiny"), (Role.EMBED, EMBED_MODEL), (Role.EMBED, SHARDED_EMBED)]
    async with live_gateway(
        served_model,
        workers=workers,
        more_models=[embed_2],
        model_redis=models,
        redis_url=HOME_URL,
        admission_retry_s=1.0,
    ) as live:
        home, second = connect(HOME_URL), connect(shard.url)
        yield Cells(live, home, second, shard)
        await home.aclose()
        await second.aclose()


async def test_each_model_lives_on_its_own_redis(cells: Cells) -> None:
    chat = await cells.gateway.client.post(CHAT, json={**BODIES[CHAT], "stream": True})
    assert chat.status_code == 200 and chat.text.endswith("data: [DONE]\n\n")
    home_embed = await cells.gateway.client.post(EMBEDDINGS, json=BODIES[EMBEDDINGS])
    assert home_embed.status_code == 200, home_embed.text

    reply = names.reply_stream("gw-test")
    assert await cells.shard.xlen(reply) > 0 and await cells.home.xlen(reply) == 1
    assert await cells.shard.exists(names.job_stream("tiny", Role.AGGREGATED)) == 1
    assert await cells.home.exists(names.job_stream("tiny", Role.AGGREGATED)) == 0
    assert await cells.home.exists(names.job_stream(EMBED_MODEL, Role.EMBED)) == 1

    async def rows_queued() -> bool:
        shard_rows = await cells.shard.xlen(names.USAGE_STREAM)
        home_rows = await cells.home.xlen(names.USAGE_STREAM)
        return bool(shard_rows == 1 and home_rows == 1)

    await eventually(rows_queued, what="one usage row queued on each Redis")


def _plan(model: str, limits: Limits) -> RequestPlan[Embedding]:
    request_id = f"embd-{model}-{time.monotonic_ns()}"
    return RequestPlan(
        request_id,
        model,
        Embedding(([1, 2, 3],), None),
        Deadline.after(30),
        None,
        "key-1",
        charge=LimitCharge("key-1", limits, request_id, 3, time.time()),
        base_model=model,
    )


async def test_key_limits_count_per_redis_and_settle_where_they_were_taken(cells: Cells) -> None:
    for worker in cells.gateway.workers:
        worker.script = silent
    one_at_a_time = Limits(max_concurrent=1)
    state = cells.gateway.state
    shard_cell, home_cell = state.cells.for_model(SHARDED_EMBED), state.cells.home
    first = await shard_cell.dispatcher.submit(_plan(SHARDED_EMBED, one_at_a_time))
    assert await cells.shard.zcard(names.key_concurrency("key-1")) == 1
    with pytest.raises(KeyRateLimited):  # the same Redis: the limit holds
        await shard_cell.dispatcher.submit(_plan(SHARDED_EMBED, one_at_a_time))
    # another Redis counts on its own: documented (docs/operations/several-hosts.md, "More than one
    # Redis")
    other = await home_cell.dispatcher.submit(_plan(EMBED_MODEL, one_at_a_time))
    assert await cells.home.zcard(names.key_concurrency("key-1")) == 1

    async with first:
        pass  # closed unfinished: cancelled, its slot given back on the shard
    async with other:
        pass
    await state.cells.wait_background()
    assert await cells.shard.zcard(names.key_concurrency("key-1")) == 0
    assert await cells.home.zcard(names.key_concurrency("key-1")) == 0
    assert await cells.shard.get(names.cancel_flag(first.request_id)) == b"1"
    assert await cells.home.get(names.cancel_flag(first.request_id)) is None
    again = await shard_cell.dispatcher.submit(_plan(SHARDED_EMBED, one_at_a_time))
    async with again:
        pass
    await state.cells.wait_background()


async def test_a_dead_redis_fails_only_its_models_and_a_restart_serves_again(
    cells: Cells,
) -> None:
    cells.server.kill()
    started = time.monotonic()
    chat = await cells.gateway.client.post(CHAT, json=BODIES[CHAT])
    assert chat.status_code == 503, chat.text
    assert chat.json()["error"]["code"] == "backend_unavailable"
    assert time.monotonic() - started < 10
    embed = await cells.gateway.client.post(EMBEDDINGS, json=BODIES[EMBEDDINGS])
    assert embed.status_code == 200, embed.text
    ready = await cells.gateway.client.get("/ready")
    assert ready.status_code == 503
    assert any("unreachable" in problem for problem in ready.json()["problems"])

    cells.server.start()  # same port and folder: the AOF brings the registry back
    for role, model in [(Role.AGGREGATED, "tiny")]:
        await cells.gateway.add_worker(role, model)  # the fake worker died with its Redis

    async def serves() -> bool:
        response = await cells.gateway.client.post(
            CHAT, json=BODIES[CHAT], headers={"X-Request-Timeout": "5"}
        )
        return response.status_code == 200

    await eventually(serves, timeout_s=20, what="the sharded model serves again")
