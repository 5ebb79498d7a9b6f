"""Who may call what: ``Authorization: Bearer <key>`` -> a :class:`Principal` with scopes.

One dependency, :func:`require_scope`, resolves the key through the gateway's
in-memory :class:`KeyCache` (no I/O) and refuses with OpenAI's errors: 401
``invalid_api_key`` for a missing, malformed, unknown, revoked or expired key; 403
when the key lacks the scope. With auth off every request acts as ``ANONYMOUS``
(every scope). The principal is also left in ``request.state.principal``.

:func:`check_auth_settings` is the start-up rule: auth may be off only while the
gateway listens on loopback, unless the operator opts in explicitly.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Awaitable, Callable

from fastapi import Request

from gateway.control.records import ANONYMOUS, Principal, Scope, parse_scopes
from gateway.state import GatewayState
from shared.errors import DatabaseUnavailable, InvalidApiKey, InvalidRequest, PermissionDenied
from shared.settings import AuthMode, GatewaySettings

MIN_ADMIN_KEY_CHARS = 16

MALFORMED_HEADER_MESSAGE = "Malformed Authorization header: send `Authorization: Bearer YOUR_KEY`."


class AuthConfigError(RuntimeError):
    """The auth settings are unsafe or contradictory: the gateway refuses to start."""


def bearer_secret(authorization: str | None) -> str | None:
    """The secret of an ``Authorization: Bearer`` header (None: no header)."""
    if authorization is None:
        return None
    scheme, _, secret = authorization.strip().partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise InvalidApiKey(MALFORMED_HEADER_MESSAGE)
    return secret.strip()


def authenticate(state: GatewayState, authorization: str | None) -> Principal:
    """The request's principal; raises InvalidApiKey (401)."""
    if not state.settings.auth_enabled():
        return ANONYMOUS
    if state.control is None:  # the lifespan sets it before serving: not expected
        raise DatabaseUnavailable("API keys are not loaded yet", retry_after_s=1)
    outcome = state.control.keys.resolve(bearer_secret(authorization))
    if isinstance(outcome, InvalidApiKey):
        raise outcome
    return outcome


def require_scope(*scopes: Scope) -> Callable[[Request], Awaitable[Principal]]:
    """A dependency admitting keys holding any of ``scopes`` (``admin`` holds them all)."""
    needed = " or ".join(f"`{scope.value}`" for scope in scopes)

    async def dependency(request: Request) -> Principal:
        state: GatewayState = request.app.state.gateway
        principal = authenticate(state, request.headers.get("authorization"))
        if not any(principal.has_scope(scope) for scope in scopes):
            raise PermissionDenied(
                f"This API key ({principal.masked_key or principal.name}) lacks the {needed} "
                "scope this endpoint needs."
            )
        request.state.principal = principal
        return principal

    return dependency


def require_metrics() -> Callable[[Request], Awaitable[Principal]]:
    """For /metrics: any scope of ``settings.metrics_scopes`` (read at request time)."""

    async def dependency(request: Request) -> Principal:
        state: GatewayState = request.app.state.gateway
        allowed = parse_scopes(state.settings.metrics_scopes.split(","), param="metrics_scopes")
        return await require_scope(*allowed)(request)

    return dependency


def is_loopback(host: str) -> bool:
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # another host name: it may resolve to anything


def check_auth_settings(settings: GatewaySettings) -> None:
    """Raise AuthConfigError (with what to do) when the gateway must not start."""
    admin = settings.admin_secret()
    if settings.auth is AuthMode.OFF and admin is not None:
        raise AuthConfigError(
            "CONVEYOR_AUTH=off contradicts CONVEYOR_ADMIN_KEY (which turns auth on): unset one."
        )
    if admin is not None and len(admin) < MIN_ADMIN_KEY_CHARS:
        raise AuthConfigError(
            f"CONVEYOR_ADMIN_KEY is {len(admin)} characters; use at least "
            f"{MIN_ADMIN_KEY_CHARS} random ones, e.g. the output of "
            "`python -c 'import secrets; print(secrets.token_urlsafe(32))'`."
        )
    try:
        parse_scopes(settings.metrics_scopes.split(","), param="metrics_scopes")
    except InvalidRequest as exc:
        raise AuthConfigError(f"CONVEYOR_METRICS_SCOPES: {exc.message}") from exc
    if settings.auth_enabled() or is_loopback(settings.host):
        return
    if not settings.allow_unauthenticated_public:
        raise AuthConfigError(
            f"refusing to listen on {settings.host} with auth off: anyone who can reach it "
            "could use it. Turn auth on (set CONVEYOR_ADMIN_KEY, or CONVEYOR_AUTH=on with keys "
            "from `conveyor keys create`), listen on 127.0.0.1, or accept an open gateway "
            "with CONVEYOR_ALLOW_UNAUTHENTICATED_PUBLIC=true."
        )
