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
import contextlib
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
from gateway.dispatch.plan import (
    AnyPlan,
    ChoiceSpec,
    Deadline,
    Embedding,
    Generation,
    RequestPlan,
    W,
)
from gateway.dispatch.queue_watch import QueueWatch
from gateway.dispatch.refusal import Refusal
from gateway.dispatch.request_handle import RequestHandle
from gateway.dispatch.request_tally import reserved_tokens
from gateway.metrics import model_label
from gateway.metrics.request_trace import RequestTrace
from gateway.openai.logprob_rows import Echo
from gateway.openai.output_parsing import OutputParser
from gateway.openai.responses import ChatWriter, CompletionWriter, Json, ResponseWriter
from gateway.openai.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    SamplingFields,
)
from gateway.serving import limits, resumable, translate
from gateway.serving.delivery import (
    EventStreamResponse,
    collect_response,
    stream_events,
    unless_disconnected,
)
from gateway.serving.embeddings import collect_embeddings, embedding_inputs, input_token_ids
from gateway.serving.off_loop import tokenizing
from gateway.serving.token_push import TokenPush
from gateway.serving.tool_choice import opens_reasoning, plan_tools
from gateway.state import GatewayState
from shared.errors import GatewayDraining, RemoteError
from shared.protocol import ErrorEvent, constraint_kind
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
    trace: RequestTrace | None = None
    """The request's trace (None: tracing is off)."""
    resumable: bool = False
    """``Conveyor-Resumable: true``: a stream its client may resume (serving/resumable.py)."""


# ----------------------------------------------------------------------- endpoints


async def chat_completions(
    state: GatewayState, body: ChatCompletionRequest, headers: RequestHeaders, receive: Receive
) -> Response:
    plan, parser = await plan_chat(state, body, headers)
    fmt = chat_writer(body, plan.request_id, plan.model, _prompts(plan), parser)
    return await _generate(state, plan, body, fmt, receive, headers)


def chat_writer(
    body: ChatCompletionRequest,
    request_id: str,
    model: str,
    prompts: dict[int, list[int]],
    parser: OutputParser | None,
) -> ChatWriter:
    return ChatWriter(
        request_id,
        model,
        with_logprobs=body.logprobs,
        with_token_ids=body.return_token_ids,
        prompt_token_ids=prompts,
        output=parser,
        tokens_as_ids=body.return_tokens_as_token_ids,
        echo=body.echoed(),
        role=answer_role(body),
    )


def completion_writer(
    body: CompletionRequest,
    request_id: str,
    model: str,
    prompts: dict[int, list[int]],
    echo: dict[int, Echo] | None,
) -> CompletionWriter:
    return CompletionWriter(
        request_id,
        model,
        with_logprobs=body.logprobs is not None,
        with_token_ids=body.return_token_ids,
        prompt_token_ids=prompts,
        tokens_as_ids=body.return_tokens_as_token_ids,
        top_logprobs=body.logprobs,
        echo=echo,
    )


async def completions(
    state: GatewayState, body: CompletionRequest, headers: RequestHeaders, receive: Receive
) -> Response:
    plan, echo = await plan_completion(state, body, headers)
    fmt = completion_writer(body, plan.request_id, plan.model, _prompts(plan), echo)
    return await _generate(state, plan, body, fmt, receive, headers)


async def embeddings(
    state: GatewayState, body: EmbeddingRequest, headers: RequestHeaders, receive: Receive
) -> Response:
    plan = await plan_embeddings(state, body, headers)
    handle = await submit(state, plan, headers)
    async with handle:
        result = await unless_disconnected(collect_embeddings(handle, body, plan.model), receive)
    return _json_answer(result, handle)


def answer_role(body: ChatCompletionRequest) -> str:
    """vLLM's rule: ``assistant``, or with ``add_generation_prompt: false`` the last
    message's role (the model continues that turn)."""
    return "assistant" if body.add_generation_prompt else body.messages[-1].role


# -------------------------------------------------------------------------- plans


async def plan_chat(
    state: GatewayState, body: ChatCompletionRequest, headers: RequestHeaders
) -> tuple[RequestPlan[Generation], OutputParser | None]:
    """The request's plan, and how its choices' text is read (tool calls, reasoning)."""
    model = await _admit(state, body, ModelKind.GENERATE, headers.principal)
    deadline, idempotency_key = _resolve(headers, state)
    limits.check_chat(body, model, state.settings)
    parts = state.images.parts(body, model)
    choices, parser = await chat_choices(body, model, len(parts))
    images = await state.images.load(parts, deadline, state.cells.for_model(model.base).images)
    work = Generation(choices, images, body.n)
    plan = _plan(
        "chatcmpl", model, work, deadline, idempotency_key, headers, cache_key=body.prompt_cache_key
    )
    return plan, parser


