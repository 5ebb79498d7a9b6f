"""Everything a request handler needs, owned by the app's lifespan."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Annotated

import redis.asyncio as aioredis
from fastapi import Depends, Request

from gateway.catalog.served_models import ModelCatalog
from gateway.control.plane import ControlPlane
from gateway.dispatch.cells import RedisCells
from gateway.images.inputs import ImageInputs
from gateway.metrics import GatewayMetrics
from gateway.openai.unknown_fields import UnknownFieldLog
from gateway.placement.cache_placement import CachePlacement, build_cache_placement
from shared.settings import GatewaySettings
from shared.tracing.spans import Tracer


@dataclass(slots=True)
class GatewayState:
    settings: GatewaySettings
    gateway_id: str
    redis: aioredis.Redis
    """The home Redis (CONVEYOR_REDIS_URL): the control plane, and every model without
    its own Redis. A request's Redis is its model's cell: ``cells.for_model(...)``."""
    catalog: ModelCatalog
    cells: RedisCells
    """One per Redis: reply stream + router, worker directory, dispatcher, images, the
    adapter watch (gateway/dispatch/cells.py)."""
    unknown_fields: UnknownFieldLog
    images: ImageInputs
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    tracer: Tracer = field(default_factory=Tracer)
    """Spans over OTLP when an endpoint is set (gateway/metrics/request_trace.py)."""
    draining: bool = False
    runners: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    """The background responses this gateway renders, by request id
    (gateway/serving/background.py)."""
    control: ControlPlane | None = None
    """SQL-backed parts (API keys, usage ledger); set by the lifespan (:meth:`attach`)."""

    def attach(self, control: ControlPlane) -> None:
        """Serve with ``control``; a key it sees revoked has its open requests ended."""
        self.control = control
        control.keys.on_revoked = self.cells.end_requests_of


async def _state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


StateDep = Annotated[GatewayState, Depends(_state)]


def cache_placement(
    settings: GatewaySettings, redis: aioredis.Redis, metrics: GatewayMetrics
) -> CachePlacement:
    """Cache-aware placement for the workers on ``redis`` (one per cell): its prefix index,
    the feeder task that fills it, and the placer, which counts every decision in
    ``metrics``."""
    return build_cache_placement(settings, redis, on_placed=metrics.placement.observe)
