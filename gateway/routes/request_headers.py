"""What an OpenAI POST route reads of the HTTP request besides its body: its headers, its
key and its trace (:class:`~gateway.serving.endpoints.RequestHeaders`).

The headers are read by hand. As FastAPI ``Header()`` parameters each one went through
pydantic on every request, and the three of a chat request cost 60-100 µs of CPU (about
a tenth of a short request's in the gateway) against about 10 µs read here. They stay
in the OpenAPI description (:func:`documented`). A value that is not what the header
takes is a 400 naming the header, as before.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request

from gateway.auth import require_scope
from gateway.control.records import Principal, Scope
from gateway.metrics.request_trace import request_trace
from gateway.serving import limits, resumable
from gateway.serving.endpoints import RequestHeaders
from shared.errors import InvalidRequest

Inference = Annotated[Principal, Depends(require_scope(Scope.INFERENCE))]
"""Every /v1 route needs a key with the ``inference`` scope while auth is on."""

_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})
"""The spellings of a boolean header pydantic accepts (any case)."""


async def read_headers(request: Request, principal: Inference) -> RequestHeaders:
    """(``async``: FastAPI runs a plain ``def`` dependency in its thread pool.)"""
    headers = request.headers
    return RequestHeaders(
        idempotency_key=headers.get(limits.IDEMPOTENCY_HEADER),
        timeout_s=_seconds(headers.get(limits.TIMEOUT_HEADER), limits.TIMEOUT_HEADER),
        principal=principal,
        trace=request_trace(request),
        resumable=_flag(headers.get(resumable.HEADER), resumable.HEADER),
    )


Headers = Annotated[RequestHeaders, Depends(read_headers)]


def _seconds(value: str | None, header: str) -> float | None:
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        raise InvalidRequest(f"{header}: not a number of seconds", param=header) from None


def _flag(value: str | None, header: str) -> bool:
    if value is None:
        return False
    spelled = value.strip().lower()
    if spelled in _TRUE:
        return True
    if spelled in _FALSE:
        return False
    raise InvalidRequest(f"{header}: not a boolean (true or false)", param=header)


def documented(*names: str) -> dict[str, Any]:
    """A route's ``openapi_extra``: the headers it reads, as FastAPI would describe them."""
    return {"parameters": [_DESCRIPTIONS[name] for name in names]}


def _header(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {
        "name": name,
        "in": "header",
        "required": False,
        "schema": schema,
        "description": description,
    }


_DESCRIPTIONS = {
    limits.IDEMPOTENCY_HEADER: _header(
        limits.IDEMPOTENCY_HEADER,
        {"type": "string", "maxLength": limits.MAX_IDEMPOTENCY_KEY_CHARS},
        "The same key (per API key) is never queued twice: a repeat while it is remembered "
        "gets 409.",
    ),
    limits.TIMEOUT_HEADER: _header(
        limits.TIMEOUT_HEADER,
        {"type": "number", "exclusiveMinimum": 0},
        "Seconds the request may take (cut to the gateway's maximum).",
    ),
    resumable.HEADER: _header(
        resumable.HEADER,
        {"type": "boolean", "default": False},
        "true: a stream its client may resume after a dropped connection.",
    ),
}
