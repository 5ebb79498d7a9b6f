"""Background responses through the real gateway in process (fake workers, fakeredis,
the control plane on SQLite), driven by the official ``openai`` SDK: queued at once,
stored when done, streamed again with ``starting_after``, cancelled, taken over by
another runner after its gateway's runner died; bad input answers OpenAI's error shape."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import openai
import pytest
from openai import AsyncOpenAI
from openai.types.responses import Response

from gateway.catalog.served_models import ServedModel
from gateway.control.plane import ControlPlane
from gateway.control.records import Scope
from gateway.db.engine import Database
from gateway.openai.responses_api import request_id_of
from gateway.serving import background
from shared.protocol import Event, Job
from shared.queue import names
from shared.tasks import cancel_and_wait
from tests.db.test_inference_auth import ADMIN_KEY, new_key
from tests.gateway.fake_worker import finish, token
from tests.gateway.harness import LiveGateway, live_gateway
from tests.gateway.test_disconnects import endless
from tests.support.sql import SqlTarget
from tests.waiting import eventually

TOKENS = 10


async def paced(job: Job) -> AsyncIterator[Sequence[Event]]:
    for seq in range(TOKENS):
        yield [token(job, seq, f"w{seq} ")]
        await asyncio.sleep(0.03)
    yield [finish(job, TOKENS, TOKENS)]


EXPECTED = "".join(f"w{i} " for i in range(TOKENS))


@pytest.fixture
async def gateway(
    served_model: ServedModel, sql_target: SqlTarget, database: Database
) -> AsyncIterator[LiveGateway]:
    url = sql_target.url
    async with live_gateway(served_model, database_url=url, admin_key=ADMIN_KEY) as live:
        plane = ControlPlane(live.state.settings, live.redis, "gw-test")
        await plane.start()
        live.state.attach(plane)
        live.workers[0].script = paced
        try:
            yield live
        finally:
            await cancel_and_wait(list(live.state.runners.values()))
            await plane.stop()


def sdk(live: LiveGateway, secret: str) -> AsyncOpenAI:
    transport = httpx.ASGITransport(app=live.app)
    client = httpx.AsyncClient(transport=transport, base_url="http://gw")
    return AsyncOpenAI(api_key=secret, base_url="http://gw/v1", http_client=client)  # type: ignore[arg-type]


async def done(client: AsyncOpenAI, response_id: str) -> Response:
    seen: list[Response] = []

    async def finished() -> bool:
        seen.append(await client.responses.retrieve(response_id))
        return seen[-1].status not in ("queued", "in_progress")

    await eventually(finished, timeout_s=10.0, what="the response ended")
    return seen[-1]


async def test_background_is_queued_then_stored_then_streamed_again(gateway: LiveGateway) -> None:
    client = sdk(gateway, await new_key(gateway, {Scope.INFERENCE}))
    made = await client.responses.create(model="tiny", input="hi", background=True)
    assert made.status == "queued" and made.background is True
    final = await done(client, made.id)
    assert final.status == "completed" and final.output_text == EXPECTED
    everything = [e async for e in await client.responses.retrieve(made.id, stream=True)]
    numbers = [e.sequence_number for e in everything]
    assert numbers == list(range(len(everything)))
    assert everything[-1].type == "response.completed"
    later = [
        e async for e in await client.responses.retrieve(made.id, stream=True, starting_after=5)
    ]
    assert [e.sequence_number for e in later] == numbers[6:]
    deltas = [e.delta for e in everything if e.type == "response.output_text.delta"]
    assert "".join(deltas) == EXPECTED


async def test_cancel_stops_a_background_response(gateway: LiveGateway) -> None:
    gateway.workers[0].script = endless
    client = sdk(gateway, await new_key(gateway, {Scope.INFERENCE}))
    made = await client.responses.create(model="tiny", input="hi", background=True)
    await eventually(lambda: _has_events(gateway, made.id), what="the response started")
    cancelled = await client.responses.cancel(made.id)
    assert cancelled.status == "cancelled"
    assert await gateway.redis.get(names.cancel_flag(request_id_of(made.id))) == b"1"
    await eventually(lambda: _runners_gone(gateway), what="the runner stopped")
    assert (await client.responses.retrieve(made.id)).status == "cancelled"
    assert (await client.responses.cancel(made.id)).status == "cancelled"  # idempotent
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(model="tiny", input="more", previous_response_id=made.id)
    assert refused.value.body["param"] == "previous_response_id"  # type: ignore[index]


async def test_a_background_response_is_taken_over(gateway: LiveGateway) -> None:
    client = sdk(gateway, await new_key(gateway, {Scope.INFERENCE}))
    made = await client.responses.create(model="tiny", input="hi", background=True)
    await eventually(lambda: _has_events(gateway, made.id, 6), what="some events rendered")
    request_id = request_id_of(made.id)
    await cancel_and_wait([gateway.state.runners[request_id]])  # its gateway "died"
    await gateway.redis.delete(names.gateway_heartbeat(names.request_holder(request_id)))
    assert await background.take_over(gateway.state, gateway.redis) == 1
    final = await done(client, made.id)
    assert final.output_text == EXPECTED
    events = [e async for e in await client.responses.retrieve(made.id, stream=True)]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert "".join(deltas) == EXPECTED  # every event once, though rendered twice


async def test_bad_background_requests(gateway: LiveGateway) -> None:
    client = sdk(gateway, await new_key(gateway, {Scope.INFERENCE}))
    other = sdk(gateway, await new_key(gateway, {Scope.INFERENCE}))
    plain = await client.responses.create(model="tiny", input="hi", max_output_tokens=2)
    made = await client.responses.create(model="tiny", input="hi", background=True)
    final = await done(client, made.id)
    checks: list[tuple[Any, type[Exception], str | None]] = [
        (client.responses.cancel(plain.id), openai.BadRequestError, None),
        (client.responses.cancel(made.id), openai.BadRequestError, None),
        (other.responses.cancel(made.id), openai.NotFoundError, None),
        (other.responses.retrieve(made.id), openai.NotFoundError, None),
        (client.responses.retrieve(plain.id, stream=True), openai.BadRequestError, "stream"),
        (
            client.responses.retrieve(made.id, stream=True, starting_after=10_000),
            openai.BadRequestError,
            "starting_after",
        ),
        (
            client.responses.create(model="tiny", input="x", previous_response_id="resp_nope"),
            openai.NotFoundError,
            "previous_response_id",
        ),
        (
            client.responses.create(model="tiny", input="x", background=True, store=False),
            openai.BadRequestError,
            "background",
        ),
    ]
    for call, error, param in checks:
        with pytest.raises(error) as refused:
            await call
        body = refused.value.body  # type: ignore[attr-defined]
        assert set(body) == {"message", "type", "param", "code"}, body
        if param is not None:
            assert body["param"] == param
    assert final.status == "completed"
    await eventually(lambda: _runners_gone(gateway), what="nothing left running")


async def _has_events(live: LiveGateway, response_id: str, count: int = 1) -> bool:
    return int(await live.redis.xlen(names.response_events(response_id))) >= count


async def _runners_gone(live: LiveGateway) -> bool:
    return not live.state.runners
