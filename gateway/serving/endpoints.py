"""One serving step per endpoint: the one translation point between the OpenAI wire
schema (:mod:`gateway.openai.schemas`) and the internal job protocol (:mod:`shared.protocol`).

A request goes through the same steps at every endpoint, cheap checks before
expensive work:

1. admit: the gateway is not draining, the model exists and serves this endpoint,
   OpenAI features it cannot honour are refused. This is where the request's API
   key (its ``Principal``) is checked against the model and the key's limits (one
   read of its counters: a key already over a limit costs no templating, tokenizing
   or image fetch; admission, step 6, still charges the exact cost atomically);
2. resolve the headers once: the deadline (``X-Request-Timeout``) and the
   ``Idempotency-Key``;
3. counts and lengths (:mod:`gateway.serving.limits`) and the image parts
   (:meth:`ImageInputs.parts`): nothing tokenized, nothing fetched;
4. tokenize (the chat template, with the tools :mod:`gateway.serving.tool_choice` plans)
   and check the context window, then the sampling options of each choice
   (:mod:`gateway.serving.translate`);
5. images: fetched, validated and stored (:meth:`ImageInputs.load`), only now;
6. the :class:`~gateway.dispatch.plan.RequestPlan` goes to the dispatcher, which queues its
   jobs or refuses it;
7. deliver an SSE stream or one JSON body (:mod:`gateway.serving.delivery`). The request's
   handle has one owner, which closes it on every path: the stream response, or
   the ``async with`` here (:mod:`gateway.dispatch.request_handle`: where a request ends).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from fastapi import Response
from fastapi.responses import JSONResponse

from gateway.catalog.served_models import ModelKind, ServedModel
from gateway.control.records import ANONYMOUS, Principal
from gateway.dispatch.plan import Deadline, Embedding, Generation, RequestPlan, W
from gateway.dispatch.request_handle import RequestHandle
from gateway.dispatch.request_tally import reserved_tokens
from gateway.openai.logprob_rows import Echo
from gateway.openai.output_parsing import OutputParser
from gateway.openai.responses import ChatWriter, CompletionWriter, Json, ResponseWriter
from gateway.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    SamplingFields,
)
from gateway.serving import limits, translate
from gateway.serving.delivery import (
    EventStreamResponse,
    collect_response,
    stream_events,
    unless_disconnected,
)
from gateway.serving.embeddings import collect_embeddings, embedding_inputs, input_token_ids
from gateway.serving.off_loop import tokenizing
from gateway.serving.tool_choice import opens_reasoning, plan_tools
from gateway.state import GatewayState
from shared.errors import GatewayDraining
from shared.queue.key_limits import LimitCharge

Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
CLIENT_CLOSED_REQUEST = 499
"""The answer (never seen by the client) of a request whose client left."""


@dataclass(frozen=True, slots=True)
class RequestHeaders:
    """What the serving step reads of the HTTP request besides its body."""

    idempotency_key: str | None
    timeout_s: float | None
    principal: Principal = ANONYMOUS
    """Who the request acts as (its API key; ANONYMOUS while auth is off)."""


# ----------------------------------------------------------------------- endpoints


async def chat_completions(
    state: GatewayState, body: ChatCompletionRequest, headers: RequestHeaders, receive: Receive
) -> Response:
    plan, parser = await plan_chat(state, body, headers)
    fmt = ChatWriter(
        plan.request_id,
        plan.model,
        with_logprobs=body.logprobs,
        with_token_ids=body.return_token_ids,
        prompt_token_ids=_prompts(plan),
        output=parser,
        tokens_as_ids=body.return_tokens_as_token_ids,
        echo=body.echoed(),
    )
    return await _generate(state, plan, body, fmt, receive)


async def completions(
    state: GatewayState, body: CompletionRequest, headers: RequestHeaders, receive: Receive
) -> Response:
    plan, echo = await plan_completion(state, body, headers)
    fmt = CompletionWriter(
        plan.request_id,
        plan.model,
        with_logprobs=body.logprobs is not None,
        with_token_ids=body.return_token_ids,
        prompt_token_ids=_prompts(plan),
        tokens_as_ids=body.return_tokens_as_token_ids,
        top_logprobs=body.logprobs,
        echo=echo,
    )
    return await _generate(state, plan, body, fmt, receive)


async def embeddings(
    state: GatewayState, body: EmbeddingRequest, headers: RequestHeaders, receive: Receive
) -> Response:
    plan = await plan_embeddings(state, body, headers)
    handle = await state.cells.for_model(plan.served_by).dispatcher.submit(plan)
    async with handle:
        result = await unless_disconnected(collect_embeddings(handle, body, plan.model), receive)
    return _json_answer(result, handle)


# -------------------------------------------------------------------------- plans


async def plan_chat(
    state: GatewayState, body: ChatCompletionRequest, headers: RequestHeaders
) -> tuple[RequestPlan[Generation], OutputParser | None]:
    """The request's plan, and how its choices' text is read (tool calls, reasoning)."""
    model = await _admit(state, body, ModelKind.GENERATE, headers.principal)
    deadline, idempotency_key = _resolve(headers, state)
    limits.check_chat(body, model, state.settings)
    tool_plan = plan_tools(body, model)
    parts = state.images.parts(body, model)
    rendering = translate.chat_rendering(body)
    prompt = await asyncio.to_thread(
        translate.chat_prompt, body, model, len(parts), tool_plan.template_tools, rendering
    )
    tool_plan = tool_plan.opening_reasoning(opens_reasoning(prompt, model))
    choices = translate.choices(body, [prompt], model, logprobs=translate.chat_logprobs(body))
    images = await state.images.load(parts, deadline, state.cells.for_model(model.base).images)
    work = Generation(tuple(tool_plan.apply(choices)), images, body.n)
    plan = _plan("chatcmpl", model, work, deadline, idempotency_key, headers.principal)
    return plan, tool_plan.parser


async def plan_completion(
    state: GatewayState, body: CompletionRequest, headers: RequestHeaders
) -> tuple[RequestPlan[Generation], dict[int, Echo] | None]:
    """The request's plan, and with ``echo`` each choice's prompt as it is written back."""
    model = await _admit(state, body, ModelKind.GENERATE, headers.principal)
    deadline, idempotency_key = _resolve(headers, state)
    limits.check_jobs(len(translate.prompt_list(body)) * body.n, state.settings, "n")
    chars = sum(len(prompt) for prompt in translate.prompt_list(body))
    prompts = await tokenizing(chars, translate.completion_prompts, body, model)
    choices = translate.choices(body, prompts, model, logprobs=body.logprobs)
    work = Generation(tuple(choices), (), body.n)
    plan = _plan("cmpl", model, work, deadline, idempotency_key, headers.principal)
    echo = None
    if body.echo:
        echo = await asyncio.to_thread(translate.echoes, body, choices, model)
    return plan, echo


async def plan_embeddings(
    state: GatewayState, body: EmbeddingRequest, headers: RequestHeaders
) -> RequestPlan[Embedding]:
    model = await _admit(state, body, ModelKind.EMBED, headers.principal)
    deadline, idempotency_key = _resolve(headers, state)
    limits.check_jobs(len(embedding_inputs(body)), state.settings, "input")
    prompts = await asyncio.to_thread(input_token_ids, body, model)
    work = Embedding(tuple(prompts), body.dimensions)
    return _plan("embd", model, work, deadline, idempotency_key, headers.principal)


async def _admit(
    state: GatewayState,
    body: SamplingFields | EmbeddingRequest,
    kind: ModelKind,
    principal: Principal,
) -> ServedModel:
    if state.draining:
        raise GatewayDraining("this gateway is shutting down; retry", retry_after_s=1)
    state.unknown_fields.note(body)
    model = state.catalog.get(body.model, principal.models).require(kind)
    if isinstance(body, SamplingFields):
        translate.refuse_unsupported(body, model)
    dispatcher = state.cells.for_model(model.base).dispatcher
    await dispatcher.check_limits(principal.key_id, principal.limits)
    return model


def _resolve(headers: RequestHeaders, state: GatewayState) -> tuple[Deadline, str | None]:
    """The request's deadline (from now) and idempotency key, each checked once."""
    deadline = Deadline.after(limits.request_timeout_s(headers.timeout_s, state.settings))
    return deadline, limits.idempotency_key(headers.idempotency_key)