async def chat_choices(
    body: ChatCompletionRequest, model: ServedModel, images: int
) -> tuple[tuple[ChoiceSpec, ...], OutputParser | None]:
    """The chat request's choices (templated, tokenized), and how their text is read."""
    tool_plan = plan_tools(body, model)
    rendering = translate.chat_rendering(body)
    prompt = await asyncio.to_thread(
        translate.chat_prompt, body, model, images, tool_plan.template_tools, rendering
    )
    tool_plan = tool_plan.opening_reasoning(opens_reasoning(prompt, model))
    choices = translate.choices(body, [prompt], model, logprobs=translate.chat_logprobs(body))
    return tuple(tool_plan.apply(choices)), tool_plan.parser


async def plan_completion(
    state: GatewayState, body: CompletionRequest, headers: RequestHeaders
) -> tuple[RequestPlan[Generation], dict[int, Echo] | None]:
    """The request's plan, and with ``echo`` each choice's prompt as it is written back."""
    model = await _admit(state, body, ModelKind.GENERATE, headers.principal)
    deadline, idempotency_key = _resolve(headers, state)
    limits.check_jobs(len(translate.prompt_list(body)) * body.n, state.settings, "n")
    choices, echo = await completion_choices(body, model)
    work = Generation(choices, (), body.n)
    plan = _plan(
        "cmpl", model, work, deadline, idempotency_key, headers, cache_key=body.prompt_cache_key
    )
    return plan, echo


async def completion_choices(
    body: CompletionRequest, model: ServedModel
) -> tuple[tuple[ChoiceSpec, ...], dict[int, Echo] | None]:
    """The request's choices (tokenized), and with ``echo`` each one's prompt written back."""
    chars = sum(len(prompt) for prompt in translate.prompt_list(body))
    prompts = await tokenizing(chars, translate.completion_prompts, body, model)
    choices = translate.choices(body, prompts, model, logprobs=body.logprobs)
    echo = None
    if body.echo:
        echo = await asyncio.to_thread(translate.echoes, body, choices, model)
    return tuple(choices), echo


async def plan_embeddings(
    state: GatewayState, body: EmbeddingRequest, headers: RequestHeaders
) -> RequestPlan[Embedding]:
    model = await _admit(state, body, ModelKind.EMBED, headers.principal)
    deadline, idempotency_key = _resolve(headers, state)
    limits.check_jobs(len(embedding_inputs(body)), state.settings, "input")
    prompts = await asyncio.to_thread(input_token_ids, body, model)
    work = Embedding(tuple(prompts), body.dimensions)
    return _plan("embd", model, work, deadline, idempotency_key, headers)


async def _admit(
    state: GatewayState,
    body: SamplingFields | EmbeddingRequest,
    kind: ModelKind,
    principal: Principal,
) -> ServedModel:
    if state.draining:
        state.metrics.observe_refusal(Refusal(model_label(state, body.model), "draining"))
        raise GatewayDraining("this gateway is shutting down; retry", retry_after_s=1)
    state.unknown_fields.note(body)
    model = state.catalog.get(body.model, principal.models).require(kind)
    if isinstance(body, SamplingFields):
        translate.refuse_unsupported(body, model)
    dispatcher = state.cells.for_model(model.base).dispatcher
    await dispatcher.check_limits(principal.key_id, principal.limits, model.name)
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
    headers: RequestHeaders,
    *,
    cache_key: str | None = None,
) -> RequestPlan[W]:
    """The request's plan, with what it costs against its key's limits (if any)."""
    request_id = _new_id(prefix)
    principal = headers.principal
    plan = RequestPlan(
        request_id,
        model.name,
        work,
        deadline,
        idempotency_key,
        principal.key_id,
        adapter=model.adapter,
        base_model=model.base,
        cache_key=cache_key,
        traceparent=headers.trace.traceparent if headers.trace is not None else None,
    )
    if principal.key_id is None or not principal.limits.any():
        return plan
    charge = LimitCharge(
        principal.key_id, principal.limits, request_id, reserved_tokens(plan), time.time()
    )
    return dataclasses.replace(plan, charge=charge)


