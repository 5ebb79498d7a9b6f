"""OpenAI routes: /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses,
/v1/models.

The POST routes only read the HTTP request; each hands it to its serving step
(:mod:`gateway.serving.endpoints`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Header, Query, Request, Response

from gateway.auth import require_scope
from gateway.catalog.served_models import ServedModel
from gateway.control import response_store
from gateway.control.records import Principal, Scope
from gateway.metrics.request_trace import request_trace
from gateway.openai.responses_schema import ResponsesRequest
from gateway.openai.schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from gateway.openai.vllm_schemas import ModelCard
from gateway.serving import background, endpoints, limits, responses, resumable, resume
from gateway.serving.endpoints import RequestHeaders
from gateway.state import GatewayState, StateDep
from shared.errors import ResponseNotFound

Inference = Annotated[Principal, Depends(require_scope(Scope.INFERENCE))]
"""Every /v1 route needs a key with the ``inference`` scope while auth is on."""

router = APIRouter(prefix="/v1")

IdempotencyKey = Annotated[str | None, Header(alias=limits.IDEMPOTENCY_HEADER)]
Resumable = Annotated[bool, Header(alias=resumable.HEADER)]
"""``Conveyor-Resumable: true``: a stream the client may resume (see resumable.py)."""
LastEventId = Annotated[str | None, Header(alias=resume.LAST_EVENT_ID)]
RequestTimeout = Annotated[float | None, Header(alias=limits.TIMEOUT_HEADER)]


@router.post("/chat/completions", response_model=None)
async def chat_completions(
    body: ChatCompletionRequest,
    request: Request,
    state: StateDep,
    principal: Inference,
    idempotency_key: IdempotencyKey = None,
    timeout_s: RequestTimeout = None,
    resumable_stream: Resumable = False,
) -> Response:
    request.state.model = body.model  # the metrics' model label
    headers = RequestHeaders(
        idempotency_key, timeout_s, principal, request_trace(request), resumable_stream
    )
    return await endpoints.chat_completions(state, body, headers, request.receive)


@router.post("/completions", response_model=None)
async def completions(
    body: CompletionRequest,
    request: Request,
    state: StateDep,
    principal: Inference,
    idempotency_key: IdempotencyKey = None,
    timeout_s: RequestTimeout = None,
    resumable_stream: Resumable = False,
) -> Response:
    request.state.model = body.model  # the metrics' model label
    headers = RequestHeaders(
        idempotency_key, timeout_s, principal, request_trace(request), resumable_stream
    )
    return await endpoints.completions(state, body, headers, request.receive)


@router.get("/chat/completions/{request_id}/stream", response_model=None)
async def resume_chat_completion(
    request_id: str, state: StateDep, principal: Inference, last_event_id: LastEventId = None
) -> Response:
    return await resume.resume_stream(state, request_id, "chat", last_event_id, principal)


@router.get("/completions/{request_id}/stream", response_model=None)
async def resume_completion(
    request_id: str, state: StateDep, principal: Inference, last_event_id: LastEventId = None
) -> Response:
    return await resume.resume_stream(state, request_id, "completion", last_event_id, principal)


@router.post("/embeddings", response_model=None)
async def embeddings(
    body: EmbeddingRequest,
    request: Request,
    state: StateDep,
    principal: Inference,
    timeout_s: RequestTimeout = None,
) -> Response:
    request.state.model = body.model
    headers = RequestHeaders(None, timeout_s, principal, request_trace(request))
    return await endpoints.embeddings(state, body, headers, request.receive)


@router.post("/responses", response_model=None)
async def create_response(
    body: ResponsesRequest,
    request: Request,
    state: StateDep,
    principal: Inference,
    idempotency_key: IdempotencyKey = None,
    timeout_s: RequestTimeout = None,
) -> Response:
    request.state.model = body.model  # the metrics' model label
    headers = RequestHeaders(idempotency_key, timeout_s, principal, request_trace(request))
    return await responses.create_response(state, body, headers, request.receive)


@router.get("/responses/{response_id}", response_model=None)
async def get_response(
    response_id: str,
    state: StateDep,
    principal: Inference,
    stream: bool = False,
    starting_after: Annotated[int | None, Query(ge=0)] = None,
) -> dict[str, Any] | Response:
    if stream:
        return await background.stream(state, response_id, starting_after, principal)
    row = await _stored(state).get(response_id, principal)
    return row.body


@router.post("/responses/{response_id}/cancel")
async def cancel_response(
    response_id: str, state: StateDep, principal: Inference
) -> dict[str, Any]:
    return await background.cancel(state, response_id, principal)


@router.delete("/responses/{response_id}")
async def delete_response(
    response_id: str, state: StateDep, principal: Inference
) -> dict[str, Any]:
    await _stored(state).delete(response_id, principal)
    return {"id": response_id, "object": "response.deleted", "deleted": True}


@router.get("/responses/{response_id}/input_items")
async def response_input_items(
    response_id: str,
    state: StateDep,
    principal: Inference,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "desc",
) -> dict[str, Any]:
    row = await _stored(state).get(response_id, principal)
    return response_store.page(row.input_items, after=after, limit=limit, order=order)


def _stored(state: GatewayState) -> response_store.ResponseStore:
    if state.control is None:
        raise ResponseNotFound("no response store: the gateway runs without its control plane")
    return state.control.responses


@router.get("/models")
async def list_models(state: StateDep, principal: Inference) -> dict[str, Any]:
    every = [*state.catalog.all(), *state.catalog.adapters()]
    models = [m for m in every if principal.may_use(m.name)]
    return {"object": "list", "data": [_model_card(m, principal) for m in models]}


@router.get("/models/{model_id:path}")
async def get_model(model_id: str, state: StateDep, principal: Inference) -> dict[str, Any]:
    return _model_card(state.catalog.get(model_id, principal.models), principal)


def _model_card(model: ServedModel, principal: Principal) -> dict[str, Any]:
    """vLLM's card: a LoRA adapter's ``parent`` is its base model. ``root`` is the model's
    folder or hub id for an admin key (as vLLM shows it) and the served name for other
    keys (server paths are not shown to them)."""
    card = ModelCard(
        id=model.name,
        created=model.created_unix,
        root=model.path if principal.has_scope(Scope.ADMIN) else model.name,
        parent=model.parent,
        max_model_len=model.max_model_len,
        kind=model.kind.value,
    )
    return card.model_dump()
