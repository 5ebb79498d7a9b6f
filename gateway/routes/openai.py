"""OpenAI routes: /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models."""

from __future__ import annotations

import asyncio
import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Header, Request, Response
from fastapi.responses import JSONResponse

from gateway import limits, translate
from gateway.delivery import (
    EventStreamResponse,
    collect_response,
    stream_events,
    unless_disconnected,
)
from gateway.embeddings import collect_embeddings, embedding_inputs, input_token_ids
from gateway.model_catalog import ModelKind, ServedModel
from gateway.responses import ChatFormat, CompletionFormat, ResponseFormat
from gateway.schemas import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    SamplingFields,
)
from gateway.state import GatewayState, StateDep
from shared.errors import GatewayDraining
from shared.protocol import ImageRef

router = APIRouter(prefix="/v1")

IdempotencyKey = Annotated[str | None, Header(alias=limits.IDEMPOTENCY_HEADER)]
RequestTimeout = Annotated[float | None, Header(alias=limits.TIMEOUT_HEADER)]


@router.post("/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    state: StateDep,
    idempotency_key: IdempotencyKey = None,
    timeout_s: RequestTimeout = None,
) -> Response:
    model = _admit(state, body)
    timeout = limits.request_timeout_s(timeout_s, state.settings)
    key = limits.idempotency_key(idempotency_key)
    limits.check_chat(body, model, state.settings)
    images = await state.images.collect(body, model, timeout_s=timeout)
    prompt = await asyncio.to_thread(translate.chat_prompt, body, model, len(images))
    choices = translate.choices(body, [prompt], model, logprobs=translate.chat_logprobs(body))
    fmt = ChatFormat(
        f"chatcmpl-{uuid.uuid4().hex}",
        model.name,
        with_logprobs=body.logprobs,
        with_token_ids=body.return_token_ids,
    )
    return await _run(state, request, body, fmt, choices, key, timeout, images)


@router.post("/completions", response_model=None)
async def completions(
    body: CompletionRequest,
    request: Request,
    state: StateDep,
    idempotency_key: IdempotencyKey = None,
    timeout_s: RequestTimeout = None,
) -> Response:
    model = _admit(state, body)
    timeout = limits.request_timeout_s(timeout_s, state.settings)
    key = limits.idempotency_key(idempotency_key)
    limits.check_jobs(len(translate.prompt_list(body)) * body.n, state.settings, "n")
    prompts = await asyncio.to_thread(translate.completion_prompts, body, model)
    choices = translate.choices(body, prompts, model, logprobs=body.logprobs)
    fmt = CompletionFormat(
        f"cmpl-{uuid.uuid4().hex}",
        model.name,
        with_logprobs=body.logprobs is not None,
        with_token_ids=body.return_token_ids,
    )
    return await _run(state, request, body, fmt, choices, key, timeout)


@router.post("/embeddings", response_model=None)
async def embeddings(
    body: EmbeddingRequest, request: Request, state: StateDep, timeout_s: RequestTimeout = None
) -> Response:
    model = _admit(state, body, ModelKind.EMBED)
    timeout = limits.request_timeout_s(timeout_s, state.settings)
    limits.check_jobs(len(embedding_inputs(body)), state.settings, "input")
    prompts = await asyncio.to_thread(input_token_ids, body, model)
    handle = await state.dispatcher.submit_embeddings(
        f"embd-{uuid.uuid4().hex}",
        model.name,
        prompts,
        timeout_s=timeout,
        dimensions=body.dimensions,
    )
    work = collect_embeddings(handle, body, model.name)
    result = await unless_disconnected(work, request.receive)
    if result is None:
        handle.close()
        return Response(status_code=499)
    return JSONResponse(result, headers={"X-Request-Id": handle.request_id})


@router.get("/models")
async def list_models(state: StateDep) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(m) for m in state.catalog.all()]}


@router.get("/models/{model_id:path}")
async def get_model(model_id: str, state: StateDep) -> dict[str, Any]:
    return _model_card(state.catalog.get(model_id))


def _model_card(model: ServedModel) -> dict[str, Any]:
    return {
        "id": model.name,
        "object": "model",
        "created": model.created_unix,
        "owned_by": "conveyor",
        "max_model_len": model.max_model_len,
        "kind": model.kind.value,
    }


def _admit(
    state: GatewayState,
    body: SamplingFields | EmbeddingRequest,
    kind: ModelKind = ModelKind.GENERATE,
) -> ServedModel:
    if state.draining:
        raise GatewayDraining("this gateway is shutting down; retry", retry_after_s=1)
    state.unknown_fields.note(body)
    model = state.catalog.get(body.model).require(kind)
    if isinstance(body, SamplingFields):
        translate.refuse_unsupported(body, model)
    return model


async def _run(
    state: GatewayState,
    request: Request,
    body: SamplingFields,
    fmt: ResponseFormat,
    choices: list[translate.ChoiceSpec],
    idempotency_key: str | None,
    timeout_s: float,
    images: tuple[ImageRef, ...] = (),
) -> Response:
    handle = await state.dispatcher.submit(
        fmt.request_id,
        fmt.model,
        choices,
        timeout_s=timeout_s,
        idempotency_key=idempotency_key,
        images=images,
    )
    indices = [choice.index for choice in choices]
    if body.stream:
        events = stream_events(
            handle,
            fmt,
            indices=indices,
            choices_per_prompt=body.n,
            include_usage=body.include_usage(),
            keepalive_s=state.settings.sse_keepalive_s,
        )
        return EventStreamResponse(events, handle)
    work = collect_response(handle, fmt, indices=indices, choices_per_prompt=body.n)
    result = await unless_disconnected(work, request.receive)
    if result is None:
        handle.close()
        return Response(status_code=499)
    return JSONResponse(result, headers={"X-Request-Id": fmt.request_id})
