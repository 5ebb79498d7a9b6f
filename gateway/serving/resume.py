"""``GET /v1/chat/completions/{id}/stream`` and ``GET /v1/completions/{id}/stream``:
resume a resumable stream on any gateway.

1. the stream's spec (gateway/serving/resumable.py): its kind, body and key must match;
2. ``Last-Event-ID`` (the SSE ``id:`` of the last chunk the client got: ``{seq}``, or
   ``{choice}-{seq}`` with several choices) must name an event of the request's log;
3. the writer is rebuilt from the body (templating and tokenizing again, no admission),
   and the request's events are rendered again from the first one, sending only what
   comes after that event: every later chunk exactly once, whichever gateway sent the
   earlier ones. The reader keeps the request's lease while it is attached.
"""

from __future__ import annotations

import re

from fastapi import Response

from gateway.catalog.served_models import ServedModel
from gateway.control.records import Principal
from gateway.dispatch.dispatcher import Dispatcher
from gateway.dispatch.plan import ChoiceSpec
from gateway.dispatch.request_log import RequestLog
from gateway.openai.responses import ResponseWriter
from gateway.openai.schemas import ChatCompletionRequest, CompletionRequest
from gateway.serving import resumable
from gateway.serving.delivery import event_id_of
from gateway.serving.endpoints import (
    chat_choices,
    chat_writer,
    completion_choices,
    completion_writer,
    stream_response,
)
from gateway.state import GatewayState
from shared.errors import InvalidRequest, StreamNotFound

LAST_EVENT_ID = "Last-Event-ID"
_EVENT_ID = re.compile(r"^(?:(\d+)-)?(\d+)$")


async def resume_stream(
    state: GatewayState,
    request_id: str,
    kind: resumable.Kind,
    last_event_id: str | None,
    principal: Principal,
) -> Response:
    spec, redis = await resumable.load(state, request_id)
    if spec.kind != kind or not spec.readable_by(principal):
        raise StreamNotFound(f"No resumable stream with id '{request_id}'.")
    body: ChatCompletionRequest | CompletionRequest
    if kind == "chat":
        body = ChatCompletionRequest.model_validate(spec.body)
        model = state.catalog.get(body.model)
        choices, parser = await chat_choices(body, model, len(state.images.parts(body, model)))
        fmt: ResponseWriter = chat_writer(body, request_id, model.name, _prompts(choices), parser)
    else:
        body = CompletionRequest.model_validate(spec.body)
        model = state.catalog.get(body.model)
        choices, echo = await completion_choices(body, model)
        fmt = completion_writer(body, request_id, model.name, _prompts(choices), echo)
    fmt.created = int(spec.created_unix)
    indices = [choice.index for choice in choices]
    after = await _after(RequestLog(redis, request_id), last_event_id, indices)
    handle = _dispatcher(state, model).follow(
        request_id, spec.sequences, spec.deadline, resumable.resume_of(state)
    )
    return stream_response(state, handle, fmt, body, _prompts(choices), indices, after=after)


def _dispatcher(state: GatewayState, model: ServedModel) -> Dispatcher:
    return state.cells.for_model(model.base).dispatcher


def _prompts(choices: tuple[ChoiceSpec, ...]) -> dict[int, list[int]]:
    return {choice.index: choice.prompt_token_ids for choice in choices}


async def _after(
    request_log: RequestLog, last_event_id: str | None, indices: list[int]
) -> tuple[int, int] | None:
    """The (choice, seq) the client saw last; None: from the start. A 400 unless the
    request's log holds that event."""
    if last_event_id is None or not last_event_id.strip():
        return None
    match = _EVENT_ID.match(last_event_id.strip())
    single = len(indices) == 1
    if match is None or (match.group(1) is None) != single:
        raise InvalidRequest(
            f"{LAST_EVENT_ID} `{last_event_id}` is not an event id of this stream "
            f"(expected {event_id_of(0, 7, single=single)}-style ids)",
            param=LAST_EVENT_ID,
        )
    index = indices[0] if single else int(match.group(1))
    after = (index, int(match.group(2)))
    if not any((e.index, e.seq) == after for e in await request_log.everything()):
        raise InvalidRequest(
            f"{LAST_EVENT_ID} `{last_event_id}` names no event sent on stream "
            f"'{request_log.request_id}'",
            param=LAST_EVENT_ID,
        )
    return after
