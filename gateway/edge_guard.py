"""Pure-ASGI checks that run on the request line and headers, before a byte of the body
is read (and before JSON parsing, routing or any other work):

- :class:`KeyGate`: with auth on, a request without a valid API key gets its 401 here,
  so a keyless client cannot have up to ``max_request_body_bytes`` buffered and parsed.
  Only ``/health``, ``/ready``, ``/ping`` and ``/version`` are open. The scope a route needs is
  still checked by
  its dependency (gateway/auth.py); this gate only asks "is this a key at all".
- with auth off, only loopback ``Host`` names (and those of ``allowed_hosts``) are
  answered: a web page that points a name of its own at 127.0.0.1 (DNS rebinding)
  cannot drive a local gateway's API from a browser.
"""

from __future__ import annotations

import functools

from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.auth import authenticate, is_loopback
from gateway.error_handlers import error_response
from gateway.state import GatewayState
from shared.errors import ConveyorError, HostNotAllowed
from shared.settings import GatewaySettings

OPEN_PATHS = frozenset({"/health", "/ready", "/ping", "/version"})
"""Answered without a key (liveness and readiness probes)."""


class EdgeGuard:
    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            refusal = _refusal(scope, scope["app"].state.gateway)
            if refusal is not None:
                response = error_response(refusal, Connection="close")
                await response(scope, receive, send)
                return
        await self._app(scope, receive, send)


def _refusal(scope: Scope, state: GatewayState) -> ConveyorError | None:
    if not state.settings.auth_enabled():
        host = header(scope, b"host")
        if host_allowed(host, state.settings):
            return None
        return HostNotAllowed(
            f"Host {host_name(host or '')[:64]!r} is not served with auth off: only loopback "
            "names are (CONVEYOR_ALLOWED_HOSTS adds more; turning auth on lifts the rule)."
        )
    if scope["path"] in OPEN_PATHS:
        return None
    try:
        authenticate(state, header(scope, b"authorization"))
    except ConveyorError as error:
        return error
    return None


HOST_MAX_CHARS = 255
"""Longer than any DNS name: such a Host is judged afresh each time, never remembered."""


def host_allowed(host: str | None, settings: GatewaySettings) -> bool:
    """A request without a Host header (HTTP/1.0) comes from no browser: allowed."""
    if host is None:
        return True
    if len(host) > HOST_MAX_CHARS:
        return _host_allowed(host, settings.allowed_hosts)
    return _host_allowed_cached(host, settings.allowed_hosts)


@functools.lru_cache(maxsize=256)
def _host_allowed_cached(host: str, allowed_hosts: str) -> bool:
    """Every request of a client carries the same Host: parsing it (``ipaddress``) once
    per name, not per request."""
    return _host_allowed(host, allowed_hosts)


def _host_allowed(host: str, allowed_hosts: str) -> bool:
    allowed = {name.strip().lower() for name in allowed_hosts.split(",")}
    name = host_name(host)
    return "*" in allowed or name in allowed or is_loopback(name)


def host_name(host: str) -> str:
    """``example.com:8000`` -> ``example.com``; ``[::1]:8000`` -> ``::1``."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:].partition("]")[0]
    if host.count(":") == 1:
        host = host.partition(":")[0]
    return host.rstrip(".")


def header(scope: Scope, name: bytes) -> str | None:
    """The first value of header ``name`` (lower case), decoded as Latin-1."""
    for key, value in scope.get("headers", ()):
        if key == name:
            text: str = value.decode("latin-1")
            return text
    return None
