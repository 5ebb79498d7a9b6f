"""Liveness (/health) and readiness (/ready). /admin/* lives in routes/admin.py."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError

from gateway.state import StateDep

router = APIRouter()


@router.get("/health")
async def health() -> dict[str, str]:
    """The process is alive and serving HTTP."""
    return {"status": "ok"}


@router.get("/ready")
async def ready(state: StateDep) -> JSONResponse:
    """Redis answers, a live, non-draining worker serves every configured model, and the
    database schema is at head (keys loaded, when auth is on). A database outage after
    that is reported (``control``) but does not fail readiness: known keys keep working
    and usage rows wait in Redis."""
    problems: list[str] = []
    try:
        await state.redis.ping()
    except RedisError as exc:
        problems.append(f"redis unreachable: {exc}")
    if state.draining:
        problems.append("gateway is shutting down")
    models: dict[str, Any] = {}
    for model in state.catalog.all():
        workers = state.directory.serving(model.name)
        models[model.name] = {"workers": len(workers)}
        if not state.directory.answers(model.name, model.kind.value):
            problems.append(f"no live worker serves {model.name}")
    body: dict[str, Any] = {"ready": not problems, "problems": problems, "models": models}
    if state.control is not None:
        control_problems, body["control"] = await state.control.readiness()
        problems += control_problems
        body["ready"] = not problems
    return JSONResponse(body, status_code=200 if not problems else 503)
