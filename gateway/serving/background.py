"""Background responses (``background: true``): run with no client attached, survive the
gateway that accepted them, and stream again from any gateway.

1. Accept: the response is stored in SQL as ``queued`` and answered at once; its request
   is resumable (gateway/serving/resumable.py) with this gateway as the holder of its
   lease, and its id joins the ``conveyor:responses:background`` set (scored by its
   deadline) of its model's Redis.
2. Run (:func:`run`): a task on the holder renders the request's events as Responses
   events and appends each to the response's event log, ``conveyor:response-events:{id}``,
   at entry id ``0-{sequence_number + 1}``; at the end it stores the final response in SQL.
3. Take over: every gateway looks at the set every second (:func:`takeover_loop`); a
   response whose lease lapsed (its gateway died) is taken by the first gateway that
   sets the lease, which runs it again from its first event. The rendering is a function
   of the events (item ids included), and Redis refuses an entry id already in the log,
   so the log holds each event once however often it is rendered. The workers see the
   lease renewed in time and keep running the request (a worker's own death is
   migration: gateway-side nothing changes).
4. Cancel: the request is cancelled on the workers and the stored status becomes
   ``cancelled``; the runner sees the cancel flag, closes the log and stops.
5. Streamed retrieve: the log is read from ``starting_after`` on, from any gateway,
   while the response runs and for CONVEYOR_RESPONSE_EVENTS_TTL_S after it ended.

The log holds one entry per event (bounded by ``max_output_tokens``) and expires with
the response events TTL; the request's own reply stream is kept only for the resume
grace period after it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import orjson
import redis.asyncio as aioredis
from fastapi import Response
from fastapi.responses import JSONResponse, StreamingResponse
from redis.exceptions import RedisError

from gateway.control.records import Principal
from gateway.control.response_store import ResponseStore
from gateway.dispatch.plan import Generation, RequestPlan
from gateway.dispatch.request_follow import LeaseLost
from gateway.dispatch.request_handle import RequestHandle
from gateway.openai.output_parsing import ChoiceOutput, OutputParser
from gateway.openai.responses_api import (
    Json,
    ResponseDraft,
    request_id_of,
    status_of,
    usage,
)
from gateway.openai.responses_events import ResponseEvents
from gateway.openai.schemas import ChatCompletionRequest
from gateway.serving import resumable
from gateway.serving.delivery import KEEPALIVE
from gateway.serving.endpoints import chat_choices
from gateway.state import GatewayState
from shared.connections.connect import as_text
from shared.errors import ConveyorError, InvalidRequest, ResponseNotFound
from shared.protocol import ErrorEvent, FinishEvent, TokenEvent
from shared.queue import names
from shared.queue.liveness import release_request, take_request

log = logging.getLogger(__name__)

TERMINAL = frozenset({"completed", "failed", "incomplete", "cancelled"})
TERMINAL_EVENTS = frozenset({"response.completed", "response.failed", "response.incomplete"})
END = b"end"
"""The field of the log's closing entry of a cancelled response."""
TAKEOVER_INTERVAL_S = 1.0
CANCEL_CHECK_S = 1.0


def store_of(state: GatewayState) -> ResponseStore:
    if state.control is None:
        raise ResponseNotFound("no response store: the gateway runs without its control plane")
    return state.control.responses


# ------------------------------------------------------------------------------ accept


async def accept(
    state: GatewayState,
    plan: RequestPlan[Generation],
    chat: ChatCompletionRequest,
    draft: ResponseDraft,
    items: list[Json],
    principal: Principal,
    *,
    stream: bool,
) -> Response:
    """Store the response as queued, queue its request, start its runner; answer at once."""
    store = store_of(state)
    draft.background = True
    spec_response = {
        "id": draft.id,
        "model": draft.model,
        "request": draft.request,
        "created_at": draft.created_at,
    }
    plan = await resumable.prepare(
        state, plan, chat, kind="response", holder=state.gateway_id, response=spec_response
    )
    queued = draft.body("queued", [])
    await store.save(queued, items, principal)
    dispatcher = state.cells.for_model(plan.served_by).dispatcher
    try:
        handle = await dispatcher.submit(plan)
    except BaseException:
        await store.delete(draft.id, principal)
        raise
    redis = state.cells.for_model(plan.served_by).redis
    await redis.zadd(names.BACKGROUND_RESPONSES, {plan.request_id: plan.deadline.deadline_unix})
    _spawn(state, plan.request_id, run(state, plan.request_id, redis, handle))
    log.info("background response %s accepted (request %s)", draft.id, plan.request_id)
    if stream:
        return _event_stream(state, redis, draft.id, None)
    return JSONResponse(queued, headers={"X-Request-Id": plan.request_id, **handle.headers})


def _spawn(state: GatewayState, request_id: str, work: Any) -> None:
    task = asyncio.get_running_loop().create_task(work, name=f"background-{request_id}")
    state.runners[request_id] = task
    task.add_done_callback(lambda _: state.runners.pop(request_id, None))