def _new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def _plan(
    prefix: str,
    model: ServedModel,
    work: W,
    deadline: Deadline,
    idempotency_key: str | None,
    principal: Principal,
) -> RequestPlan[W]:
    """The request's plan, with what it costs against its key's limits (if any)."""
    request_id = _new_id(prefix)
    plan = RequestPlan(
        request_id,
        model.name,
        work,
        deadline,
        idempotency_key,
        principal.key_id,
        adapter=model.adapter,
        base_model=model.base,
    )
    if principal.key_id is None or not principal.limits.any():
        return plan
    charge = LimitCharge(
        principal.key_id, principal.limits, request_id, reserved_tokens(plan), time.time()
    )
    return dataclasses.replace(plan, charge=charge)


# ----------------------------------------------------------------------- delivery


async def _generate(
    state: GatewayState,
    plan: RequestPlan[Generation],
    body: SamplingFields,
    fmt: ResponseWriter,
    receive: Receive,
) -> Response:
    indices = [choice.index for choice in plan.work.choices]
    handle = await state.cells.for_model(plan.served_by).dispatcher.submit(plan)
    if body.stream:
        events = stream_events(
            handle,
            fmt,
            indices=indices,
            choices_per_prompt=body.n,
            include_usage=body.include_usage(),
            keepalive_s=state.settings.sse_keepalive_s,
            prompt_tokens=_prompt_tokens(plan) if body.continuous_usage() else None,
        )
        return EventStreamResponse(events, handle)  # the response owns the handle now
    async with handle:
        work = collect_response(handle, fmt, indices=indices, choices_per_prompt=body.n)
        result = await unless_disconnected(work, receive)
    return _json_answer(result, handle)


def _prompt_tokens(plan: RequestPlan[Generation]) -> dict[int, int]:
    """Each choice's prompt length, for continuous usage until the engine reports its own
    (a vision prompt's images count as their one placeholder token each until then)."""
    return {index: len(prompt) for index, prompt in _prompts(plan).items()}


def _prompts(plan: RequestPlan[Generation]) -> dict[int, list[int]]:
    """Each choice's prompt token ids (as sent: an image is its one placeholder token)."""
    return {choice.index: choice.prompt_token_ids for choice in plan.work.choices}


def _json_answer(result: Json | None, handle: RequestHandle) -> Response:
    if result is None:  # the client left; the handle's owner has cancelled the request
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(result, headers={"X-Request-Id": handle.request_id, **handle.headers})
