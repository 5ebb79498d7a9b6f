"""vLLM's ``POST /v1/chat/completions/batch``: several conversations in one call
(``entrypoints/openai/chat_completion/batch_serving.py``).

The body is a chat completion whose ``messages`` is a list of conversations. Each
conversation is planned as a chat completion of its own (the same checks, template and
limits), queued as its own request (``<batch id>_<i>``, as vLLM names its sub-requests)
and charged to the key as one; the answer is one ``chat.completion`` with choice ``i``
answering conversation ``i`` and the usage of all of them. As in vLLM, a batch is not
streamed, has no tools, and ``n`` is 1; each refusal here is a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import uuid
from typing import Any

from fastapi import Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from gateway.dispatch.plan import Generation, RequestPlan
from gateway.dispatch.request_handle import RequestHandle
from gateway.openai.output_parsing import OutputParser
from gateway.openai.responses import ChatWriter, Json
from gateway.openai.schemas import ChatCompletionRequest
from gateway.serving import endpoints, limits
from gateway.serving.delivery import collect_response, unless_disconnected
from gateway.serving.endpoints import CLIENT_CLOSED_REQUEST, Receive, RequestHeaders
from gateway.state import GatewayState
from shared.errors import InvalidRequest, UnsupportedParameter

Conversation = tuple[RequestPlan[Generation], OutputParser | None, ChatCompletionRequest]


def parse(raw: bytes) -> list[ChatCompletionRequest]:
    """One chat completion request per conversation; a 400 naming the field otherwise
    (``messages[i]...`` for a conversation's own errors)."""
    try:
        body = json.loads(raw)
    except ValueError as exc:
        error = {"type": "json_invalid", "loc": ("body",), "msg": str(exc), "input": None}
        raise RequestValidationError([error]) from exc
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object")
    conversations = body.get("messages")
    if not isinstance(conversations, list) or not conversations:
        raise InvalidRequest(
            "messages must be a non-empty list of conversations (each a list of messages)",
            param="messages",
        )
    _refuse_batch_fields(body)
    return [_conversation(body, i, messages) for i, messages in enumerate(conversations)]


def _refuse_batch_fields(body: dict[str, Any]) -> None:
    """What vLLM's batch request does not take (streaming, tools, ``n`` > 1, beam search,
    prompt logprobs): refused, so no client mistakes a plain answer for them."""
    if body.get("stream"):
        raise UnsupportedParameter("batch chat completions are not streamed", param="stream")
    if body.get("tools"):
        raise UnsupportedParameter("batch chat completions take no tools", param="tools")
    if body.get("tool_choice") not in (None, "none"):
        raise UnsupportedParameter(
            "batch chat completions take no tools (tool_choice must be none)", param="tool_choice"
        )
    if body.get("n", 1) not in (None, 1):
        raise InvalidRequest("batch chat completions do not support n > 1", param="n")
    if body.get("use_beam_search"):
        raise UnsupportedParameter(
            "batch chat completions do not support beam search", param="use_beam_search"
        )
    if body.get("prompt_logprobs") is not None:
        raise UnsupportedParameter(
            "batch chat completions do not return prompt logprobs", param="prompt_logprobs"
        )


def _conversation(body: dict[str, Any], i: int, messages: Any) -> ChatCompletionRequest:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequest(
            f"messages[{i}] must be a non-empty list of messages", param=f"messages[{i}]"
        )
    try:
        return ChatCompletionRequest.model_validate({**body, "messages": messages})
    except ValidationError as exc:
        raise RequestValidationError([_located(error, i) for error in exc.errors()]) from exc


def _located(error: Any, i: int) -> Any:
    """A conversation's error, located in the batch body (``messages`` gains its index)."""
    loc = tuple(error["loc"])
    if loc[:1] == ("messages",):
        loc = ("messages", i, *loc[1:])
    return {**error, "loc": ("body", *loc)}


async def chat_completions_batch(
    state: GatewayState,
    bodies: list[ChatCompletionRequest],
    headers: RequestHeaders,
    receive: Receive,
) -> Response:
    limits.check_jobs(len(bodies), state.settings, "messages")
    batch_id = f"chatcmpl-{uuid.uuid4().hex}"
    conversations = await _plan_all(state, bodies, headers, batch_id)
    async with contextlib.AsyncExitStack() as handles:
        opened = await _submit_all(state, conversations, handles)
        work = _collect_all(batch_id, conversations, opened)
        result = await unless_disconnected(work, receive)
    if result is None:  # the client left; closing the handles cancelled every conversation
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(result, headers={"X-Request-Id": batch_id, **opened[-1].headers})


async def _plan_all(
    state: GatewayState,
    bodies: list[ChatCompletionRequest],
    headers: RequestHeaders,
    batch_id: str,
) -> list[Conversation]:
    """Every conversation planned before any is queued: a bad one refuses the batch. The
    ``Idempotency-Key`` goes with the first, so a repeated batch is refused (409) whole."""
    planned: list[Conversation] = []
    try:
        for i, body in enumerate(bodies):
            own = headers if i == 0 else dataclasses.replace(headers, idempotency_key=None)
            plan, parser = await endpoints.plan_chat(state, body, own)
            planned.append((_renamed(plan, f"{batch_id}_{i}"), parser, body))
    except BaseException:
        _release(state, planned)
        raise
    return planned


def _renamed(plan: RequestPlan[Generation], request_id: str) -> RequestPlan[Generation]:
    charge = plan.charge and dataclasses.replace(plan.charge, request_id=request_id)
    return dataclasses.replace(plan, request_id=request_id, charge=charge)


def _release(state: GatewayState, conversations: list[Conversation]) -> None:
    """Planned conversations that will not be queued no longer hold their images."""
    for plan, _, _ in conversations:
        state.cells.for_model(plan.served_by).dispatcher.release_images(plan)


async def _submit_all(
    state: GatewayState, conversations: list[Conversation], handles: contextlib.AsyncExitStack
) -> list[RequestHandle]:
    """Queue each conversation in order; a refusal (429, 503, 409) cancels those queued."""
    opened: list[RequestHandle] = []
    for k, (plan, _, _) in enumerate(conversations):
        try:
            handle = await state.cells.for_model(plan.served_by).dispatcher.submit(plan)
        except BaseException:
            _release(state, conversations[k + 1 :])
            raise
        opened.append(await handles.enter_async_context(handle))
    return opened


async def _collect_all(
    batch_id: str, conversations: list[Conversation], handles: list[RequestHandle]
) -> Json:
    answers = await asyncio.gather(
        *(
            _collect(plan, parser, body, handle)
            for (plan, parser, body), handle in zip(conversations, handles, strict=True)
        )
    )
    return _merged(batch_id, answers)


async def _collect(
    plan: RequestPlan[Generation],
    parser: OutputParser | None,
    body: ChatCompletionRequest,
    handle: RequestHandle,
) -> Json:
    fmt = ChatWriter(
        plan.request_id,
        plan.model,
        with_logprobs=body.logprobs,
        with_token_ids=body.return_token_ids,
        output=parser,
        tokens_as_ids=body.return_tokens_as_token_ids,
        echo=body.echoed(),
        role=endpoints.answer_role(body),
    )
    return await collect_response(handle, fmt, indices=[0], choices_per_prompt=1)


def _merged(batch_id: str, answers: list[Json]) -> Json:
    """vLLM's batch answer: one ``chat.completion``, choice ``i`` for conversation ``i``,
    the usage of all of them."""
    first = answers[0]
    choices = [{**answer["choices"][0], "index": i} for i, answer in enumerate(answers)]
    usage: Json = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    cached = 0
    for answer in answers:
        for name in ("prompt_tokens", "completion_tokens", "total_tokens"):
            usage[name] += answer["usage"][name]
        cached += answer["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    if any("prompt_tokens_details" in answer["usage"] for answer in answers):
        usage["prompt_tokens_details"] = {"cached_tokens": cached}
    return {
        "id": batch_id,
        "object": "chat.completion",
        "created": first["created"],
        "model": first["model"],
        "choices": choices,
        "usage": usage,
    }
