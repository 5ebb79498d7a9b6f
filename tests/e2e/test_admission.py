"""429 when the queue is full, 503 when no worker serves the model, Idempotency-Key."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import Running
from tests.e2e.stack import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.redis]

# Long enough that no job finishes (and frees its queue slot) while the five are admitted.
LONG = {"prompt": "x", "max_tokens": 2000, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def small_queue_gateway(running: Running) -> Iterator[str]:
    process, url = running.stack.start_gateway("gateway-small-queue", CONVEYOR_QUEUE_MAX_DEPTH="2")
    wait_until(f"{url}/ready", status=200, process=process, timeout_s=60)
    yield url
    process.stop()


@pytest.fixture(scope="module")
def orphan_gateway(running: Running) -> Iterator[str]:
    process, url = running.stack.start_gateway(
        "gateway-orphan", CONVEYOR_SERVED_MODEL_NAME="orphan"
    )
    wait_until(f"{url}/health", status=200, process=process, timeout_s=60)
    yield url
    process.stop()


async def _open_stream(client: httpx.AsyncClient, url: str, model: str) -> int:
    async with client.stream(
        "POST", f"{url}/v1/completions", json={"model": model, **LONG}
    ) as response:
        if response.status_code == 200:
            async for _ in response.aiter_lines():
                break  # hold the slot briefly, then disconnect (cancels the request)
            await asyncio.sleep(1.0)
        else:
            await response.aread()
            assert response.headers.get("retry-after")
            assert response.json()["error"]["type"] == "rate_limit_exceeded"
        return response.status_code


async def test_full_queue_gives_429_with_retry_after(
    small_queue_gateway: str, running: Running
) -> None:
    async with httpx.AsyncClient(timeout=60) as client:
        statuses = await asyncio.gather(
            *(_open_stream(client, small_queue_gateway, running.model) for _ in range(5))
        )
    assert statuses.count(200) == 2
    assert statuses.count(429) == 3


def test_no_live_worker_gives_503(orphan_gateway: str) -> None:
    response = httpx.post(
        f"{orphan_gateway}/v1/chat/completions",
        json={"model": "orphan", "messages": [{"role": "user", "content": "hi"}]},
        timeout=30,
    )
    assert response.status_code == 503
    assert int(response.headers["retry-after"]) >= 1
    assert response.json()["error"]["code"] == "no_live_worker"
    assert httpx.get(f"{orphan_gateway}/ready", timeout=10).status_code == 503
    assert httpx.get(f"{orphan_gateway}/health", timeout=10).status_code == 200


def test_idempotency_key_is_not_queued_twice(running: Running) -> None:
    body = {"model": running.model, "prompt": "hello", "max_tokens": 4}
    headers = {"Idempotency-Key": "e2e-idem-1"}
    first = httpx.post(f"{running.base_url}/v1/completions", json=body, headers=headers, timeout=60)
    second = httpx.post(
        f"{running.base_url}/v1/completions", json=body, headers=headers, timeout=60
    )
    assert first.status_code == 200
    assert second.status_code == 409
    assert second.json()["error"]["code"] == "idempotency_key_in_use"
