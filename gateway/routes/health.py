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
    """Every Redis the gateway uses answers (the home one and each model's own), a live,
    non-draining worker serves every configured model (on its own Redis), and the
    database schema is at head (keys loaded, when auth is on). A database outage after
    that is reported (``control``) but does not fail readiness: known keys keep working
    and usage rows wait in Redis."""
    problems: list[str] = []
    for cell in state.cells.all():
        try:
            await cell.redis.ping()
        except RedisError as exc:
            where = "" if not state.cells.sharded else f" ({cell.name})"
            problems.append(f"redis{where} unreachable: {exc}")
    if state.draining:
        problems.append("gateway is shutting down")
    models: dict[str, Any] = {}
    for model in state.catalog.all():
        cell = state.cells.for_model(model.name)
        models[model.name] = {"workers": len(cell.directory.serving(model.name))}
        if state.cells.sharded:
            models[model.name]["redis"] = cell.name
        if not cell.directory.answers(model.name, model.kind.value):
            problems.append(f"no live worker serves {model.name}")
    body: dict[str, Any] = {"ready": not problems, "problems": problems, "models": models}
    if state.control is not None:
        control_problems, body["control"] = await state.control.readiness()
        problems += control_problems
        body["ready"] = not problems
    return JSONResponse(body, status_code=200 if not problems else 503)
