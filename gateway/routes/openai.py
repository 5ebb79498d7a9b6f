"""OpenAI routes: /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses,
/v1/models.

The POST routes only read the HTTP request; each hands it to its serving step
(:mod:`gateway.serving.endpoints`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Query, Request, Response

from gateway.catalog.served_models import ServedModel
from gateway.control import response_store
from gateway.control.records import Principal, Scope
from gateway.openai.responses_schema import ResponsesRequest
from gateway.openai.schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from gateway.openai.vllm_schemas import ModelCard
from gateway.routes.request_headers import Headers, Inference, documented
from gateway.serving import background, endpoints, limits, responses, resume
from gateway.serving.resumable import HEADER as RESUMABLE
from gateway.state import GatewayState, StateDep
from shared.errors import ResponseNotFound

router = APIRouter(prefix="/v1")

LastEventId = Annotated[str | None, Header(alias=resume.LAST_EVENT_ID)]
GENERATION_HEADERS = documented(limits.IDEMPOTENCY_HEADER, limits.TIMEOUT_HEADER, RESUMABLE)


@router.post("/chat/completions", response_model=None, openapi_extra=GENERATION_HEADERS)
async def chat_completions(
    body: ChatCompletionRequest, request: Request, state: StateDep, headers: Headers
) -> Response:
    request.state.model = body.model  # the metrics' model label
    return await endpoints.chat_completions(state, body, headers, request.receive)


@router.post("/completions", response_model=None, openapi_extra=GENERATION_HEADERS)
async def completions(
    body: CompletionRequest, request: Request, state: StateDep, headers: Headers
) -> Response:
    request.state.model = body.model  # the metrics' model label
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


@router.post("/embeddings", response_model=None, openapi_extra=documented(limits.TIMEOUT_HEADER))
async def embeddings(
    body: EmbeddingRequest, request: Request, state: StateDep, headers: Headers
) -> Response:
    request.state.model = body.model
    read = replace(headers, idempotency_key=None)  # an embedding takes no idempotency key
    return await endpoints.embeddings(state, body, read, request.receive)


@router.post(
    "/responses",
    response_model=None,
    openapi_extra=documented(limits.IDEMPOTENCY_HEADER, limits.TIMEOUT_HEADER),
)
async def create_response(
    body: ResponsesRequest, request: Request, state: StateDep, headers: Headers
) -> Response:
    request.state.model = body.model  # the metrics' model label
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