# --------------------------------------------------------------------------------- run


async def run(
    state: GatewayState,
    request_id: str,
    redis: aioredis.Redis,
    handle: RequestHandle | None = None,
) -> None:
    """Render the request's events into the response's log and store its final state;
    ``handle``: the accepting gateway's (None: a takeover follows the log from its start)."""
    try:
        spec, _ = await resumable.load(state, request_id)
        assert spec.response is not None
        draft = ResponseDraft(**spec.response, background=True)
        chat = ChatCompletionRequest.model_validate(spec.body)
        model = state.catalog.get(chat.model)
        _, parser = await chat_choices(chat, model, len(state.images.parts(chat, model)))
        if handle is None:
            dispatcher = state.cells.for_model(model.base).dispatcher
            handle = dispatcher.follow(
                request_id, 1, spec.deadline, resumable.resume_of(state, state.gateway_id)
            )
        runner = _Runner(state, redis, request_id, draft, parser or OutputParser())
        async with handle:
            await runner.render(handle)
    except LeaseLost:
        log.warning("background request %s is served by another gateway now", request_id)
        return
    except asyncio.CancelledError:  # this gateway stops: another takes it over at once
        with contextlib.suppress(RedisError):
            await asyncio.shield(release_request(redis, request_id))
        raise
    except ConveyorError as exc:
        log.warning("background request %s ended with an error: %s", request_id, exc)
    except RedisError as exc:
        log.warning(
            "background request %s: Redis failed (%s); another gateway takes it", request_id, exc
        )
        return
    await _forget(state, redis, request_id)


class _Runner:
    def __init__(
        self,
        state: GatewayState,
        redis: aioredis.Redis,
        request_id: str,
        draft: ResponseDraft,
        parser: OutputParser,
    ) -> None:
        self._state = state
        self._redis = redis
        self._request_id = request_id
        self._store = store_of(state)
        self._events = ResponseEvents(draft)
        self._output = ChoiceOutput(parser)
        self._log = names.response_events(draft.id)
        self._started = False
        self._checked = time.monotonic()

    async def render(self, handle: RequestHandle) -> None:
        await self._append(self._events.start())
        try:
            async for event in handle.events(idle_timeout_s=CANCEL_CHECK_S):
                # a final event may be the workers' answer to the cancel: look every time
                if await self._cancelled(now=isinstance(event, FinishEvent | ErrorEvent)):
                    await self._close_log()
                    return
                if isinstance(event, TokenEvent):
                    await self._running()
                    await self._append(self._events.feed(self._output.feed(event.text)))
                elif isinstance(event, FinishEvent):
                    await self._finish(event)
                    return
                elif isinstance(event, ErrorEvent):
                    await self._end(self._events.fail(event.message))
                    return
        except LeaseLost:
            raise
        except ConveyorError as exc:
            await self._end(self._events.fail(exc.message))

    async def _running(self) -> None:
        if not self._started:
            self._started = True
            body = self._events.draft.body("in_progress", [])
            await self._store.update(body, unless_cancelled=True)

    async def _finish(self, event: FinishEvent) -> None:
        rendered = self._events.feed(self._output.finish())
        status, incomplete = status_of(event.finish_reason)
        counts = usage(event.prompt_tokens, event.completion_tokens, event.cached_tokens)
        await self._end([*rendered, *self._events.finish(status, counts, incomplete)])

    async def _end(self, rendered: list[Json]) -> None:
        await self._append(rendered)
        await self._store.update(rendered[-1]["response"], unless_cancelled=True)
        log.info("background response %s: %s", self._events.draft.id, rendered[-1]["type"])

    async def _cancelled(self, *, now: bool = False) -> bool:
        if not now and time.monotonic() - self._checked < CANCEL_CHECK_S:
            return False
        self._checked = time.monotonic()
        return bool(await self._redis.exists(names.cancel_flag(self._request_id)))

    async def _append(self, rendered: list[Json]) -> None:
        """Each event at entry ``0-{sequence_number + 1}``: one already there (rendered
        by an earlier holder) is refused by Redis and stays as it was."""
        if not rendered:
            return
        ttl_ms = int(self._state.settings.response_events_ttl_s * 1000)
        async with self._redis.pipeline(transaction=False) as pipe:
            for body in rendered:
                entry = f"0-{body['sequence_number'] + 1}"
                pipe.xadd(self._log, {b"e": orjson.dumps(body)}, id=entry)
            pipe.pexpire(self._log, ttl_ms)
            await pipe.execute(raise_on_error=False)

    async def _close_log(self) -> None:
        entry = f"0-{self._events.next_sequence_number + 1}"
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.xadd(self._log, {END: b"1"}, id=entry)
            await pipe.execute(raise_on_error=False)
        log.info("background response %s was cancelled", self._events.draft.id)


