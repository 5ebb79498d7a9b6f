"""Every refusal a valid-looking request can meet, with its status, shape and headers, and
the order of the checks: nothing expensive (an image download) before a cheap refusal."""

from __future__ import annotations

import asyncio
import base64
import io
from collections.abc import AsyncIterator, Awaitable, Callable
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
    COMPLETIONS,
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


def json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}


def nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "object"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


async def test_a_json_schema_is_stored_once_and_deleted_when_the_request_ends(
    gateway: LiveGateway,
) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {**BODIES[CHAT], "n": 4, "temperature": 0, "response_format": json_schema_format(schema)}
    response = await gateway.client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    jobs = gateway.workers[0].generate_jobs()
    assert len(jobs) == 4 and all(job.sampling.json_schema_stored for job in jobs)

    async def none_left() -> bool:
        return not await gateway.redis.keys("conveyor:schema:*")

    await eventually(none_left, timeout_s=2.0, what="the request's stored schema deleted")


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
        (CHAT, {**BODIES[CHAT], "messages": [{"role": "user", "content": None}]}, 400,
         "invalid_value", "messages[0]"),
        (CHAT, {**BODIES[CHAT], **{f"x{i}": 1 for i in range(65)}}, 400, None, None),
        (CHAT, {**BODIES[CHAT], "n": 128, "response_format": json_schema_format(
            {"type": "object", "description": "x" * 70_000})}, 400, None,
         "response_format.json_schema.schema"),
        (COMPLETIONS, {**BODIES[COMPLETIONS], "response_format": json_schema_format(
            nested(40))}, 400, None, "response_format.json_schema.schema"),
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
    assert job.images[0].nbytes == len(base64.b64decode(url.split(",", 1)[1]))
    await eventually(no_images_in(vision), what="the image deleted once its request ended")


def no_images_in(gateway: LiveGateway) -> Callable[[], Awaitable[bool]]:
    """True once the gateway's Redis holds no image bytes and counts none."""

    async def check() -> bool:
        names = [name async for name in gateway.redis.scan_iter("conveyor:image*")]
        return names == []

    return check


@pytest.mark.parametrize(
    ("workers", "status", "code"),
    [
        ((), 503, "no_live_worker"),  # refused before admission
        ((Role.AGGREGATED,), 409, "idempotency_key_in_use"),  # refused by the admission script
    ],
)
async def test_a_refused_request_leaves_no_image_bytes(
    served_model: ServedModel,
    tmp_path: Path,
    workers: tuple[Role, ...],
    status: int,
    code: str,
) -> None:
    model = build_vision_model(tmp_path)
    async with live_gateway(
        served_model, workers=[(role, model.name) for role in workers], more_models=[model]
    ) as gateway:
        body = image_chat("describe", png_data_url(), max_tokens=2)
        once = {"Idempotency-Key": "once"}
        if workers:
            first = await gateway.client.post(CHAT, json=body, headers=once)
            assert first.status_code == 200, first.text
        error = error_of(await gateway.client.post(CHAT, json=body, headers=once), status)
        assert error["code"] == code
        await eventually(no_images_in(gateway), what="the refused request's images deleted")


async def test_images_past_the_request_byte_cap_are_a_400_and_stop_the_fetches(
    vision: LiveGateway, fetched: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    url = png_data_url()
    cap = len(base64.b64decode(url.split(",", 1)[1])) + 1  # one image fits, two do not
    monkeypatch.setattr(vision.state.images, "_max_request_bytes", cap)
    parts = [{"type": "image_url", "image_url": {"url": url}}] * 4
    body = {"model": "tiny-vl", "messages": [{"role": "user", "content": parts}]}
    error = error_of(await vision.client.post(CHAT, json=body))
    assert "CONVEYOR_IMAGE_MAX_REQUEST_BYTES" in error["message"]
    assert error["param"].startswith("messages[0].content[")
    assert len(fetched) < 4  # past the cap, no further fetch starts
    assert await no_images_in(vision)()


async def test_past_the_image_store_budget_is_a_503_with_retry_after(
    served_model: ServedModel, tmp_path: Path
) -> None:
    model = build_vision_model(tmp_path)
    async with live_gateway(
        served_model, workers=((Role.AGGREGATED, model.name),), more_models=[model],
        image_store_max_bytes=10,
    ) as gateway:  # fmt: skip
        body = image_chat("describe", png_data_url(), max_tokens=2)
        response = await gateway.client.post(CHAT, json=body)
        assert error_of(response, 503)["code"] == "image_store_full"
        assert int(response.headers["retry-after"]) >= 1
        assert await no_images_in(gateway)()
        assert all(not worker.jobs for worker in gateway.workers)


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
