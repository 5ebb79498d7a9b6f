"""A gateway over two Redis (gateway/dispatch/cells.py): ``tiny`` lives on its own Redis,
``tiny-embed`` (and the control plane) on the home one. Each request's jobs, events,
cancel and images stay on its model's Redis; /ready needs both."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any
from unittest import mock

import fakeredis
import pytest
from fakeredis.aioredis import FakeRedis
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.catalog.served_models import ServedModel
from shared.connections.connect import db_of
from shared.connections.model_redis import ModelRedis
from shared.protocol import CancelCommand, decode_bytes
from shared.queue import names
from shared.queue.liveness import WorkerRegistration, WorkerRegistry
from shared.roles import Role
from tests.gateway.fake_worker import silent
from tests.gateway.harness import BODIES, CHAT, EMBEDDINGS, LiveGateway, live_gateway
from tests.waiting import eventually

HOME_URL, SHARD_URL = "redis://home:6379/0", "redis://shard:6379/0"


@dataclass
class TwoRedis:
    gateway: LiveGateway
    home: fakeredis.FakeServer
    shard: fakeredis.FakeServer

    def client(self, server: fakeredis.FakeServer) -> FakeRedis:
        return FakeRedis(server=server)


@pytest.fixture
async def two(served_model: ServedModel) -> AsyncIterator[TwoRedis]:
    home, shard = fakeredis.FakeServer(), fakeredis.FakeServer()
    models = ModelRedis(
        HOME_URL,
        {"tiny": SHARD_URL},
        lambda url: FakeRedis(server=shard),
        home=FakeRedis(server=home),
    )
    async with live_gateway(
        served_model, model_redis=models, redis_url=HOME_URL, admission_retry_s=0.5
    ) as live:
        yield TwoRedis(live, home, shard)


async def _stream_keys(client: FakeRedis, pattern: str) -> set[str]:
    return {key.decode() async for key in client.scan_iter(pattern)}


async def test_there_is_one_cell_per_redis(two: TwoRedis) -> None:
    cells = two.gateway.state.cells
    assert cells.sharded
    assert [cell.name for cell in cells.all()] == ["home", "redis://shard:6379/0"]
    assert cells.for_model("tiny") is not cells.home
    assert cells.for_model("tiny-embed") is cells.home


async def test_each_model_is_queued_on_its_own_redis_and_answered_through_its_cell(
    two: TwoRedis,
) -> None:
    chat = await two.gateway.client.post(CHAT, json=BODIES[CHAT])
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["message"]["content"] == "c0-0 c0-1 "
    embed = await two.gateway.client.post(EMBEDDINGS, json=BODIES[EMBEDDINGS])
    assert embed.status_code == 200, embed.text

    home, shard = two.client(two.home), two.client(two.shard)
    reply = names.reply_stream("gw-test")
    # the chat tokens came back on the shard's reply stream, the embedding on home's
    assert await shard.xlen(reply) == 2 and await home.xlen(reply) == 1
    assert await _stream_keys(shard, "conveyor:jobs:*") == {"conveyor:jobs:tiny:aggregated"}
    assert await _stream_keys(home, "conveyor:jobs:*") == {"conveyor:jobs:tiny-embed:embed"}
    # each request's usage row is queued where it was admitted
    assert await shard.xlen(names.USAGE_STREAM) == 1
    assert await home.xlen(names.USAGE_STREAM) == 1


async def test_a_streamed_chat_comes_back_through_the_shard_reply_router(two: TwoRedis) -> None:
    response = await two.gateway.client.post(CHAT, json={**BODIES[CHAT], "stream": True})
    assert response.status_code == 200
    assert response.text.endswith("data: [DONE]\n\n")
    assert "c0-1" in response.text
    assert two.gateway.state.cells.for_model("tiny").router.stream == names.reply_stream("gw-test")


@pytest.mark.parametrize(
    ("path", "model", "on_shard"), [(CHAT, "tiny", True), (EMBEDDINGS, "tiny-embed", False)]
)
async def test_a_cancel_goes_to_the_redis_of_the_request(
    two: TwoRedis, path: str, model: str, on_shard: bool
) -> None:
    for worker in two.gateway.workers:
        worker.script = silent
    target, other = (two.shard, two.home) if on_shard else (two.home, two.shard)
    listener = two.client(target)
    control = listener.pubsub()
    await control.subscribe(names.command_channel(db_of(listener)))
    await control.get_message(timeout=1.0)

    async def queued() -> bool:
        return sum(len(worker.jobs) for worker in two.gateway.workers) == 1

    async with two.gateway.call(path, BODIES[path]) as call:
        await eventually(queued, what="the job reached its worker")
        call.leave()
        assert await call.start() == 499
        await call.finished()
    [job] = [job for worker in two.gateway.workers for job in worker.jobs]
    assert job.model == model
    message = await control.get_message(ignore_subscribe_messages=True, timeout=2.0)
    assert message is not None and decode_bytes(message["data"]) == CancelCommand(job.request_id)
    assert await listener.get(names.cancel_flag(job.request_id)) == b"1"
    assert await two.client(other).get(names.cancel_flag(job.request_id)) is None
    await control.aclose()  # type: ignore[no-untyped-call]


@contextlib.contextmanager
def _unreachable(client: Any) -> Iterator[None]:
    """Every command the gateway sends to ``client`` fails as a down Redis does. (The
    real outage, a killed redis-server, is in tests/contract and tests/e2e; fakeredis's
    own ``connected = False`` upsets CPython 3.11's parser in this process.)"""

    async def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RedisConnectionError("Connection refused (test)")

    with mock.patch.object(client, "execute_command", refuse):
        yield


async def _ready(two: TwoRedis) -> tuple[int, dict[str, Any]]:
    response = await two.gateway.client.get("/ready")
    body: dict[str, Any] = response.json()
    return response.status_code, body


async def test_ready_needs_every_redis_and_the_workers_of_every_model_on_it(
    two: TwoRedis,
) -> None:
    status, body = await _ready(two)
    assert status == 200, body
    assert body["models"]["tiny"] == {"workers": 1, "redis": "redis://shard:6379/0"}
    assert body["models"]["tiny-embed"] == {"workers": 1, "redis": "home"}

    with _unreachable(two.gateway.state.cells.for_model("tiny").redis):
        status, body = await _ready(two)
    assert status == 503
    assert any(p.startswith("redis (redis://shard:6379/0) unreachable") for p in body["problems"])


async def test_a_worker_on_the_wrong_redis_does_not_serve_its_model(
    served_model: ServedModel,
) -> None:
    home, shard = fakeredis.FakeServer(), fakeredis.FakeServer()
    models = ModelRedis(
        HOME_URL,
        {"tiny": SHARD_URL},
        lambda url: FakeRedis(server=shard),
        home=FakeRedis(server=home),
    )
    async with live_gateway(
        served_model, model_redis=models, redis_url=HOME_URL, workers=[(Role.EMBED, "tiny-embed")]
    ) as live:
        await WorkerRegistry(models.home, ttl_s=60).beat(
            WorkerRegistration(
                worker_id="misplaced",
                role=Role.AGGREGATED,
                model="tiny",
                max_model_len=2048,
                active=0,
                slots=8,
            )
        )
        await live.state.cells.home.directory.refresh()
        response = await live.client.get("/ready")
        assert response.status_code == 503
        assert response.json()["problems"] == ["no live worker serves tiny"]
        chat = await live.client.post(CHAT, json=BODIES[CHAT])
        assert chat.status_code == 503
        assert "no live worker serves model `tiny`" in chat.json()["error"]["message"]


async def test_a_sharded_model_without_its_redis_is_a_clean_503_while_the_other_serves(
    two: TwoRedis,
) -> None:
    with _unreachable(two.gateway.state.cells.for_model("tiny").redis):
        chat = await two.gateway.client.post(CHAT, json=BODIES[CHAT])
        embed = await two.gateway.client.post(EMBEDDINGS, json=BODIES[EMBEDDINGS])
    assert chat.status_code == 503, chat.text
    assert chat.json()["error"]["code"] == "backend_unavailable"
    assert embed.status_code == 200, embed.text
    await two.gateway.add_worker(Role.AGGREGATED, "tiny")  # the fake worker died with it
    chat = await two.gateway.client.post(
        CHAT, json=BODIES[CHAT], headers={"X-Request-Timeout": "10"}
    )
    assert chat.status_code == 200, chat.text


async def test_admin_lists_the_workers_of_every_redis(two: TwoRedis) -> None:
    state = (await two.gateway.client.get("/admin/state")).json()
    assert state["workers"] == sorted(
        [f"{Role.AGGREGATED}-test-tiny-x", f"{Role.EMBED}-test-tiny-embed-x"]
    )
    assert set(state["pools"]) == {"tiny", "tiny-embed"}
