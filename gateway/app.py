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

from gateway.auth import check_auth_settings
from gateway.body_limit import BodySizeLimit
from gateway.control.plane import ControlPlane
from gateway.dispatch import AdmissionPolicy, Dispatcher
from gateway.error_handlers import install_error_handlers
from gateway.image_fetch import FetchPolicy, ImageFetcher, allowed_schemes
from gateway.image_inputs import ImageInputs
from gateway.model_catalog import ModelCatalog, ModelKind, load_model
from gateway.routes import admin, health, openai
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
from shared.settings import Settings
from shared.tasks import cancel_and_wait

log = logging.getLogger(__name__)


def create_app(settings: Settings) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        check_auth_settings(settings)
        state = _build_state(settings)
        app.state.gateway = state
        control = state.control = ControlPlane(settings, state.redis, state.gateway_id)
        await control.start()
        tasks = [
            asyncio.create_task(state.router.run(), name="reply-router"),
            asyncio.create_task(state.directory.run(), name="worker-directory"),
            asyncio.create_task(
                keep_gateway_alive(
                    state.redis, state.gateway_id, settings.gateway_liveness_ttl_s
                ),
                name="gateway-liveness",
            ),
            asyncio.create_task(state.dispatcher.drain.run(), name="drain-meter"),
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
    settings: Settings, lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None
) -> FastAPI:
    """Routes, error funnel and body-size limit; ``app.state.gateway`` comes from
    ``lifespan`` (tests set it themselves)."""
    app = FastAPI(title="Conveyor", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_body_bytes)
    app.include_router(openai.router)
    app.include_router(health.router)
    app.include_router(admin.router)
    return app


def _build_state(settings: Settings) -> GatewayState:
    gateway_id = f"gw-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    redis = connect(settings.redis_url)
    catalog = ModelCatalog.load(
        settings.served_name(), resolve_model_path(settings), settings.max_model_len
    )
    embed_path, embed_name = settings.embed_model_path(), settings.embed_served_name()
    if embed_path is not None and embed_name is not None:
        catalog.add(load_model(embed_name, embed_path, None, ModelKind.EMBED))
    router = ReplyRouter(redis, keys.reply_stream(gateway_id))
    directory = WorkerDirectory(WorkerRegistry(redis, ttl_s=settings.heartbeat_ttl_s))
    dispatcher = Dispatcher(
        redis,
        router,
        directory,
        AdmissionPolicy.from_settings(settings),
    )
    return GatewayState(
        settings=settings,
        gateway_id=gateway_id,
        redis=redis,
        catalog=catalog,
        directory=directory,
        router=router,
        dispatcher=dispatcher,
        unknown_fields=UnknownFieldLog(),
        images=_image_inputs(settings, redis),
    )


def _image_inputs(settings: Settings, redis: aioredis.Redis) -> ImageInputs:
    policy = FetchPolicy(
        schemes=allowed_schemes(settings.image_url_schemes),
        max_bytes=settings.image_max_bytes,
        timeout_s=settings.image_fetch_timeout_s,
        private_networks=FetchPolicy.parse_networks(settings.image_private_networks),
    )
    return ImageInputs(
        ImageFetcher(policy),
        ImageStore(redis),
        ImageLimits(settings.image_max_bytes, settings.image_max_pixels),
        max_images=settings.max_images_per_request,
    )
