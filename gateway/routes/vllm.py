"""vLLM's own routes beside the OpenAI ones, so that Conveyor stands in for ``vllm serve``:
/tokenize, /detokenize, /tokenizer_info, /version, /load, /is_sleeping,
/v1/chat/completions/batch, and SageMaker's /ping and /invocations. Bodies:
:mod:`gateway.openai.vllm_schemas`.

Each takes an ``inference`` key while auth is on, but /ping (liveness, like /health) and
/version (as public as vLLM's).
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import replace
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request, Response

from gateway.openai.vllm_schemas import DetokenizeRequest, TokenizeRequest
from gateway.routes.health import health
from gateway.routes.request_headers import Headers, Inference, documented
from gateway.serving import chat_batch, invocations, limits, tokenization
from gateway.state import StateDep

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, state: StateDep, principal: Inference) -> dict[str, Any]:
    return await tokenization.tokenize(state, body, principal)


@router.post("/detokenize")
async def detokenize(
    body: DetokenizeRequest, state: StateDep, principal: Inference
) -> dict[str, Any]:
    return tokenization.detokenize(state, body, principal)


@router.get("/tokenizer_info")
async def tokenizer_info(
    state: StateDep, principal: Inference, model: Annotated[str | None, Query()] = None
) -> dict[str, Any]:
    """vLLM serves one model and takes no ``model``; here ``?model=`` picks one (default:
    the first served model)."""
    return tokenization.tokenizer_info(tokenization.served_model(state, model, principal))


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": conveyor_version()}


def conveyor_version() -> str:
    try:
        return importlib.metadata.version("conveyor")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree, not installed
        return "unknown"


@router.get("/load")
async def load(state: StateDep, _: Inference) -> dict[str, int]:
    """vLLM's ``server_load``: the requests this server has in flight (here: the requests
    this gateway is delivering, streams included), the number a router compares."""
    return {"server_load": state.cells.open_requests()}


@router.get("/is_sleeping")
async def is_sleeping(_: Inference) -> dict[str, bool]:
    """Always false: the gateway itself never sleeps, and no worker reports a sleep state
    (CPU engines have none: their sleep command answers 501, see routes/workers.py)."""
    return {"is_sleeping": False}


@router.get("/ping")
@router.post("/ping")
async def ping() -> dict[str, str]:
    """SageMaker's health check: /health."""
    return await health()


KEY_AND_TIMEOUT = documented(limits.IDEMPOTENCY_HEADER, limits.TIMEOUT_HEADER)


@router.post("/invocations", response_model=None, openapi_extra=KEY_AND_TIMEOUT)
async def invoke(request: Request, state: StateDep, headers: Headers) -> Response:
    body = invocations.parse(await request.body())
    request.state.model = getattr(body, "model", None)  # the metrics' model label
    read = replace(headers, resumable=False)  # an invocation's stream is not resumable
    return await invocations.invoke(state, body, read, request.receive)


@router.post("/v1/chat/completions/batch", response_model=None, openapi_extra=KEY_AND_TIMEOUT)
async def chat_completions_batch(request: Request, state: StateDep, headers: Headers) -> Response:
    """Several conversations in one call: one chat completion each (see
    :mod:`gateway.serving.chat_batch`)."""
    bodies = chat_batch.parse(await request.body())
    request.state.model = bodies[0].model  # the metrics' model label
    read = replace(headers, trace=None)  # each conversation is a request of its own
    return await chat_batch.chat_completions_batch(state, bodies, read, request.receive)