# ----------------------------------------------------------------------- delivery


async def submit(state: GatewayState, plan: AnyPlan, headers: RequestHeaders) -> RequestHandle:
    """Queue the plan's jobs (the dispatcher of its model's Redis); the request's trace
    notes how long that took."""
    started = time.time()
    handle = await state.cells.for_model(plan.served_by).dispatcher.submit(plan)
    if headers.trace is not None:
        headers.trace.admitted(started, handle.tally)
    return handle


async def _generate(
    state: GatewayState,
    plan: RequestPlan[Generation],
    body: ChatCompletionRequest | CompletionRequest,
    fmt: ResponseWriter,
    receive: Receive,
    headers: RequestHeaders,
) -> Response:
    indices = [choice.index for choice in plan.work.choices]
    if headers.resumable:
        kind: resumable.Kind = "chat" if isinstance(body, ChatCompletionRequest) else "completion"
        plan = await resumable.prepare(state, plan, body, kind=kind)
    cell = state.cells.for_model(plan.served_by)
    handle = await submit(state, plan, headers)
    if body.stream:
        if _worker_checks_grammar(plan) and not await _checked_before_streaming(handle, receive):
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        queue = QueueWatch(cell.dispatcher.queue_board, plan.request_id)
        return stream_response(state, handle, fmt, body, _prompts(plan), indices, queue=queue)
    async with handle:
        work = collect_response(handle, fmt, indices=indices, choices_per_prompt=body.n)
        result = await unless_disconnected(work, receive)
    return _json_answer(result, handle)


def _worker_checks_grammar(plan: RequestPlan[Generation]) -> bool:
    """A regex, grammar, choice list, structural tag or JSON schema: the worker compiles it
    before the engine runs, and refuses an invalid one as its first event."""
    sampling = plan.work.choices[0].sampling
    return (
        constraint_kind(sampling) is not None
        or sampling.json_schema is not None
        or (sampling.json_schema_stored)
    )


async def _checked_before_streaming(handle: RequestHandle, receive: Receive) -> bool:
    """Wait for the stream's first event, so that a worker's refusal (an invalid grammar)
    is the request's 400 rather than an error event after a 200, as vLLM answers it.
    False: the client left meanwhile. The handle is closed unless the stream goes on."""
    async with contextlib.AsyncExitStack() as owner:
        owner.push_async_exit(handle)
        event = await unless_disconnected(handle.first(), receive)
        if event is None:
            return False
        if isinstance(event, ErrorEvent):
            raise RemoteError(event)
        owner.pop_all()  # the stream response owns the handle now
    return True


def stream_response(
    state: GatewayState,
    handle: RequestHandle,
    fmt: ResponseWriter,
    body: SamplingFields,
    prompts: dict[int, list[int]],
    indices: list[int],
    *,
    after: tuple[int, int] | None = None,
    queue: QueueWatch | None = None,
) -> EventStreamResponse:
    """The SSE response of a generation; ``after``: resume after this event; ``queue``:
    its place in the queue while it waits (comments)."""
    push = TokenPush()
    events = stream_events(
        handle,
        fmt,
        indices=indices,
        choices_per_prompt=body.n,
        include_usage=body.include_usage(),
        keepalive_s=state.settings.sse_keepalive_s,
        prompt_tokens=_prompt_tokens(prompts) if body.continuous_usage() else None,
        after=after,
        queue=queue,
        join_waiting=state.settings.stream_join_waiting,
        push=push,
    )
    return EventStreamResponse(events, handle, push)  # the response owns the handle now


def _prompt_tokens(prompts: dict[int, list[int]]) -> dict[int, int]:
    """Each choice's prompt length, for continuous usage until the engine reports its own
    (a vision prompt's images count as their one placeholder token each until then)."""
    return {index: len(prompt) for index, prompt in prompts.items()}


def _prompts(plan: RequestPlan[Generation]) -> dict[int, list[int]]:
    """Each choice's prompt token ids (as sent: an image is its one placeholder token)."""
    return {choice.index: choice.prompt_token_ids for choice in plan.work.choices}


def _json_answer(result: Json | None, handle: RequestHandle) -> Response:
    if result is None:  # the client left; the handle's owner has cancelled the request
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    return JSONResponse(result, headers={"X-Request-Id": handle.request_id, **handle.headers})
