"""Liveness (/health) and readiness (/ready). /admin/* lives in routes/admin.py.

Both answer without a key (probes). /ready tells anyone whether the gateway is ready
and, in general terms, why not; the details (models, worker counts, the control plane's
database and keys, raw errors) only to an admin key, or to anyone with auth off.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError

from gateway.auth import authenticate
from gateway.control.records import Scope
from gateway.state import GatewayState, StateDep
from shared.errors import ConveyorError

router = APIRouter()


@router.get("/health")
async def health() -> dict[str, str]:
    """The process is alive and serving HTTP."""
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request, state: StateDep) -> JSONResponse:
    """Every Redis the gateway uses answers (the home one and each model's own), a live,
    non-draining worker serves every configured model (on its own Redis), and the
    database schema is at head (keys loaded, when auth is on). A database outage after
    that is reported (``control``) but does not fail readiness: known keys keep working
    and usage rows wait in Redis."""
    general: list[str] = []  # what anyone may read
    problems: list[str] = []  # the same with names and errors, for an admin
    for cell in state.cells.all():
        try:
            await cell.redis.ping()
        except RedisError as exc:
            where = "" if not state.cells.sharded else f" ({cell.name})"
            general.append("redis unreachable")
            problems.append(f"redis{where} unreachable: {exc}")
    if state.draining:
        general.append("gateway is shutting down")
        problems.append("gateway is shutting down")
    models: dict[str, Any] = {}
    for model in state.catalog.all():
        cell = state.cells.for_model(model.name)
        models[model.name] = {"workers": len(cell.directory.serving(model.name))}
        if state.cells.sharded:
            models[model.name]["redis"] = cell.name
        if not cell.directory.answers(model.name, model.kind.value):
            general.append("a model has no live worker")
            problems.append(f"no live worker serves {model.name}")
    body: dict[str, Any] = {"ready": not problems, "problems": problems, "models": models}
    if state.control is not None:
        control_problems, body["control"] = await state.control.readiness()
        general += ["control plane not ready"] * bool(control_problems)
        problems += control_problems
        body["ready"] = not problems
    status = 200 if not problems else 503
    if not _shows_details(request, state):
        body = {"ready": not problems, "problems": list(dict.fromkeys(general))}
    return JSONResponse(body, status_code=status)


def _shows_details(request: Request, state: GatewayState) -> bool:
    """Auth off, or an admin key in the request."""
    if not state.settings.auth_enabled():
        return True
    try:
        principal = authenticate(state, request.headers.get("authorization"))
    except ConveyorError:
        return False
    return principal.has_scope(Scope.ADMIN)