async def _forget(state: GatewayState, redis: aioredis.Redis, request_id: str) -> None:
    try:
        await redis.zrem(names.BACKGROUND_RESPONSES, request_id)
        await resumable.forget(redis, request_id, state.settings.resume_grace_s)
    except RedisError as exc:
        log.warning("could not forget background request %s: %s", request_id, exc)


# ---------------------------------------------------------------------------- takeover


async def takeover_loop(state: GatewayState, interval_s: float = TAKEOVER_INTERVAL_S) -> None:
    """Take the background responses whose holder died (every gateway runs this)."""
    while True:
        for cell in state.cells.all():
            try:
                await take_over(state, cell.redis)
            except (RedisError, ConveyorError) as exc:
                log.warning("background takeover check failed: %s", exc)
        await asyncio.sleep(interval_s)


async def take_over(state: GatewayState, redis: aioredis.Redis) -> int:
    """Start a runner for each running background response whose lease lapsed."""
    now = time.time()
    await redis.zremrangebyscore(names.BACKGROUND_RESPONSES, "-inf", now - 60)
    taken = 0
    running: Any = await redis.zrangebyscore(names.BACKGROUND_RESPONSES, now, "+inf")
    for raw in running:
        request_id = as_text(raw)
        if request_id in state.runners:
            continue
        lease_s = state.settings.gateway_liveness_ttl_s
        if await take_request(redis, request_id, state.gateway_id, lease_s):
            log.warning("taking over background request %s (its gateway is gone)", request_id)
            _spawn(state, request_id, run(state, request_id, redis))
            taken += 1
    return taken


# ------------------------------------------------------------------------------ cancel


async def cancel(state: GatewayState, response_id: str, principal: Principal) -> Json:
    row = await store_of(state).get(response_id, principal)
    body: Json = row.body
    if not body.get("background"):
        raise InvalidRequest("Only responses created with background=true can be cancelled.")
    status = body.get("status")
    if status == "cancelled":
        return body
    if status in TERMINAL:
        raise InvalidRequest(f"Cannot cancel a response whose status is {status}.")
    model = state.catalog.get(body["model"])
    state.cells.for_model(model.base).dispatcher.cancel(request_id_of(response_id))
    body = {**body, "status": "cancelled"}
    await store_of(state).update(body)
    log.info("background response %s cancelled", response_id)
    return body


# -------------------------------------------------------------------- streamed retrieve


async def stream(
    state: GatewayState, response_id: str, starting_after: int | None, principal: Principal
) -> Response:
    """``GET /v1/responses/{id}?stream=true``: the response's events after
    ``starting_after`` (all of them without it), from its log."""
    row = await store_of(state).get(response_id, principal)
    body = row.body
    if not body.get("background"):
        raise InvalidRequest(
            "Only background responses can be streamed again (create it with background=true).",
            param="stream",
        )
    redis = state.cells.for_model(state.catalog.get(body["model"]).base).redis
    event_log = names.response_events(response_id)
    if body.get("status") in TERMINAL:
        last: Any = await redis.xrevrange(event_log, count=1)
        if not last:
            raise InvalidRequest(
                f"The events of response '{response_id}' are no longer kept (they expire "
                "CONVEYOR_RESPONSE_EVENTS_TTL_S after it ends); retrieve it without stream.",
                param="stream",
            )
        last_seq = int(as_text(last[0][0]).split("-")[1]) - 1
        if starting_after is not None and starting_after >= last_seq:
            raise InvalidRequest(
                f"starting_after {starting_after} is past the last event of response "
                f"'{response_id}' (sequence number {last_seq}).",
                param="starting_after",
            )
    return _event_stream(state, redis, response_id, starting_after)


def _event_stream(
    state: GatewayState, redis: aioredis.Redis, response_id: str, after: int | None
) -> StreamingResponse:
    events = _tail(redis, response_id, after, state.settings.sse_keepalive_s)
    return StreamingResponse(
        events,
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _tail(
    redis: aioredis.Redis, response_id: str, after: int | None, keepalive_s: float
) -> AsyncIterator[str]:
    event_log = names.response_events(response_id)
    last = "0-0" if after is None else f"0-{after + 1}"
    quiet_since = time.monotonic()
    while True:
        reply: Any = await redis.xread({event_log: last}, count=256, block=1000)
        if not reply:
            if time.monotonic() - quiet_since > keepalive_s:
                quiet_since = time.monotonic()
                yield KEEPALIVE
            await asyncio.sleep(0.005)  # a Redis that does not block (fakeredis)
            continue
        quiet_since = time.monotonic()
        frames: list[str] = []
        for _stream, entries in reply:
            for raw_id, fields in entries:
                last = as_text(raw_id)
                if END in fields:
                    yield "".join(frames)
                    return
                event = orjson.loads(fields[b"e"])
                frames.append(f"event: {event['type']}\ndata: {fields[b'e'].decode()}\n\n")
                if event["type"] in TERMINAL_EVENTS:
                    yield "".join(frames)
                    return
        yield "".join(frames)
