"""A stream under way writes each token chunk in the router's call (no task wakeup), and
reads exactly as a stream whose task takes every event: keep-alives, a client that
reads slowly, events out of order, the deadline, a rendering error, cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gateway.dispatch.plan import Deadline
from gateway.dispatch.reply_inbox import ReplyInbox
from gateway.dispatch.reply_router import StreamInterrupted
from gateway.dispatch.request_handle import RequestHandle
from gateway.openai.responses import ChatWriter, Json
from gateway.serving.delivery import KEEPALIVE, stream_events
from gateway.serving.token_push import TokenPush
from shared.protocol import Event, FinishEvent, TokenEvent
from tests.waiting import eventually

RID = "chatcmpl-push"


def tok(seq: int, text: str) -> TokenEvent:
    return TokenEvent(RID, 0, seq, 0, [100 + seq], text)


def fin(seq: int) -> FinishEvent:
    return FinishEvent(RID, 0, seq, 0, "stop", 5, seq)


class Wire:
    """The server's ``send``: the bodies the client gets, in order. While ``gate`` is
    set, a send waits for it (a client that reads slowly)."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.gate: asyncio.Future[None] | None = None

    async def send(self, message: Any) -> None:
        if self.gate is not None:
            await self.gate
        self.bodies.append(message["body"])

    def text(self) -> str:
        return b"".join(self.bodies).decode()


class Stream:
    """One request's stream served as the SSE response serves it: chunks the generator
    yields go out through ``wire``, and so do the ones its push writes."""

    def __init__(self, *, push: bool, keepalive_s: float = 5.0, timeout_s: float = 30.0) -> None:
        self.inbox: ReplyInbox[Event | StreamInterrupted] = ReplyInbox(64)
        self.handle = RequestHandle(RID, 1, self.inbox, Deadline.after(timeout_s), lambda _: 0)
        self.wire = Wire()
        self.push = TokenPush() if push else None
        self.keepalive_s = keepalive_s

    async def serve(self, fmt: ChatWriter | None = None) -> None:
        if self.push is not None:
            self.push.send = self.wire.send
        chunks = stream_events(
            self.handle,
            fmt or ChatWriter(RID, "m", with_logprobs=False),
            indices=[0],
            choices_per_prompt=1,
            include_usage=False,
            keepalive_s=self.keepalive_s,
            push=self.push,
        )
        async for chunk in chunks:
            body = chunk if isinstance(chunk, bytes) else chunk.encode()
            await self.wire.send({"type": "http.response.body", "body": body})

    def lent(self) -> Callable[[], Awaitable[bool]]:
        async def check() -> bool:
            return self.inbox._taker is not None

        return check


async def _run(stream: Stream, feed: Callable[[Stream], Awaitable[None]]) -> str:
    serving = asyncio.create_task(stream.serve())
    await feed(stream)
    await asyncio.wait_for(serving, 5)
    return stream.wire.text()


async def _steady(stream: Stream) -> None:
    stream.inbox.put_nowait(tok(0, "a"))
    if stream.push is not None:
        await eventually(stream.lent(), what="the stream lent its writing")
    for seq, text in enumerate("bcd", start=1):
        before = len(stream.wire.bodies)
        stream.inbox.put_nowait(tok(seq, text))
        if stream.push is not None:  # written in the router's call, before any await
            assert len(stream.wire.bodies) == before + 1
        await asyncio.sleep(0)
    stream.inbox.put_nowait(fin(4))


async def test_tokens_after_the_first_are_written_in_the_routers_call() -> None:
    pushed = await _run(Stream(push=True), _steady)
    pulled = await _run(Stream(push=False), _steady)
    assert pushed == pulled
    assert pushed.endswith("data: [DONE]\n\n")
    assert [f'"content":"{c}"' in pushed for c in "abcd"] == [True] * 4


async def test_a_quiet_lent_stream_gets_keepalives_and_goes_on() -> None:
    async def quiet(stream: Stream) -> None:
        stream.inbox.put_nowait(tok(0, "a"))
        await eventually(stream.lent(), what="the stream lent its writing")
        await eventually(_has(stream, KEEPALIVE), what="a keep-alive")
        stream.inbox.put_nowait(tok(1, "b"))
        stream.inbox.put_nowait(fin(2))

    text = await _run(Stream(push=True, keepalive_s=0.05), quiet)
    assert text.index('"content":"a"') < text.index(KEEPALIVE) < text.index('"content":"b"')


