"""Liveness (/health) and readiness (/ready)."""

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
    """Redis answers and a live, non-draining worker serves every configured model."""
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
    body = {"ready": not problems, "problems": problems, "models": models}
    return JSONResponse(body, status_code=200 if not problems else 503)


@router.get("/admin/state")
async def admin_state(state: StateDep) -> dict[str, Any]:
    """What this gateway holds right now (for operators and leak checks)."""
    return {
        "gateway_id": state.gateway_id,
        "draining": state.draining,
        "open_requests": state.router.open_requests(),
        "workers": [w.worker_id for w in state.directory.all()],
        "pools": state.directory.pools(),
    }
