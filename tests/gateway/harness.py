"""The real gateway app (routes, serving steps, dispatcher, error funnel, body-size limit)
in process, on fakeredis, with the tiny test tokenizer.

The state is wired by the production code (:func:`gateway.app.build_state`) around a
fake Redis and a catalog of two models: ``tiny`` (chat and completions) and
``tiny-embed`` (embeddings). Nothing here starts a database, a liveness key or a
worker-directory poll.

Two ways in:

- :func:`build_gateway` for synchronous ``TestClient`` tests: with ``workers=True`` an
  aggregated and an embed worker are registered (no one answers), so a valid request
  is really queued (admission script, protocol encoding) and ends at its deadline with
  a 504: everything before the worker is exercised.
- :func:`live_gateway` for async tests: the reply router runs, fake workers
  (tests/gateway/fake_worker.py) read the job streams and answer on the reply stream,
  and requests go through ``httpx.ASGITransport`` or, to see a stream as it is sent
  and to leave mid-stream, through :class:`tests.gateway.asgi_call.AsgiCall`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import fakeredis
import httpx
import redis.asyncio as aioredis
from fakeredis.aioredis import FakeRedis
from fastapi import FastAPI

from gateway.app import build_app, build_state
from gateway.catalog.served_models import ModelCatalog, ModelKind, ServedModel
from gateway.state import GatewayState
from shared.connections.model_redis import ModelRedis
from shared.queue.liveness import WorkerRegistration, WorkerRegistry
from shared.roles import Role
from shared.settings import GatewaySettings
from shared.tasks import cancel_and_wait
from tests.gateway.asgi_call import AsgiCall
from tests.gateway.fake_worker import FakeWorker, Script, echo

EMBED_MODEL = "tiny-embed"
CHAT, COMPLETIONS, EMBEDDINGS = "/v1/chat/completions", "/v1/completions", "/v1/embeddings"
USER = [{"role": "user", "content": "hello"}]
BODIES: dict[str, dict[str, Any]] = {
    CHAT: {"model": "tiny", "messages": USER, "max_tokens": 2},
    COMPLETIONS: {"model": "tiny", "prompt": "hello", "max_tokens": 2},
    EMBEDDINGS: {"model": EMBED_MODEL, "input": "hello"},
}
TEST_SETTINGS: dict[str, Any] = {
    "image_url_schemes": "data",  # no test fetches over the network
    "image_fetch_timeout_s": 1.0,
    "heartbeat_ttl_s": 3600.0,  # registrations last the whole test
    "allowed_hosts": "gw,testserver",  # the test clients' Host names (auth is off)
}


def gateway_settings(**fields: Any) -> GatewaySettings:
    return GatewaySettings(**{**TEST_SETTINGS, **fields})


def embed_model_like(generate: ServedModel) -> ServedModel:
    return ServedModel(
        name=EMBED_MODEL,
        path=generate.path,
        tokenizer=generate.tokenizer,
        max_model_len=generate.max_model_len,
        created_unix=generate.created_unix,
        kind=ModelKind.EMBED,
    )


def gateway_state(
    generate: ServedModel,
    settings: GatewaySettings,
    redis: FakeRedis,
    more_models: Sequence[ServedModel] = (),
    model_redis: ModelRedis | None = None,
) -> GatewayState:
    catalog = ModelCatalog([generate, embed_model_like(generate), *more_models])
    return build_state(settings, redis, catalog, "gw-test", model_redis=model_redis)


async def register(state: GatewayState, role: Role, model: str, *, slots: int = 8) -> None:
    """A live worker of ``role`` for ``model`` in the registry of the model's Redis, seen
    by that cell's directory now."""
    cell = state.cells.for_model(model)
    registry = WorkerRegistry(cell.redis, ttl_s=state.settings.heartbeat_ttl_s)
    await registry.beat(
        WorkerRegistration(
            worker_id=f"{role}-test-{model}-x",
            role=role,
            model=model,
            max_model_len=2048,
            active=0,
            slots=slots,
        )
    )
    await cell.directory.refresh()


