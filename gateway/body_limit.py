"""ASGI middleware that caps the size of a request body, and the time it takes, while it
is read.

A declared ``Content-Length`` over the limit is refused before a byte of the body
is read; a chunked body is counted as it arrives and refused as soon as it passes
the limit. Either way the client gets a 413 in OpenAI's error shape and nothing
downstream (JSON parsing, tokenization) runs. A body within the limit is handed
on whole; later ``receive`` calls (disconnect detection) go to the server. A body
that has not arrived whole within ``read_timeout_s`` (bytes trickling in) is a 408.
"""

from __future__ import annotations

import asyncio

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from shared.errors import BodyReadTimeout, ConveyorError, RequestTooLarge


class BodySizeLimit:
    def __init__(self, app: ASGIApp, *, max_bytes: int, read_timeout_s: float) -> None:
        self._app = app
        self._max_bytes = max_bytes
        self._read_timeout_s = read_timeout_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self._app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self._max_bytes:
            await self._refuse(self._too_large(), scope, receive, send)
            return
        try:
            async with asyncio.timeout(self._read_timeout_s):
                first = await self._read_body(receive)
        except TimeoutError:
            error = BodyReadTimeout(
                f"the request body did not arrive within {self._read_timeout_s:g} s "
                "(CONVEYOR_REQUEST_BODY_TIMEOUT_S)"
            )
            await self._refuse(error, scope, receive, send)
            return
        if first is None:
            await self._refuse(self._too_large(), scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return first

        await self._app(scope, replay, send)

    async def _read_body(self, receive: Receive) -> Message | None:
        """The whole body as one message (or the disconnect that cut it); None: too large."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return message  # the client left: let the app see the disconnect
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self._max_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}

    def _too_large(self) -> RequestTooLarge:
        return RequestTooLarge(
            f"the request body is larger than {self._max_bytes} bytes "
            "(CONVEYOR_MAX_REQUEST_BODY_BYTES)"
        )

    async def _refuse(
        self, error: ConveyorError, scope: Scope, receive: Receive, send: Send
    ) -> None:
        response = JSONResponse(
            error.to_openai(), status_code=error.status, headers={"Connection": "close"}
        )
        await response(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # servers refuse a malformed length before the app sees it
    return None
