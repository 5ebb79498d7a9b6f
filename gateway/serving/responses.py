"""``POST /v1/responses``: the Responses API served by the chat path.

1. refuse what cannot be honoured (:func:`responses_input.refuse_unsupported`);
2. the history: a ``previous_response_id`` chain read from the store (the caller's own);
3. translate to a chat request and plan it as chat completions does (admission, limits,
   tokenizing, tools, images: :func:`gateway.serving.endpoints.plan_chat`);
4. deliver one ``response`` object or its typed event stream, then store it (``store``).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import orjson
from fastapi import Response
from fastapi.responses import JSONResponse
from pydantic import TypeAdapter, ValidationError

from gateway.control.records import Principal
from gateway.dispatch.request_handle import RequestHandle
from gateway.openai.output_parsing import ChoiceOutput, OutputParser
from gateway.openai.responses_api import (
    Json,
    ResponseDraft,
    echoed_fields,
    output_items,
    response_id_of,
    status_of,
    usage,
)
from gateway.openai.responses_events import ResponseEvents
from gateway.openai.responses_schema import InputItem, ResponsesRequest
from gateway.serving import background, responses_input
from gateway.serving.delivery import KEEPALIVE, EventStreamResponse, unless_disconnected
from gateway.serving.endpoints import (
    CLIENT_CLOSED_REQUEST,
    Receive,
    RequestHeaders,
    plan_chat,
    submit,
)
from gateway.state import GatewayState
from shared.errors import ConveyorError, InvalidRequest, RemoteError, ResponseNotFound
from shared.protocol import ErrorEvent, FinishEvent, TokenEvent

log = logging.getLogger(__name__)

Store = Callable[[Json], Awaitable[None]]
"""Keeps a finished response (its body); a no-op when ``store`` is false."""


_ITEMS = TypeAdapter(list[InputItem])


async def create_response(
    state: GatewayState, body: ResponsesRequest, headers: RequestHeaders, receive: Receive
) -> Response:
    responses_input.refuse_unsupported(body)
    history = await _history(state, body, headers.principal)
    store = _store(state, body, headers.principal)
    try:
        chat = responses_input.chat_request(body, history)
    except ValidationError as exc:
        raise InvalidRequest(_first_error(exc), param="input") from exc
    plan, parser = await plan_chat(state, chat, headers)
    draft = ResponseDraft(response_id_of(plan.request_id), plan.model, echoed_fields(body))
    if body.background:
        items = _input_items(body)
        return await background.accept(
            state, plan, chat, draft, items, headers.principal, stream=bool(body.stream)
        )
    handle = await submit(state, plan, headers)
    parser = parser or OutputParser()
    if body.stream:
        events = _stream(
            handle, ResponseEvents(draft), parser, state.settings.sse_keepalive_s, store
        )
        return EventStreamResponse(events, handle)
    async with handle:
        result = await unless_disconnected(_collect(handle, draft, parser), receive)
    if result is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    await store(result)
    return JSONResponse(result, headers={"X-Request-Id": handle.request_id, **handle.headers})


async def _history(
    state: GatewayState, body: ResponsesRequest, principal: Principal
) -> list[InputItem]:
    if body.previous_response_id is None:
        return []
    if state.control is None:
        raise ResponseNotFound(
            f"Response with id '{body.previous_response_id}' not found (no response store: "
            "the gateway runs without its control plane).",
            param="previous_response_id",
        )
    items = await state.control.responses.history(body.previous_response_id, principal)
    return _ITEMS.validate_python(items)


def _store(state: GatewayState, body: ResponsesRequest, principal: Principal) -> Store:
    control = state.control
    if not body.store or control is None:
        return _keep_nothing
    items = _input_items(body)

    async def keep(response: Json) -> None:
        await control.responses.save(response, items, principal)

    return keep


def _input_items(body: ResponsesRequest) -> list[Json]:
    return [item.model_dump(by_alias=True, exclude_none=True) for item in body.input_items()]


async def _keep_nothing(response: Json) -> None:
    return None


def _first_error(exc: ValidationError) -> str:
    error = exc.errors()[0]
    return f"{'.'.join(str(p) for p in error['loc'])}: {error['msg']}"


async def _collect(handle: RequestHandle, draft: ResponseDraft, parser: OutputParser) -> Json:
    text: list[str] = []
    finish: FinishEvent | None = None
    async for event in handle.events():
        if isinstance(event, TokenEvent):
            text.append(event.text)
        elif isinstance(event, FinishEvent):
            finish = event
        elif isinstance(event, ErrorEvent):
            raise RemoteError(event)
    assert finish is not None
    status, incomplete = status_of(finish.finish_reason)
    parsed = parser.parse("".join(text), final=True)
    items = output_items(parsed, "completed" if status == "completed" else "incomplete")
    counts = usage(finish.prompt_tokens, finish.completion_tokens, finish.cached_tokens)
    return draft.body(status, items, counts, incomplete=incomplete)


def _sse(event: Json) -> str:
    return f"event: {event['type']}\ndata: {orjson.dumps(event).decode()}\n\n"


async def _stream(
    handle: RequestHandle,
    events: ResponseEvents,
    parser: OutputParser,
    keepalive_s: float,
    store: Store,
) -> AsyncIterator[str]:
    output = ChoiceOutput(parser)
    pending = [_sse(e) for e in events.start()]
    try:
        async for event in handle.events(idle_timeout_s=keepalive_s):
            if event is None:
                yield KEEPALIVE
                continue
            if isinstance(event, TokenEvent):
                pending += [_sse(e) for e in events.feed(output.feed(event.text))]
            elif isinstance(event, FinishEvent):
                pending += [_sse(e) for e in events.feed(output.finish())]
                status, incomplete = status_of(event.finish_reason)
                counts = usage(event.prompt_tokens, event.completion_tokens, event.cached_tokens)
                last = events.finish(status, counts, incomplete)
                pending += [_sse(e) for e in last]
                yield "".join(pending)
                await store(last[-1]["response"])
                return
            elif isinstance(event, ErrorEvent):
                pending += [_sse(e) for e in events.fail(event.message)]
                yield "".join(pending)
                return
            if not handle.has_buffered():
                yield "".join(pending)
                pending.clear()
    except ConveyorError as exc:
        log.warning("response stream %s ended with an error: %s", handle.request_id, exc)
        yield "".join([*pending, *(_sse(e) for e in events.fail(exc.message))])