async def test_a_slow_client_gets_every_chunk_in_order() -> None:
    async def slow(stream: Stream) -> None:
        stream.inbox.put_nowait(tok(0, "a"))
        await eventually(stream.lent(), what="the stream lent its writing")
        stream.wire.gate = asyncio.get_running_loop().create_future()
        for seq, text in enumerate("bcd", start=1):
            stream.inbox.put_nowait(tok(seq, text))  # b waits in the send, c and d queue
        await asyncio.sleep(0.05)
        assert stream.inbox.qsize() == 2
        gate, stream.wire.gate = stream.wire.gate, None
        gate.set_result(None)
        for seq, text in enumerate("efg", start=4):
            await asyncio.sleep(0.01)
            stream.inbox.put_nowait(tok(seq, text))
        stream.inbox.put_nowait(fin(7))

    text = await _run(Stream(push=True), slow)
    positions = [text.index(f'"content":"{c}"') for c in "abcdefg"]
    assert positions == sorted(positions)


async def test_events_that_queue_while_a_pulled_chunk_is_sent_are_not_left_behind() -> None:
    """The stream lends its writing only with nothing queued: an event queued while its
    task waits on the client would be offered to nobody, and only keep-alives go out."""

    async def queued_while_sending(stream: Stream) -> None:
        stream.wire.gate = asyncio.get_running_loop().create_future()
        stream.inbox.put_nowait(tok(0, "a"))  # pulled: its chunk waits in the send
        await eventually(_sending(stream), what="the first chunk waiting on the client")
        for seq, text in enumerate("bc", start=1):
            stream.inbox.put_nowait(tok(seq, text))
        stream.inbox.put_nowait(fin(3))
        gate, stream.wire.gate = stream.wire.gate, None
        gate.set_result(None)

    text = await _run(Stream(push=True, keepalive_s=0.05), queued_while_sending)
    assert text.endswith("data: [DONE]\n\n")
    positions = [text.index(f'"content":"{c}"') for c in "abc"]
    assert positions == sorted(positions)


async def test_an_event_out_of_order_ends_the_stream_as_without_push() -> None:
    async def gap(stream: Stream) -> None:
        stream.inbox.put_nowait(tok(0, "a"))
        if stream.push is not None:
            await eventually(stream.lent(), what="the stream lent its writing")
        stream.inbox.put_nowait(tok(2, "c"))  # seq 1 lost

    pushed = await _run(Stream(push=True), gap)
    assert pushed == await _run(Stream(push=False), gap)
    assert "were lost on their way back" in pushed and pushed.endswith("data: [DONE]\n\n")


async def test_the_deadline_ends_a_lent_stream() -> None:
    async def silent(stream: Stream) -> None:
        stream.inbox.put_nowait(tok(0, "a"))
        await eventually(stream.lent(), what="the stream lent its writing")

    text = await _run(Stream(push=True, timeout_s=0.3), silent)
    assert "timed out" in text and text.endswith("data: [DONE]\n\n")


async def test_a_rendering_error_is_raised_by_the_stream() -> None:
    class Failing(ChatWriter):
        def delta_chunk(self, event: TokenEvent) -> Json | None:
            if event.text == "boom":
                raise ValueError("cannot render")
            return super().delta_chunk(event)

    stream = Stream(push=True)
    serving = asyncio.create_task(stream.serve(Failing(RID, "m", with_logprobs=False)))
    stream.inbox.put_nowait(tok(0, "a"))
    await eventually(stream.lent(), what="the stream lent its writing")
    stream.inbox.put_nowait(tok(1, "boom"))
    with pytest.raises(ValueError, match="cannot render"):
        await asyncio.wait_for(serving, 5)
    assert stream.inbox._taker is None


async def test_cancelling_a_lent_stream_takes_the_push_back() -> None:
    stream = Stream(push=True)
    serving = asyncio.create_task(stream.serve())
    stream.inbox.put_nowait(tok(0, "a"))
    await eventually(stream.lent(), what="the stream lent its writing")
    serving.cancel()
    with pytest.raises(asyncio.CancelledError):
        await serving
    assert stream.inbox._taker is None
    stream.inbox.put_nowait(tok(1, "b"))
    assert stream.inbox.qsize() == 1  # queued, nothing written
    assert '"content":"b"' not in stream.wire.text()


def _has(stream: Stream, text: str) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return text in stream.wire.text()

    return check


def _sending(stream: Stream) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return stream.inbox.empty() and stream.handle.started

    return check
