"""Every refusal a valid-looking request can meet, with its status, shape and headers, and
the order of the checks: nothing expensive (an image download) before a cheap refusal."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from PIL import Image
from redis.exceptions import ConnectionError as RedisConnectionError

from gateway.catalog.served_models import ServedModel
from gateway.images.fetch import ImageFetcher
from shared.queue.job_queue import JobQueue
from shared.roles import Role
from tests.gateway.harness import (
    BODIES,
    CHAT,
    EMBED_MODEL,
    EMBEDDINGS,
    LiveGateway,
    error_of,
    live_gateway,
    register,
)
from tests.support.tiny_model import build_vision_model
from tests.waiting import eventually

AGGREGATED = "conveyor:jobs:tiny:aggregated"


# ----------------------------------------------------------------- 429, 503, 409


async def test_a_full_queue_is_a_429_with_retry_after(served_model: ServedModel) -> None:
    async with live_gateway(served_model, workers=(), queue_max_depth=2) as gateway:
        await register(gateway.state, Role.AGGREGATED, "tiny")  # registered, never reads
        first = asyncio.create_task(
            gateway.client.post(
                CHAT, json={**BODIES[CHAT], "n": 2}, headers={"X-Request-Timeout": "0.5"}
            )
        )

        async def queued() -> bool:
            return bool(await gateway.redis.xlen(AGGREGATED) == 2)

        await eventually(queued, what="the first request's two jobs queued")
        response = await gateway.client.post(CHAT, json=BODIES[CHAT])
        error = error_of(response, 429)
        assert (error["type"], error["code"]) == ("rate_limit_exceeded", "queue_full")
        assert response.headers["Retry-After"] == "5"  # no drain rate measured yet
        assert await gateway.redis.xlen(AGGREGATED) == 2  # nothing of it was queued
        assert (await first).status_code == 504


@pytest.mark.parametrize("path", [CHAT, EMBEDDINGS])
async def test_no_live_worker_is_a_503_with_retry_after(
    served_model: ServedModel, path: str
) -> None:
    async with live_gateway(served_model, workers=()) as gateway:
        response = await gateway.client.post(path, json=BODIES[path])
        assert error_of(response, 503)["code"] == "no_live_worker"
        assert response.headers["Retry-After"] == "5"
        assert await gateway.open_requests() == 0


async def test_a_draining_gateway_is_a_503(gateway: LiveGateway) -> None:
    gateway.state.draining = True
    response = await gateway.client.post(CHAT, json=BODIES[CHAT])
    assert error_of(response, 503)["code"] == "shutting_down"
    assert response.headers["Retry-After"] == "1"


async def test_an_unreachable_queue_is_a_503_after_the_retry_window(
    served_model: ServedModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def refused(*_: Any, **__: Any) -> Any:
        raise RedisConnectionError("Error 111 connecting to redis-internal.corp:6379.")

    async with live_gateway(served_model, admission_retry_s=0.2) as gateway:
        monkeypatch.setattr(JobQueue, "submit", refused)
        response = await gateway.client.post(CHAT, json=BODIES[CHAT])
        error = error_of(response, 503)
        assert error["code"] == "backend_unavailable"
        assert "unreachable" in error["message"]
        assert "redis-internal.corp" not in response.text  # the address is logged only
        assert await gateway.open_requests() == 0


async def test_the_same_idempotency_key_is_a_409_and_queued_once(gateway: LiveGateway) -> None:
    headers = {"Idempotency-Key": "order-42"}
    first = await gateway.client.post(CHAT, json=BODIES[CHAT], headers=headers)
    assert first.status_code == 200
    again = await gateway.client.post(CHAT, json=BODIES[CHAT], headers=headers)
    error = error_of(again, 409)
    assert (error["param"], error["code"]) == ("Idempotency-Key", "idempotency_key_in_use")
    assert first.json()["id"] in error["message"]
    assert len(gateway.workers[0].jobs) == 1
    other = await gateway.client.post(CHAT, json=BODIES[CHAT], headers={"Idempotency-Key": "b"})
    assert other.status_code == 200


# ----------------------------------------------------------------------------- 4xx


@pytest.mark.parametrize(
    ("path", "body", "status", "code", "param"),
    [
        (CHAT, {**BODIES[CHAT], "model": "nope"}, 404, "model_not_found", "model"),
        (CHAT, {**BODIES[CHAT], "model": EMBED_MODEL}, 400, "model_not_supported", "model"),
        (EMBEDDINGS, {**BODIES[EMBEDDINGS], "model": "tiny"}, 400, "model_not_supported", "model"),
        (CHAT, {**BODIES[CHAT], "max_tokens": 10_000}, 400, "context_length_exceeded",
         "max_tokens"),
        (CHAT, {**BODIES[CHAT], "temperature": 3}, 400, "invalid_value", "temperature"),
        (CHAT, {**BODIES[CHAT], "tools": [{"type": "function"}]}, 400, "invalid_value",
         "tools[0].function"),
        (CHAT, {**BODIES[CHAT], "tools": [{"type": "function", "function": {"name": "f"}}]},
         400, "unsupported_parameter", "tool_choice"),
    ],
)  # fmt: skip
async def test_client_errors_name_what_to_fix_and_queue_nothing(
    gateway: LiveGateway, path: str, body: dict[str, Any], status: int, code: str, param: str
) -> None:
    error = error_of(await gateway.client.post(path, json=body), status)
    assert (error["code"], error["param"]) == (code, param)
    assert all(not worker.jobs for worker in gateway.workers)


# -------------------------------------------------------------------------- images


def png_data_url() -> str:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), "red").save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def image_chat(text: str, url: str, **fields: Any) -> dict[str, Any]:
    parts = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]
    return {"model": "tiny-vl", "messages": [{"role": "user", "content": parts}], **fields}


@pytest.fixture
def fetched(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every image URL the gateway fetches."""
    urls: list[str] = []
    fetch = ImageFetcher.fetch

    async def spy(self: ImageFetcher, url: str) -> bytes:
        urls.append(url)
        return await fetch(self, url)

    monkeypatch.setattr(ImageFetcher, "fetch", spy)
    return urls


