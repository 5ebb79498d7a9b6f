"""SageMaker's ``POST /invocations``: one body, sent on to chat completions, completions or
embeddings by its shape, as vLLM's server does (``entrypoints/serve/sagemaker``).

vLLM tries each request class in turn (chat, completion, then the pooling ones) and takes
the first that validates; here the body's own field picks the endpoint (``messages``:
chat, ``prompt``: completions, ``input``: embeddings), so that a bad body is answered with
what is wrong with it rather than "no suitable handler".
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from fastapi import Response
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ValidationError

from gateway.openai.schemas import ChatCompletionRequest, CompletionRequest, EmbeddingRequest
from gateway.serving import endpoints
from gateway.serving.endpoints import Receive, RequestHeaders
from gateway.state import GatewayState
from shared.errors import InvalidRequest

SHAPES: tuple[tuple[str, type[BaseModel]], ...] = (
    ("messages", ChatCompletionRequest),
    ("prompt", CompletionRequest),
    ("input", EmbeddingRequest),
)
"""The field that picks each endpoint, in vLLM's order of preference."""


def parse(raw: bytes) -> BaseModel:
    """The body as the request of the endpoint its shape picks; a 400 otherwise."""
    try:
        body = json.loads(raw)
    except ValueError as exc:
        error = {"type": "json_invalid", "loc": ("body",), "msg": str(exc), "input": None}
        raise RequestValidationError([error]) from exc
    if isinstance(body, dict):
        for field, request_type in SHAPES:
            if field in body:
                return _validate(request_type, body)
    names = ", ".join(request_type.__name__ for _, request_type in SHAPES)
    raise InvalidRequest(
        "Cannot find suitable handler for request. Expected one of: "
        f"{names} (a JSON object with `messages`, `prompt` or `input`)"
    )


def _validate(request_type: type[BaseModel], body: dict[str, Any]) -> BaseModel:
    try:
        return request_type.model_validate(body)
    except ValidationError as exc:
        errors = [{**error, "loc": ("body", *error["loc"])} for error in exc.errors()]
        raise RequestValidationError(errors) from exc


async def invoke(
    state: GatewayState, body: BaseModel, headers: RequestHeaders, receive: Receive
) -> Response:
    if isinstance(body, ChatCompletionRequest):
        return await endpoints.chat_completions(state, body, headers, receive)
    if isinstance(body, CompletionRequest):
        return await endpoints.completions(state, body, headers, receive)
    if isinstance(body, EmbeddingRequest):  # /v1/embeddings takes no Idempotency-Key
        headers = dataclasses.replace(headers, idempotency_key=None)
        return await endpoints.embeddings(state, body, headers, receive)
    raise TypeError(f"no endpoint takes {type(body).__name__}")
