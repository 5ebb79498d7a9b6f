"""Gateway app factory. The lifespan owns every resource: Redis, the reply reader,
the worker directory, the gateway's liveness key and the control plane (SQL)."""

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

from gateway.adapter_watch import AdapterWatch
from gateway.auth import check_auth_settings
from gateway.body_limit import BodySizeLimit
from gateway.control.plane import ControlPlane
from gateway.dispatch import AdmissionPolicy, Dispatcher
from gateway.error_handlers import install_error_handlers
from gateway.image_fetch import FetchPolicy, ImageFetcher
from gateway.image_inputs import ImageInputs
from gateway.metrics import GatewayMetrics, RequestMetrics
from gateway.model_catalog import ModelCatalog, ModelKind, load_model
from gateway.routes import admin, health, loras, metrics, openai, workers
from gateway.state import GatewayState
from gateway.translate import UnknownFieldLog
from gateway.worker_directory import WorkerDirectory
from shared import keys
from shared.images import ImageLimits
from shared.liveness import WorkerRegistry, keep_gateway_alive
from shared.media_store import ImageStore
from shared.model_source import resolve_model_path
from shared.redis_conn import connect
from shared.reply_stream import ReplyRouter
from shared.settings import GatewaySettings
from shared.tasks import cancel_and_wait

log = logging.getLogger(__name__)


def create_app(settings: GatewaySettings) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        check_auth_settings(settings)
        state = build_state(
            settings, connect(settings.redis_url), _load_catalog(settings), _new_gateway_id()
        )
        app.state.gateway = state
        control = state.control = ControlPlane(
            settings, state.redis, state.gateway_id, bases=state.catalog.bases
        )
        await control.start()
        state.adapters.republish = control.lora.publish
        tasks = [
            asyncio.create_task(state.router.run(), name="reply-router"),
            asyncio.create_task(state.directory.run(), name="worker-directory"),
            asyncio.create_task(
                keep_gateway_alive(state.redis, state.gateway_id, settings.gateway_liveness_ttl_s),
                name="gateway-liveness",
            ),
            asyncio.create_task(state.dispatcher.drain.run(), name="drain-meter"),
            asyncio.create_task(state.dispatcher.accounting.renew_leases(), name="limit-leases"),
            asyncio.create_task(state.adapters.run(), name="adapter-watch"),
        ]
        log.info("gateway %s serving %s", state.gateway_id, [m.name for m in state.catalog.all()])
        try:
            yield
        finally:
            state.draining = True
            await state.dispatcher.wait_background()
            await cancel_and_wait(tasks)
            await control.stop()
            with contextlib.suppress(RedisError):
                await state.redis.delete(
                    keys.gateway_heartbeat(state.gateway_id), state.router.stream
                )
            await state.images.aclose()
            await state.redis.aclose()

    return build_app(settings, lifespan)


def build_app(
    settings: GatewaySettings,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None,
) -> FastAPI:
    """Routes, error funnel and body-size limit; ``app.state.gateway`` comes from
    ``lifespan`` (tests set it themselves)."""
    app = FastAPI(title="Conveyor", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_body_bytes)
    app.add_middleware(RequestMetrics)
    app.include_router(openai.router)
    app.include_router(health.router)
    app.include_router(metrics.router)
    app.include_router(admin.router)
    app.include_router(loras.router)
    app.include_router(workers.router)
    return app


def _new_gateway_id() -> str:
    return f"gw-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def _load_catalog(settings: GatewaySettings) -> ModelCatalog:
    catalog = ModelCatalog.load(
        settings.served_name(),
        resolve_model_path(settings),
        settings.max_model_len,
        (settings.tool_call_parser, settings.reasoning_parser),
    )
    embed_path, embed_name = settings.embed_model_path(), settings.embed_served_name()
    if embed_path is not None and embed_name is not None:
        catalog.add(load_model(embed_name, embed_path, None, ModelKind.EMBED))
    return catalog


def build_state(
    settings: GatewaySettings, redis: aioredis.Redis, catalog: ModelCatalog, gateway_id: str
) -> GatewayState:
    """Everything a request handler needs, wired from ``settings`` (tests pass a fake Redis
    and their own catalog); the lifespan starts its background tasks."""
    router = ReplyRouter(redis, keys.reply_stream(gateway_id))
    directory = WorkerDirectory(WorkerRegistry(redis, ttl_s=settings.heartbeat_ttl_s))
    metrics = GatewayMetrics()
    dispatcher = Dispatcher(
        redis,
        router,
        directory,
        AdmissionPolicy.from_settings(settings),
        on_usage=metrics.observe_usage,
    )
    return GatewayState(
        metrics=metrics,
        settings=settings,
        gateway_id=gateway_id,
        redis=redis,
        catalog=catalog,
        directory=directory,
        router=router,
        dispatcher=dispatcher,
        unknown_fields=UnknownFieldLog(),
        images=_image_inputs(settings, redis),
        adapters=AdapterWatch(redis, catalog),
    )


def _image_inputs(settings: GatewaySettings, redis: aioredis.Redis) -> ImageInputs:
    return ImageInputs(
        ImageFetcher(FetchPolicy.from_settings(settings)),
        ImageStore(redis),
        ImageLimits.from_settings(settings),
        max_images=settings.max_images_per_request,
    )