@pytest.fixture
async def vision(served_model: ServedModel, tmp_path: Path) -> AsyncIterator[LiveGateway]:
    """A vision-language model with an encode pool in front of its aggregated pool."""
    model = build_vision_model(tmp_path)
    workers = ((Role.ENCODE, model.name), (Role.AGGREGATED, model.name))
    async with live_gateway(
        served_model, workers=workers, more_models=[model], image_url_schemes="http,https,data"
    ) as gateway:
        yield gateway


@pytest.mark.parametrize(
    ("text", "fields", "param"),
    [
        ("describe this picture please", {"max_tokens": 600}, "max_tokens"),
        ("describe this picture please " * 200, {}, "messages"),
    ],
)
async def test_a_prompt_over_the_context_window_downloads_no_image(
    vision: LiveGateway, fetched: list[str], text: str, fields: dict[str, Any], param: str
) -> None:
    body = image_chat(text, "http://images.example.com/cat.png", **fields)
    error = error_of(await vision.client.post(CHAT, json=body))
    assert (error["code"], error["param"]) == ("context_length_exceeded", param)
    assert fetched == []


async def test_images_go_to_the_encode_pool_first(vision: LiveGateway, fetched: list[str]) -> None:
    url = png_data_url()
    response = await vision.client.post(CHAT, json=image_chat("describe", url, max_tokens=2))
    assert response.status_code == 200, response.text
    assert fetched == [url]
    encode, aggregated = vision.workers
    [job] = encode.generate_jobs()
    assert not aggregated.jobs  # the fake encode worker answers itself
    assert len(job.images) == 1 and job.after_encode is Role.AGGREGATED
    stored = await vision.redis.get(f"conveyor:image:{job.images[0].digest}")
    assert stored is not None and len(stored) == job.images[0].nbytes


async def test_too_many_images_are_refused_before_any_is_fetched(
    served_model: ServedModel, tmp_path: Path, fetched: list[str]
) -> None:
    model = build_vision_model(tmp_path)
    async with live_gateway(
        served_model, workers=((Role.AGGREGATED, model.name),), more_models=[model],
        max_images_per_request=1,
    ) as gateway:  # fmt: skip
        url = png_data_url()
        body = image_chat("describe", url)
        body["messages"][0]["content"].append({"type": "image_url", "image_url": {"url": url}})
        error = error_of(await gateway.client.post(CHAT, json=body))
        assert error["param"] == "messages"
        assert "CONVEYOR_MAX_IMAGES_PER_REQUEST" in error["message"]
    assert fetched == []


async def test_an_unknown_model_name_is_echoed_cut_short(gateway: LiveGateway) -> None:
    response = await gateway.client.post(CHAT, json={**BODIES[CHAT], "model": "m" * 10_000})
    error = error_of(response, 404)
    assert error["code"] == "model_not_found"
    assert "m" * 64 + "..." in error["message"] and "m" * 65 not in error["message"]
