"""The real gateway app (routes, error funnel, body-size limit) in process, on fakeredis.

The state is built here around a fake Redis and the tiny test tokenizer (no reply
reader, no liveness tasks). With ``workers=True`` an aggregated and an embed worker
are registered, so a valid request is really queued (admission script, protocol
encoding) and then ends at its deadline with a 504: everything before the worker is
exercised. Use the app inside ``with TestClient(app)`` so that registration runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import fakeredis
from fakeredis.aioredis import FakeRedis
from fastapi import FastAPI

from gateway.app import build_app
from gateway.dispatch import AdmissionPolicy, Dispatcher
from gateway.image_fetch import FetchPolicy, ImageFetcher
from gateway.image_inputs import ImageInputs
from gateway.model_catalog import ModelCatalog, ModelKind, ServedModel
from gateway.state import GatewayState
from gateway.translate import UnknownFieldLog
from gateway.worker_directory import WorkerDirectory
from shared.images import ImageLimits
from shared.liveness import WorkerRegistration, WorkerRegistry
from shared.media_store import ImageStore
from shared.reply_stream import ReplyRouter
from shared.roles import Role
from shared.settings import Settings

EMBED_MODEL = "tiny-embed"
CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
USER = [{"role": "user", "content": "hello"}]
BODIES: dict[str, dict[str, Any]] = {
    CHAT: {"model": "tiny", "messages": USER, "max_tokens": 2},
    COMPLETIONS: {"model": "tiny", "prompt": "hello", "max_tokens": 2},
    EMBEDDINGS: {"model": EMBED_MODEL, "input": "hello"},
}


@dataclass
class InProcessGateway:
    app: FastAPI
    server: fakeredis.FakeServer
    settings: Settings

    def queued(self, role: str = "aggregated", model: str = "tiny") -> list[dict[bytes, bytes]]:
        """The fields of every entry of a job stream (decode them with shared.protocol)."""
        client = fakeredis.FakeRedis(server=self.server)
        return [fields for _, fields in client.xrange(f"conveyor:jobs:{model}:{role}")]


def build_gateway(
    generate: ServedModel, *, workers: bool = False, **settings_fields: Any
) -> InProcessGateway:
    settings = Settings(**settings_fields)
    embed = ServedModel(
        name=EMBED_MODEL,
        path=generate.path,
        tokenizer=generate.tokenizer,
        max_model_len=generate.max_model_len,
        created_unix=generate.created_unix,
        kind=ModelKind.EMBED,
    )
    server = fakeredis.FakeServer()
    redis = FakeRedis(server=server)
    router = ReplyRouter(redis, "conveyor:reply:test")
    registry = WorkerRegistry(redis, ttl_s=3600)
    directory = WorkerDirectory(registry)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if workers:  # in the app's own event loop, as fakeredis wants
            await _register(registry, directory, generate)
        yield

    images = ImageInputs(
        ImageFetcher(FetchPolicy(frozenset({"data"}), settings.image_max_bytes, 1.0)),
        ImageStore(redis),
        ImageLimits(settings.image_max_bytes, settings.image_max_pixels),
        max_images=settings.max_images_per_request,
    )
    app = build_app(settings, lifespan)
    app.state.gateway = GatewayState(
        settings=settings,
        gateway_id="gw-test",
        redis=redis,
        catalog=ModelCatalog([generate, embed]),
        directory=directory,
        router=router,
        dispatcher=Dispatcher(redis, router, directory, AdmissionPolicy.from_settings(settings)),
        unknown_fields=UnknownFieldLog(),
        images=images,
    )
    return InProcessGateway(app, server, settings)


async def _register(
    registry: WorkerRegistry, directory: WorkerDirectory, generate: ServedModel
) -> None:
    for role, model in ((Role.AGGREGATED, generate.name), (Role.EMBED, EMBED_MODEL)):
        await registry.beat(
            WorkerRegistration(
                worker_id=f"{role}-test-1-x",
                role=role,
                model=model,
                max_model_len=generate.max_model_len,
                active=0,
                slots=8,
            )
        )
    await directory.refresh()


def error_of(response: Any, status: int = 400) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    error: dict[str, Any] = body["error"]
    return error


def passed_every_check(response: Any) -> None:
    assert response.status_code == 504, response.text  # queued, then the deadline hit
    assert response.json()["error"]["code"] == "deadline_exceeded"