# ------------------------------------------------------------------ synchronous tests


@dataclass
class InProcessGateway:
    app: FastAPI
    server: fakeredis.FakeServer
    settings: GatewaySettings
    state: GatewayState

    def queued(self, role: str = "aggregated", model: str = "tiny") -> list[dict[bytes, bytes]]:
        """The fields of every entry of a job stream (decode them with shared.protocol)."""
        client = fakeredis.FakeRedis(server=self.server)
        entries: Any = client.xrange(f"conveyor:jobs:{model}:{role}")
        return [fields for _, fields in entries]


def build_gateway(
    generate: ServedModel,
    *,
    workers: bool = False,
    more_models: Sequence[ServedModel] = (),
    **settings_fields: Any,
) -> InProcessGateway:
    """Use the app inside ``with TestClient(app)`` so that registration runs; with
    ``workers``, each of ``more_models`` gets an aggregated worker too."""
    settings = gateway_settings(**settings_fields)
    server = fakeredis.FakeServer()
    state = gateway_state(generate, settings, FakeRedis(server=server), more_models)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if workers:  # in the app's own event loop, as fakeredis wants
            await register(state, Role.AGGREGATED, generate.name)
            await register(state, Role.EMBED, EMBED_MODEL)
            for model in more_models:
                await register(state, Role.AGGREGATED, model.name)
        yield

    app = build_app(settings, lifespan)
    app.state.gateway = state
    return InProcessGateway(app, server, settings, state)


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


# ------------------------------------------------------------------------ async tests


@dataclass
class LiveGateway:
    """A gateway whose reply router runs, in the test's own event loop."""

    app: FastAPI
    state: GatewayState
    client: httpx.AsyncClient
    workers: list[FakeWorker] = field(default_factory=list)

    @property
    def redis(self) -> aioredis.Redis:
        return self.state.redis

    def call(self, path: str, body: dict[str, Any], **headers: str) -> AsgiCall:
        """A POST driven straight through the ASGI app (``async with`` it)."""
        return AsgiCall(self.app, path, body, headers)

    async def add_worker(
        self, role: Role = Role.AGGREGATED, model: str = "tiny", script: Script = echo
    ) -> FakeWorker:
        worker = FakeWorker(self.state.cells.for_model(model).redis, model, role, script)
        await worker.start()
        self.workers.append(worker)
        await register(self.state, role, model)
        return worker

    async def open_requests(self) -> int:
        response = await self.client.get("/admin/state")
        count: int = response.json()["open_requests"]
        return count


@contextlib.asynccontextmanager
async def live_gateway(
    generate: ServedModel,
    *,
    workers: Sequence[tuple[Role, str]] = ((Role.AGGREGATED, "tiny"), (Role.EMBED, EMBED_MODEL)),
    more_models: Sequence[ServedModel] = (),
    model_redis: ModelRedis | None = None,
    **settings_fields: Any,
) -> AsyncIterator[LiveGateway]:
    """The gateway with a fake worker (echo script) per ``(role, model)`` of ``workers``;
    ``more_models`` join the catalog; ``model_redis``: several (fake) Redis, one cell each
    (default: one fake Redis)."""
    settings = gateway_settings(**settings_fields)
    home = model_redis.home if model_redis is not None else FakeRedis()
    state = gateway_state(generate, settings, home, more_models, model_redis)
    app = build_app(settings, None)
    app.state.gateway = state
    routers = [
        asyncio.create_task(cell.router.run(), name=f"reply-router[{cell.name}]")
        for cell in state.cells.all()
    ]
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://gw") as client:
        gateway = LiveGateway(app, state, client)
        try:
            for role, model in workers:
                await gateway.add_worker(role, model)
            yield gateway
        finally:
            await cancel_and_wait([*routers, *(w.task for w in gateway.workers if w.task)])
            for worker in gateway.workers:  # one that died with its Redis: seen, not logged at GC
                if worker.task is not None and not worker.task.cancelled():
                    worker.task.exception()
            await state.cells.wait_background()
            await state.images.aclose()
            for cell in state.cells.all():
                await cell.redis.aclose()
