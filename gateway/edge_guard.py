"""Pure-ASGI checks that run on the request line and headers, before a byte of the body
is read (and before JSON parsing, routing or any other work):

- :class:`KeyGate`: with auth on, a request without a valid API key gets its 401 here,
  so a keyless client cannot have up to ``max_request_body_bytes`` buffered and parsed.
  Only ``/health`` and ``/ready`` are open. The scope a route needs is still checked by
  its dependency (gateway/auth.py); this gate only asks "is this a key at all".
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.auth import authenticate
from gateway.error_handlers import error_response
from gateway.state import GatewayState
from shared.errors import ConveyorError

OPEN_PATHS = frozenset({"/health", "/ready"})
"""Answered without a key (liveness and readiness probes)."""


class KeyGate:
    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self._app(scope, receive, send)
            return
        state: GatewayState = scope["app"].state.gateway
        if state.settings.auth_enabled():
            try:
                authenticate(state, header(scope, b"authorization"))
            except ConveyorError as error:
                response = error_response(error, Connection="close")
                await response(scope, receive, send)
                return
        await self._app(scope, receive, send)


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of header ``name`` (lower case), decoded as Latin-1."""
    for key, value in scope.get("headers", ()):
        if key == name:
            text: str = value.decode("latin-1")
            return text
    return None
