"""A streamed request waiting for a worker gets ``: queued position=N`` comments as it
moves up (at most once per poll, only on a change), and the ``openai`` SDK reads them."""

from __future__ import annotations

import asyncio

import openai
import pytest

from shared.roles import Role
from tests.gateway.harness import BODIES, CHAT, LiveGateway
from tests.waiting import eventually

STREAM = "conveyor:jobs:tiny:aggregated"
STREAMED = {**BODIES[CHAT], "max_tokens": 2, "stream": True}


@pytest.fixture
async def no_taker(gateway: LiveGateway) -> LiveGateway:
    """The aggregated worker stopped (jobs stay queued), the queue read every 50 ms."""
    await gateway.workers[0].stop()
    gateway.state.cells.home.dispatcher.queue_board.poll_s = 0.05
    return gateway


async def test_a_queued_stream_hears_its_position_as_it_moves_up(no_taker: LiveGateway) -> None:
    gateway = no_taker
    # One after the other: two calls started together may be queued in either order. A
    # stream starts once its request is queued.
    async with gateway.call(CHAT, STREAMED) as first:
        assert await first.start() == 200
        async with gateway.call(CHAT, STREAMED) as second:
            assert await second.start() == 200
            await asyncio.wait_for(second.read_until(": queued position=2\n"), 3)
            first.leave()
            [(ahead, _), _] = await gateway.redis.xrange(STREAM)
            await gateway.redis.xdel(STREAM, ahead)  # as a worker drops a cancelled job
            await asyncio.wait_for(second.read_until(": queued position=1\n"), 3)
            await asyncio.sleep(0.2)  # several polls: the unchanged position is not repeated
            second.leave()
            text = await second.read_all()
    comments = [line for line in text.splitlines() if line.startswith(": queued")]
    assert comments == [": queued position=2", ": queued position=1"], text
    assert ": queued position=2\n\n" not in text  # a comment line ends no event


async def test_the_openai_sdk_reads_a_stream_with_position_comments(
    no_taker: LiveGateway,
) -> None:
    gateway = no_taker
    client = openai.AsyncOpenAI(
        base_url="http://gw/v1",
        api_key="x",
        http_client=gateway.client,  # type: ignore[arg-type]
    )

    async def read() -> str:
        stream = await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async with gateway.call(CHAT, STREAMED) as ahead:
        assert await ahead.start() == 200
        reading = asyncio.create_task(read())

        async def both_queued() -> bool:
            return await gateway.redis.xlen(STREAM) == 2

        await eventually(both_queued, what="the SDK's request queued")
        async with gateway.call(CHAT, STREAMED) as behind:
            assert await behind.start() == 200
            # The SDK's request, queued before it, has had its comment by now.
            await asyncio.wait_for(behind.read_until(": queued position=3\n"), 3)
            await gateway.add_worker(Role.AGGREGATED, "tiny")
            assert await asyncio.wait_for(reading, 5) == "c0-0 c0-1 "
            behind.leave()
        ahead.leave()
