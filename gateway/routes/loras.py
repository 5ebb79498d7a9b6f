"""LoRA adapter admin routes: ``/admin/loras`` and vLLM's own load/unload bodies.

All need the ``admin`` scope when auth is on. The work is the control plane's
(:mod:`gateway.control.lora_service`): SQL first, then the desired state in Redis, then
the workers' reports. This gateway's catalog is refreshed before answering, so an added
adapter is served, and a removed one refused (404), here at once; other gateways follow
within ~0.25 s (:mod:`gateway.catalog.lora_watch`).

``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` and
``POST /v1/unload_lora_adapter {"lora_name"}`` answer like vLLM's server (plain text
``Success: ...``), so tooling written for vLLM keeps working; errors are OpenAI-shaped.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from datetime import UTC
from typing import Annotated, Any

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict
from redis.exceptions import RedisError

from gateway.auth import require_scope
from gateway.control.lora_service import LoraService, Registered
from gateway.control.records import Scope
from gateway.state import GatewayState, StateDep
from shared.errors import DatabaseUnavailable, InvalidRequest
from shared.queue.lora_registry import LoraSpec, Rollout

log = logging.getLogger(__name__)

router = APIRouter(dependencies=[Depends(require_scope(Scope.ADMIN))])


async def _loras(state: StateDep) -> LoraService:
    if state.control is None:
        raise DatabaseUnavailable("the control plane is not started yet", retry_after_s=1)
    return state.control.lora


LoraDep = Annotated[LoraService, Depends(_loras)]


class LoraBody(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    path: str
    base_model: str | None = None
    """Optional while this gateway serves one text generation model."""


class VllmLoadBody(BaseModel):
    """vLLM's ``LoadLoRAAdapterRequest`` (its other fields are accepted and ignored)."""

    model_config = ConfigDict(extra="ignore")

    lora_name: str
    lora_path: str
    base_model: str | None = None


class VllmUnloadBody(BaseModel):
    model_config = ConfigDict(extra="ignore")

    lora_name: str


@router.post("/admin/loras")
async def add_lora(body: LoraBody, state: StateDep, loras: LoraDep) -> dict[str, Any]:
    """Answers once a live worker has it loaded; else 400/404/409/503, nothing registered."""
    spec = LoraSpec(name=body.name, path=body.path, base_model=_base(state, body.base_model))
    async with _refreshed_after(state):
        rollout = await loras.register(spec)
    return _added(spec, rollout)


@router.delete("/admin/loras/{name:path}")
async def remove_lora(name: str, state: StateDep, loras: LoraDep) -> dict[str, Any]:
    """Requests already admitted finish; new ones get 404 at once."""
    spec = await loras.unregister(name)
    state.catalog.drop_adapter(name)
    await _refresh(state)
    return {"object": "lora_adapter", "name": spec.name, "deleted": True}


@router.get("/admin/loras")
async def list_loras(loras: LoraDep) -> dict[str, Any]:
    return {"object": "list", "data": [_card(r) for r in await loras.list_registered()]}


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse)
async def vllm_load(body: VllmLoadBody, state: StateDep, loras: LoraDep) -> str:
    spec = LoraSpec(
        name=body.lora_name, path=body.lora_path, base_model=_base(state, body.base_model)
    )
    async with _refreshed_after(state):
        await loras.register(spec)
    return f"Success: LoRA adapter '{spec.name}' added successfully."


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse)
async def vllm_unload(body: VllmUnloadBody, state: StateDep, loras: LoraDep) -> str:
    await loras.unregister(body.lora_name)
    state.catalog.drop_adapter(body.lora_name)
    await _refresh(state)
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."


def _base(state: GatewayState, base_model: str | None) -> str:
    if base_model is not None:
        return base_model
    bases = state.catalog.bases()
    if len(bases) != 1:
        raise InvalidRequest(
            f"this gateway serves {len(bases)} text generation models: name base_model",
            param="base_model",
        )
    return bases[0]


@contextlib.asynccontextmanager
async def _refreshed_after(state: GatewayState) -> AsyncIterator[None]:
    """Refresh the catalog after a registration, also one that failed: while it was
    rolling out, the catalog may have picked up the adapter its rollback withdrew."""
    try:
        yield
    finally:
        await _refresh(state)


async def _refresh(state: GatewayState) -> None:
    """This gateway sees the change now: its catalog, and which workers loaded what."""
    try:
        for cell in state.cells.all():
            await cell.adapters.refresh()
            await cell.directory.refresh()
    except RedisError as exc:  # both catch up on their next poll
        log.warning("refreshing the adapter catalog failed: %s", exc)


def _added(spec: LoraSpec, rollout: Rollout) -> dict[str, Any]:
    return {
        "object": "lora_adapter",
        "name": spec.name,
        "path": spec.path,
        "base_model": spec.base_model,
        "loaded_on": list(rollout.loaded),
        "failed_on": dict(rollout.failed),
        "pending_on": list(rollout.pending),
    }


def _card(registered: Registered) -> dict[str, Any]:
    spec = registered.spec
    return {
        "object": "lora_adapter",
        "name": spec.name,
        "path": spec.path,
        "base_model": spec.base_model,
        "created": int(registered.created_at.astimezone(UTC).timestamp()),
        "workers": registered.workers,
    }
