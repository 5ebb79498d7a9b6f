"""A client that leaves gets its request cancelled on the workers (the cancel flag and a
CancelCommand on the command channel) and leaves nothing open in the gateway."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest
from redis.asyncio.client import PubSub

from shared.connections.connect import db_of
from shared.protocol import CancelCommand, Event, Job, decode_bytes
from shared.queue import names
from tests.gateway.fake_worker import silent, token
from tests.gateway.harness import BODIES, CHAT, EMBEDDINGS, LiveGateway
from tests.waiting import eventually


async def endless(job: Job) -> AsyncIterator[Sequence[Event]]:
    """Tokens every 20 ms, forever (until the test ends)."""
    seq = 0
    while True:
        yield [token(job, seq, f"t{seq} ")]
        seq += 1
        await asyncio.sleep(0.02)


@pytest.fixture
async def control(gateway: LiveGateway) -> AsyncIterator[PubSub]:
    pubsub = gateway.redis.pubsub()
    await pubsub.subscribe(names.command_channel(db_of(gateway.redis)))
    await pubsub.get_message(timeout=1.0)  # the subscribe confirmation
    yield pubsub
    await pubsub.aclose()  # type: ignore[no-untyped-call]


async def assert_cancelled(gateway: LiveGateway, control: PubSub, request_id: str) -> None:
    """The workers were told: the flag a dequeue checks, and the command running jobs get."""
    message = await control.get_message(ignore_subscribe_messages=True, timeout=2.0)
    assert message is not None, "no CancelCommand on the command channel"
    assert decode_bytes(message["data"]) == CancelCommand(request_id)
    assert await gateway.redis.get(names.cancel_flag(request_id)) == b"1"

    async def none_open() -> bool:
        return await gateway.open_requests() == 0

    await eventually(none_open, timeout_s=2.0, what="open_requests back to 0")


async def test_leaving_a_stream_cancels_the_request(gateway: LiveGateway, control: PubSub) -> None:
    gateway.workers[0].script = endless
    async with gateway.call(CHAT, {**BODIES[CHAT], "max_tokens": 30, "stream": True}) as call:
        assert await call.start() == 200
        await call.read_until("t2 ")
        assert await gateway.open_requests() == 1
        call.leave()
        await call.finished()
    await assert_cancelled(gateway, control, call.headers["x-request-id"])


@pytest.mark.parametrize(
    ("path", "body"),
    [(CHAT, {**BODIES[CHAT], "max_tokens": 30}), (EMBEDDINGS, BODIES[EMBEDDINGS])],
)
async def test_leaving_while_waiting_for_a_json_answer_cancels_the_request(
    gateway: LiveGateway, control: PubSub, path: str, body: dict[str, Any]
) -> None:
    for worker in gateway.workers:
        worker.script = silent

    async def queued() -> bool:
        return sum(len(worker.jobs) for worker in gateway.workers) == 1

    async with gateway.call(path, body) as call:
        await eventually(queued, what="the job reached its worker")
        call.leave()
        assert await call.start() == 499  # nobody reads it: the client is gone
        await call.finished()
    [job] = [job for worker in gateway.workers for job in worker.jobs]
    await assert_cancelled(gateway, control, job.request_id)


async def test_a_stream_that_ends_normally_sends_no_cancel(
    gateway: LiveGateway, control: PubSub
) -> None:
    response = await gateway.client.post(CHAT, json={**BODIES[CHAT], "stream": True})
    assert response.text.endswith("data: [DONE]\n\n")
    await gateway.state.cells.wait_background()
    assert await control.get_message(ignore_subscribe_messages=True, timeout=0.2) is None
    assert await gateway.redis.get(names.cancel_flag(response.headers["x-request-id"])) is None
