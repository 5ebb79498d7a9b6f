"""Everything a request handler needs, owned by the app's lifespan."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

import redis.asyncio as aioredis
from fastapi import Depends, Request

from gateway.adapter_watch import AdapterWatch
from gateway.control.plane import ControlPlane
from gateway.dispatch import Dispatcher
from gateway.image_inputs import ImageInputs
from gateway.metrics import GatewayMetrics
from gateway.model_catalog import ModelCatalog
from gateway.translate import UnknownFieldLog
from gateway.worker_directory import WorkerDirectory
from shared.reply_stream import ReplyRouter
from shared.settings import GatewaySettings


@dataclass(slots=True)
class GatewayState:
    settings: GatewaySettings
    gateway_id: str
    redis: aioredis.Redis
    catalog: ModelCatalog
    directory: WorkerDirectory
    router: ReplyRouter
    dispatcher: Dispatcher
    unknown_fields: UnknownFieldLog
    images: ImageInputs
    adapters: AdapterWatch
    """Keeps ``catalog``'s LoRA adapters equal to the published desired state."""
    metrics: GatewayMetrics = field(default_factory=GatewayMetrics)
    draining: bool = False
    control: ControlPlane | None = None
    """SQL-backed parts (API keys, usage ledger); set by the lifespan once started."""


def _state(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


StateDep = Annotated[GatewayState, Depends(_state)]
