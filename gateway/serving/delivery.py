"""Turn a request's events into what the client receives: an SSE stream or one JSON body.

These read a :class:`RequestHandle`; they never close it. Its owner does: the
:class:`EventStreamResponse` for a stream, the serving step for a JSON body.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, MutableMapping
from typing import Any, TypeVar

import orjson
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from gateway.dispatch.queue_watch import QueueWatch
from gateway.dispatch.request_handle import RequestHandle
from gateway.openai.responses import ChoiceState, Json, ResponseWriter, Usage
from gateway.serving.token_push import TokenPush
from shared.errors import ConveyorError, RemoteError
from shared.protocol import ErrorEvent, FinishEvent, TokenEvent

log = logging.getLogger(__name__)
T = TypeVar("T")

DONE = b"data: [DONE]\n\n"
KEEPALIVE = ": keep-alive\n"
"""A comment line with no blank line after it: a blank line would end an SSE event, and
a client that saw an ``id:`` before (the official ``openai`` SDK, as the SSE spec says)
dispatches that empty event and fails to decode its empty ``data``."""


RAW_SEND = "conveyor.send"
"""The scope key under which the app's outermost layer leaves the server's own ``send``
(:class:`gateway.app.GatewayApp`)."""


class EventStreamResponse(StreamingResponse):
    """SSE response that owns its request handle: closed when the response ends, however
    it ends (last event, error, client gone), even if the stream never started.

    The start message passes through every middleware (status, trace header, metrics);
    the body's chunks go to the server's ``send`` directly: the layers in between look
    only at the start, and passing one chunk per token through each of them was a tenth
    of the gateway's CPU per streamed token. A task watches for the client leaving and
    stops the stream (cheaper than Starlette's task group per response)."""

    def __init__(
        self,
        events: AsyncIterator[str | bytes],
        handle: RequestHandle,
        push: TokenPush | None = None,
    ) -> None:
        super().__init__(
            events,
            media_type="text/event-stream",
            headers={
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
                "X-Request-Id": handle.request_id,
                **handle.headers,
            },
        )
        self._handle = handle
        self._push = push

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with self._handle:
            await send(
                {
                    "type": "http.response.start",
                    "status": self.status_code,
                    "headers": self.raw_headers,
                }
            )
            body_send = scope.get(RAW_SEND, send)
            if self._push is not None:
                self._push.send = body_send
            await self._stream_body(body_send, receive)

    async def _stream_body(self, send: Send, receive: Receive) -> None:
        streaming = asyncio.current_task()
        assert streaming is not None
        done = left = False

        def on_watch_end(watch: asyncio.Task[None]) -> None:
            nonlocal left
            if watch.cancelled():
                return
            watch.exception()  # retrieved: a receive that failed also means the client is gone
            if not done:
                left = True  # the client went away (or its receive failed): stop sending
                streaming.cancel()

        watch = asyncio.create_task(_wait_for_disconnect(receive), name="sse-disconnect")
        watch.add_done_callback(on_watch_end)
        body = self.body_iterator
        try:
            async for chunk in body:
                data = chunk if isinstance(chunk, bytes | memoryview) else chunk.encode()
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except asyncio.CancelledError:
            if not left:
                raise
            streaming.uncancel()
        finally:
            done = True
            watch.cancel()
            if isinstance(body, AsyncGenerator):
                await body.aclose()


def sse_data(body: Json, event_id: str | None = None) -> bytes:
    """One SSE event, as the bytes the response sends (no str round trip per chunk)."""
    data = orjson.dumps(body)
    if event_id is None:
        return b"data: %b\n\n" % data
    return b"id: %b\ndata: %b\n\n" % (event_id.encode(), data)


def event_id_of(index: int, seq: int, *, single: bool) -> str:
    """The SSE ``id:`` of a choice's event: its seq (one choice) or ``{choice}-{seq}``."""
    return str(seq) if single else f"{index}-{seq}"


async def stream_events(
    handle: RequestHandle,
    fmt: ResponseWriter,
    *,
    indices: list[int],
    choices_per_prompt: int,
    include_usage: bool,
    keepalive_s: float,
    prompt_tokens: dict[int, int] | None = None,
    after: tuple[int, int] | None = None,
    queue: QueueWatch | None = None,
    join_waiting: bool = False,
    push: TokenPush | None = None,
) -> AsyncIterator[str | bytes]:
    """SSE exactly as OpenAI streams it, plus ``id:`` lines and keep-alive comments.
    ``prompt_tokens`` (each choice's prompt length) asks for vLLM's continuous usage:
    every chunk carries its choice's usage so far. ``after`` (choice, seq): a resumed
    stream; the events up to that one are rendered again (the chunks are a function of
    the events) and not sent, so the client gets each later chunk exactly once. With
    ``queue``, a request still waiting for a worker gets ``: queued position=N eta_s=S``
    comments as it moves up. ``join_waiting``: token events of a choice that are already
    queued behind the one taken leave as one chunk (its ``id:`` is the last one's), never
    waiting for more; False: one chunk per event. ``push``: once the stream is under way,
    its token chunks are written as their events arrive (:mod:`gateway.serving.token_push`)
    and this generator takes over whenever something else comes."""
    usage = Usage(choices_per_prompt)
    single = len(indices) == 1
    generated = dict.fromkeys(indices, 0)

    def with_usage(body: Json, index: int) -> Json:
        if prompt_tokens is not None:
            prompt = prompt_tokens[index]
            body["usage"] = {
                "prompt_tokens": prompt,
                "completion_tokens": generated[index],
                "total_tokens": prompt + generated[index],
            }
        elif include_usage:
            body["usage"] = None
        return body

    def token_chunk(event: TokenEvent) -> bytes | None:
        generated[event.index] += len(event.token_ids)
        chunk = fmt.delta(event)
        if chunk is None:  # held back (a tool-call tag not yet complete)
            return None
        event_id = event_id_of(event.index, event.seq, single=single)
        return sse_data(with_usage(chunk, event.index), event_id)

    if join_waiting:
        push = None  # joining reads what waits in the inbox: every event goes through here
    # Chunks of events that arrived together leave in one write (one send per wakeup).
    pending: list[bytes] = []
    try:
        for index in indices:
            start = fmt.start_chunk(index)
            if start is not None:
                pending.append(sse_data(with_usage(start, index)))
        idle_s = keepalive_s if queue is None else min(keepalive_s, queue.poll_s)
        quiet_s = 0.0
        async for event in handle.events(idle_timeout_s=idle_s):
            if event is None:
                quiet_s += idle_s
                line = await queue.comment() if queue is not None and not handle.started else None
                if line is not None or quiet_s >= keepalive_s:
                    yield line or KEEPALIVE
                    quiet_s = 0.0
                continue
            quiet_s = 0.0
            if join_waiting and after is None and isinstance(event, TokenEvent):
                event = handle.join_buffered(event)
            event_id = event_id_of(event.index, event.seq, single=single)
            if isinstance(event, TokenEvent):
                data = token_chunk(event)
                if data is not None:
                    pending.append(data)
            elif isinstance(event, FinishEvent):
                usage.add(event)
                generated[event.index] = event.completion_tokens
                if prompt_tokens is not None:
                    prompt_tokens[event.index] = event.prompt_tokens  # the engine's count
                chunk = fmt.finish_chunk(event.index, event.finish_reason)
                pending.append(sse_data(with_usage(chunk, event.index), event_id))
            elif isinstance(event, ErrorEvent):
                if after is not None:  # resumed after this error: the client has it
                    pending.clear()
                else:
                    pending.append(sse_data(RemoteError(event).to_openai(), event_id))
                pending.append(DONE)
                yield b"".join(pending)
                return
            if after is not None:  # resuming: nothing up to ``after`` is sent again
                pending.clear()
                if (event.index, event.seq) == after:
                    after = None
                continue
            if handle.has_buffered():
                continue
            if pending:
                yield pending[0] if len(pending) == 1 else b"".join(pending)
                pending.clear()
            if push is not None and not handle.finished:
                while await push.lend(handle, token_chunk, keepalive_s):
                    yield KEEPALIVE
        if include_usage:
            pending.append(sse_data(fmt.usage_chunk(usage)))
        pending.append(DONE)
        yield b"".join(pending)
    except ConveyorError as exc:
        log.warning("stream %s ended with an error: %s", handle.request_id, exc)
        yield b"".join([*pending, sse_data(exc.to_openai()), DONE])


async def collect_response(
    handle: RequestHandle, fmt: ResponseWriter, *, indices: list[int], choices_per_prompt: int
) -> Json:
    """The whole non-streaming response; raises the first sequence error."""
    states = {index: ChoiceState(index) for index in indices}
    usage = Usage(choices_per_prompt)
    async for event in handle.events():
        if isinstance(event, TokenEvent):
            state = states[event.index]
            state.text.append(event.text)
            state.logprobs.extend(event.logprobs or [])
            state.token_ids.extend(event.token_ids)
            if event.prompt_logprobs is not None:
                state.prompt_logprobs = event.prompt_logprobs
        elif isinstance(event, FinishEvent):
            states[event.index].finish_reason = event.finish_reason
            usage.add(event)
        elif isinstance(event, ErrorEvent):
            raise RemoteError(event)
    return fmt.response([states[i] for i in indices], usage)


async def unless_disconnected(
    work: Awaitable[T], receive: Callable[[], Awaitable[MutableMapping[str, Any]]]
) -> T | None:
    """Run ``work``; return None (and cancel it) if the client disconnects first."""
    work_task = asyncio.ensure_future(work)
    watch_task = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait({work_task, watch_task}, return_when=asyncio.FIRST_COMPLETED)
        if work_task in done:
            return work_task.result()
        work_task.cancel()
        await asyncio.gather(work_task, return_exceptions=True)
        return None
    finally:
        watch_task.cancel()
        work_task.cancel()


async def _wait_for_disconnect(
    receive: Callable[[], Awaitable[MutableMapping[str, Any]]],
) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return
