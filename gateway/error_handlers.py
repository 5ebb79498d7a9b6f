"""The one funnel from exceptions to OpenAI-shaped error responses.

Every error body, here and inside a stream (gateway/serving/delivery.py), is built by
:func:`shared.errors.openai_error`.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from shared.errors import ConveyorError, RetryableError, openai_error

log = logging.getLogger(__name__)


async def _conveyor_error(_: Request, exc: Exception) -> JSONResponse:
    if not isinstance(exc, ConveyorError):  # registered for ConveyorError only
        raise exc
    return error_response(exc)


def error_response(exc: ConveyorError, **extra_headers: str) -> JSONResponse:
    """``exc`` as its OpenAI-shaped response (``Retry-After`` for a retryable one)."""
    headers = {**exc.headers, **extra_headers}
    if isinstance(exc, RetryableError):
        headers["Retry-After"] = str(exc.retry_after_s)
    return JSONResponse(exc.to_openai(), status_code=exc.status, headers=headers)


async def _validation_error(_: Request, exc: Exception) -> JSONResponse:
    if not isinstance(exc, RequestValidationError):
        raise exc
    first = _most_specific(list(exc.errors()))
    location = [str(part) for part in first.get("loc", ())]
    if location and location[0] in _REQUEST_PARTS:
        location = location[1:]  # "body", or "header" before a header's name
    param = _param_path(location) or None
    message = first.get("msg", "invalid request")
    if first.get("type") == "json_invalid":
        message, param = "The request body is not valid JSON.", None
    elif param:
        message = f"{param}: {message}"
    return JSONResponse(
        openai_error(message, "invalid_request_error", param, "invalid_value"), status_code=400
    )


def _most_specific(errors: list[Any]) -> Any:
    """The first field's deepest error: for a union (``stop``: a string or a list) pydantic
    reports every branch, and the branch that went deepest is the one the client meant."""
    if not errors:
        return {}
    field = tuple(errors[0].get("loc", ()))[:2]
    same_field = [e for e in errors if tuple(e.get("loc", ()))[:2] == field]
    return max(same_field, key=lambda e: len(e.get("loc", ())))


async def _http_error(_: Request, exc: Exception) -> JSONResponse:
    if not isinstance(exc, HTTPException):
        raise exc
    type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return JSONResponse(
        openai_error(str(exc.detail), type_, None, None),
        status_code=exc.status_code,
        headers=exc.headers,
    )


async def _unexpected_error(_: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error", exc_info=exc)
    return JSONResponse(
        openai_error("internal server error", "server_error", None, None), status_code=500
    )


def _param_path(location: list[str]) -> str:
    path = ""
    for part in location:
        if part.isdigit():
            path += f"[{part}]"
        elif _is_union_branch(part):
            continue  # pydantic's union branch names are not request fields
        else:
            path += f".{part}" if path else part
    return path


_REQUEST_PARTS = frozenset({"body", "header", "query", "path", "cookie"})
_SCALAR_BRANCHES = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _is_union_branch(part: str) -> bool:
    return (
        part in _SCALAR_BRANCHES
        or "[" in part
        or part.startswith(("function-", "tagged-union", "union[", "constrained-"))
    )


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(ConveyorError, _conveyor_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
