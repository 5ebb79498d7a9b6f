"""Auth on /v1/*: the real gateway in process (fake workers, fakeredis) with the control
plane on SQLite and PostgreSQL. Nothing is queued for a refused request."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from gateway.catalog.served_models import ServedModel
from gateway.control.key_service import KeySpec
from gateway.control.plane import ControlPlane
from gateway.control.records import Scope
from gateway.db.engine import Database
from tests.gateway.asgi_call import SlowBodyCall
from tests.gateway.harness import (
    BODIES,
    CHAT,
    COMPLETIONS,
    USER,
    LiveGateway,
    error_of,
    live_gateway,
)
from tests.gateway.test_disconnects import endless
from tests.support.sql import SqlTarget

ADMIN_KEY = "admin-key-for-inference-tests-0123456789"


@pytest.fixture
async def gateway(
    served_model: ServedModel, sql_target: SqlTarget, database: Database
) -> AsyncIterator[LiveGateway]:
    async with live_gateway(served_model, database_url=sql_target.url, admin_key=ADMIN_KEY) as live:
        plane = ControlPlane(live.state.settings, live.redis, "gw-test")
        await plane.start()
        live.state.attach(plane)
        try:
            yield live
        finally:
            await plane.stop()


async def new_key(live: LiveGateway, scopes: set[Scope], models: set[str] | None = None) -> str:
    assert live.state.control is not None
    created = await live.state.control.key_service.create(
        KeySpec("t", frozenset(scopes), frozenset(models) if models is not None else None)
    )
    await live.state.control.keys.reload()
    return created.secret


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def queued(live: LiveGateway) -> int:
    return int(await live.redis.xlen("conveyor:jobs:tiny:aggregated"))


async def test_v1_needs_a_key(gateway: LiveGateway) -> None:
    for headers in ({}, {"Authorization": "Bearer cvy-not-a-key"}, {"Authorization": "Basic x"}):
        response = await gateway.client.post(CHAT, json=BODIES[CHAT], headers=headers)
        assert error_of(response, 401)["code"] == "invalid_api_key"
    assert error_of(await gateway.client.get("/v1/models"), 401)["code"] == "invalid_api_key"
    assert await queued(gateway) == 0


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer cvy-not-a-key"}])
async def test_a_keyless_request_is_refused_before_its_body_is_read(
    gateway: LiveGateway, headers: dict[str, str]
) -> None:
    async with SlowBodyCall(gateway.app, CHAT, BODIES[CHAT], headers) as call:
        assert await call.start() == 401
        body = json.loads(await call.read_all())
    assert body["error"]["code"] == "invalid_api_key"
    assert call.receive_calls == 0


@pytest.mark.parametrize("path", ["/docs", "/openapi.json", "/no/such/path"])
async def test_only_health_and_ready_answer_without_a_key(gateway: LiveGateway, path: str) -> None:
    assert error_of(await gateway.client.get(path), 401)["code"] == "invalid_api_key"
    assert (await gateway.client.get("/health")).status_code == 200


async def test_inference_key_answers_and_admin_key_too(gateway: LiveGateway) -> None:
    secret = await new_key(gateway, {Scope.INFERENCE})
    for key in (secret, ADMIN_KEY):
        response = await gateway.client.post(
            COMPLETIONS, json=BODIES[COMPLETIONS], headers=bearer(key)
        )
        assert response.status_code == 200, response.text


async def test_a_model_card_shows_the_server_path_to_an_admin_key_only(
    gateway: LiveGateway,
) -> None:
    secret = await new_key(gateway, {Scope.INFERENCE})
    card = (await gateway.client.get("/v1/models/tiny", headers=bearer(secret))).json()
    assert card["root"] == "tiny"
    listed = (await gateway.client.get("/v1/models", headers=bearer(secret))).json()["data"]
    assert {c["root"] for c in listed} == {c["id"] for c in listed}
    card = (await gateway.client.get("/v1/models/tiny", headers=bearer(ADMIN_KEY))).json()
    assert card["root"] == gateway.state.catalog.get("tiny").path


async def test_inference_key_may_not_call_admin(gateway: LiveGateway) -> None:
    secret = await new_key(gateway, {Scope.INFERENCE})
    response = await gateway.client.get("/admin/state", headers=bearer(secret))
    assert response.status_code == 403


async def test_metrics_only_key_may_not_infer(gateway: LiveGateway) -> None:
    secret = await new_key(gateway, {Scope.METRICS})
    response = await gateway.client.post(CHAT, json=BODIES[CHAT], headers=bearer(secret))
    assert response.status_code == 403
    assert await queued(gateway) == 0


async def test_a_model_the_key_may_not_use_does_not_exist(gateway: LiveGateway) -> None:
    secret = await new_key(gateway, {Scope.INFERENCE}, models={"tiny-embed"})
    response = await gateway.client.post(CHAT, json=BODIES[CHAT], headers=bearer(secret))
    error = error_of(response, 404)
    assert error["code"] == "model_not_found"
    assert "tiny`" in error["message"] and "tiny-embed" in error["message"]
    listed: Any = (await gateway.client.get("/v1/models", headers=bearer(secret))).json()
    assert [card["id"] for card in listed["data"]] == ["tiny-embed"]
    assert (await gateway.client.get("/v1/models/tiny", headers=bearer(secret))).status_code == 404
    assert await queued(gateway) == 0


async def test_a_revoked_key_stops_at_once(gateway: LiveGateway) -> None:
    secret = await new_key(gateway, {Scope.INFERENCE})
    assert gateway.state.control is not None
    key_id = gateway.state.control.keys.resolve(secret).key_id  # type: ignore[union-attr]
    assert key_id is not None
    await gateway.state.control.key_service.revoke(key_id)
    await gateway.state.control.keys.reload()
    response = await gateway.client.post(CHAT, json=BODIES[CHAT], headers=bearer(secret))
    assert error_of(response, 401)["code"] == "invalid_api_key"


VLLM_ROUTES: list[tuple[str, str, dict[str, Any] | None]] = [
    ("POST", "/tokenize", {"model": "tiny", "prompt": "hi"}),
    ("POST", "/detokenize", {"model": "tiny", "tokens": [5]}),
    ("GET", "/tokenizer_info", None),
    ("GET", "/load", None),
    ("GET", "/is_sleeping", None),
    ("POST", "/invocations", BODIES[COMPLETIONS]),
    ("POST", "/v1/chat/completions/batch", {**BODIES[CHAT], "messages": [USER, USER]}),
]


async def test_vllm_routes_need_an_inference_key(gateway: LiveGateway) -> None:
    secret = await new_key(gateway, {Scope.INFERENCE})
    for method, path, body in VLLM_ROUTES:
        refused = await gateway.client.request(method, path, json=body)
        assert error_of(refused, 401)["code"] == "invalid_api_key", path
        answered = await gateway.client.request(method, path, json=body, headers=bearer(secret))
        assert answered.status_code == 200, (path, answered.text)
    for path in ("/ping", "/version"):  # public, as /health (and vLLM's /version)
        assert (await gateway.client.get(path)).status_code == 200


async def test_revoking_a_key_ends_its_open_streams(gateway: LiveGateway) -> None:
    secret = await new_key(gateway, {Scope.INFERENCE})
    other = await new_key(gateway, {Scope.INFERENCE})
    gateway.workers[0].script = endless
    assert gateway.state.control is not None
    body = {**BODIES[CHAT], "max_tokens": 30, "stream": True}
    async with (
        gateway.call(CHAT, body, **bearer(secret)) as revoked,
        gateway.call(CHAT, body, **bearer(other)) as kept,
    ):
        assert await revoked.start() == 200 and await kept.start() == 200
        await revoked.read_until("t2 ")
        await kept.read_until("t2 ")
        key_id = gateway.state.control.keys.resolve(secret).key_id  # type: ignore[union-attr]
        assert key_id is not None
        await gateway.state.control.key_service.revoke(key_id)
        await gateway.state.control.keys.reload()
        text = await asyncio.wait_for(revoked.read_all(), 5)
        last = [line for line in text.splitlines() if line.startswith("data: {")][-1]
        assert json.loads(last[6:])["error"]["code"] == "invalid_api_key"
        assert "revoked" in json.loads(last[6:])["error"]["message"]
        await revoked.finished()
        assert gateway.state.cells.open_requests() == 1  # the other key's stream runs on
        await kept.read_until("t5 ")
