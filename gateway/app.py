"""Gateway app factory. The lifespan owns every resource: the Redis cells (per Redis: the
reply reader, the worker directory, the gateway's liveness key, ...) and the control
plane (SQL)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

import redis.asyncio as aioredis
from fastapi import FastAPI
from redis.exceptions import RedisError
from starlette.types import Receive, Scope, Send

from gateway.auth import check_auth_settings
from gateway.body_limit import BodySizeLimit
from gateway.catalog.served_models import ModelCatalog, ModelKind, load_model
from gateway.control.plane import ControlPlane
from gateway.dispatch.cells import build_cells
from gateway.edge_guard import EdgeGuard
from gateway.error_handlers import install_error_handlers
from gateway.images.fetch import FetchPolicy, ImageFetcher
from gateway.images.inputs import ImageInputs
from gateway.metrics import GatewayMetrics, RequestMetrics
from gateway.metrics.request_trace import RequestTracing
from gateway.openai.unknown_fields import UnknownFieldLog
from gateway.placement.cache_placement import CachePlacement
from gateway.placement.placer import Placer
from gateway.routes import admin, health, loras, metrics, openai, requests, vllm, workers
from gateway.serving import background
from gateway.serving.delivery import RAW_SEND
from gateway.state import GatewayState, cache_placement
from shared.connections.connect import connect
from shared.connections.model_redis import ModelRedis, check_served
from shared.connections.url import shown_url
from shared.heap import freeze_startup_heap
from shared.images import ImageLimits
from shared.queue import names
from shared.queue.media_store import ImageStore
from shared.settings import GatewaySettings
from shared.tasks import cancel_and_wait
from shared.tracing.tracer import build_tracer

log = logging.getLogger(__name__)


def create_app(settings: GatewaySettings) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        check_auth_settings(settings)
        catalog = _load_catalog(settings)
        model_redis = _model_redis(settings, catalog)
        state = build_state(
            settings, model_redis.home, catalog, _new_gateway_id(), model_redis=model_redis
        )
        app.state.gateway = state
        control = ControlPlane(
            settings,
            state.redis,
            state.gateway_id,
            bases=state.catalog.bases,
            cells=[cell.redis for cell in state.cells.others()],
            redis_for=model_redis.for_model,
        )
        state.attach(control)
        await control.start()
        tasks = [asyncio.create_task(background.takeover_loop(state), name="background-takeover")]
        for cell in state.cells.all():
            cell.adapters.republish = control.lora.publish
            tasks += cell.tasks(state.gateway_id, settings.gateway_liveness_ttl_s)
        log.info("gateway %s serving %s", state.gateway_id, [m.name for m in state.catalog.all()])
        freeze_startup_heap()
        try:
            yield
        finally:
            state.draining = True
            await cancel_and_wait([*tasks, *state.runners.values()])  # others take them over
            await state.cells.wait_background()
            await control.stop()
            for cell in state.cells.all():
                with contextlib.suppress(RedisError):
                    await cell.redis.delete(
                        names.gateway_heartbeat(state.gateway_id), cell.router.stream
                    )
            await state.images.aclose()
            await model_redis.aclose()
            state.tracer.shutdown()

    return build_app(settings, lifespan)


class GatewayApp(FastAPI):
    """The app; its outermost layer leaves the server's ``send`` in the scope, where an SSE
    response sends its body past the middleware (:class:`EventStreamResponse`)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[RAW_SEND] = send
        await super().__call__(scope, receive, send)


def build_app(
    settings: GatewaySettings,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None,
) -> FastAPI:
    """Routes, error funnel, the Host and key checks and the body-size limit (outermost last);
    ``app.state.gateway`` comes from ``lifespan`` (tests set it themselves)."""
    app = GatewayApp(title="Conveyor", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(
        BodySizeLimit,
        max_bytes=settings.max_request_body_bytes,
        read_timeout_s=settings.request_body_timeout_s,
    )
    app.add_middleware(EdgeGuard)
    app.add_middleware(RequestMetrics)
    app.add_middleware(RequestTracing)
    app.include_router(openai.router)
    app.include_router(vllm.router)
    app.include_router(health.router)
    app.include_router(metrics.router)
    app.include_router(admin.router)
    app.include_router(loras.router)
    app.include_router(workers.router)
    app.include_router(requests.router)
    return app


def _new_gateway_id() -> str:
    return f"gw-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def _model_path(settings: GatewaySettings) -> str:
    if settings.model is None:
        raise ValueError("no model: set --model (`conveyor gateway` serves the demo model then)")
    return settings.model


def _load_catalog(settings: GatewaySettings) -> ModelCatalog:
    catalog = ModelCatalog.load(
        settings.served_name(),
        _model_path(settings),
        settings.max_model_len,
        (settings.tool_call_parser, settings.reasoning_parser),
    )
    embed_path, embed_name = settings.embed_model_path(), settings.embed_served_name()
    if embed_path is not None and embed_name is not None:
        catalog.add(load_model(embed_name, embed_path, None, ModelKind.EMBED))
    return catalog


def _model_redis(settings: GatewaySettings, catalog: ModelCatalog) -> ModelRedis:
    """The Redis clients: home, plus one per distinct CONVEYOR_MODEL_REDIS_URLS URL."""
    urls = settings.model_redis_map()
    check_served(urls, {model.name for model in catalog.all()})
    for model, url in sorted(urls.items()):
        log.info("model %s lives on its own Redis %s", model, shown_url(url))
    return ModelRedis(settings.redis_url, urls, connect)


def build_state(
    settings: GatewaySettings,
    redis: aioredis.Redis,
    catalog: ModelCatalog,
    gateway_id: str,
    *,
    model_redis: ModelRedis | None = None,
) -> GatewayState:
    """Everything a request handler needs, wired from ``settings`` (tests pass a fake Redis
    and their own catalog; ``model_redis``: the Redis of each model, default ``redis``
    for all); the lifespan starts the cells' background tasks."""
    if model_redis is None:
        model_redis = ModelRedis(settings.redis_url, {}, connect, home=redis)
    metrics = GatewayMetrics(max((m.max_model_len for m in catalog.all()), default=2048))
    metrics.vllm.start_series(m.name for m in catalog.all())
    placements: dict[int, CachePlacement] = {}

    def placer_for(cell_redis: aioredis.Redis) -> Placer | None:
        if not settings.placement:
            return None
        placement = cache_placement(settings, cell_redis, metrics)
        placements[id(cell_redis)] = placement
        return placement.placer

    cells = build_cells(
        settings,
        model_redis,
        catalog,
        gateway_id,
        metrics.observe_usage,
        placer_for,
        on_refused=metrics.observe_refusal,
    )
    for cell in cells.all():
        cell.placement = placements.get(id(cell.redis))
    return GatewayState(
        metrics=metrics,
        settings=settings,
        gateway_id=gateway_id,
        redis=redis,
        catalog=catalog,
        cells=cells,
        unknown_fields=UnknownFieldLog(),
        images=_image_inputs(settings, cells.home.images),
        tracer=build_tracer(
            settings.otlp_endpoint, settings.trace_sample_ratio, "conveyor-gateway", gateway_id
        ),
    )


def _image_inputs(settings: GatewaySettings, store: ImageStore) -> ImageInputs:
    return ImageInputs(
        ImageFetcher(FetchPolicy.from_settings(settings)),
        store,
        ImageLimits.from_settings(settings),
        max_images=settings.max_images_per_request,
        max_request_bytes=settings.image_max_request_bytes,
        store_ttl_s=settings.image_store_ttl_s,
    )
