"""LoRA adapters through a real gateway (SQL registry, /admin/loras, vLLM's bodies,
/v1/models, routing to the adapter's stream) on the LoRA stack's real vLLM worker
(tests/e2e/lora_stack.py), with the official ``openai`` client.

The gateway starts with an empty registry in its own SQLite file and publishes it: the
worker unloads what tests/e2e/test_lora.py published straight into Redis, and every
adapter here is registered through the gateway.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import redis

from shared.queue import names
from shared.queue.liveness import forget_dead_process
from shared.queue.lora_registry import LOADED
from tests.e2e.lora_stack import (
    BAD,
    LORA_REDIS_URL,
    MODEL,
    PROMPTS,
    WORKER_ENV,
    LoraStack,
    registrations,
    wait_ready,
)
from tests.e2e.stack import Process, wait_until

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.vllm,
    pytest.mark.redis,
    pytest.mark.slow,
    pytest.mark.timeout(900),  # the first test also waits for the shared LoRA stack's start
]

PARITY_PROMPTS = (0, 1, 3)
LONG = 800


@dataclass
class Gateway:
    lora: LoraStack
    data_dir: Path
    process: Process
    url: str

    def restart(self) -> None:
        self.process.stop()
        self.process, self.url = self.lora.stack.start_gateway(
            "gateway-restarted", CONVEYOR_DATA_DIR=str(self.data_dir), CONVEYOR_LORA_ROOTS="/"
        )
        wait_until(f"{self.url}/ready", status=200, process=self.process, timeout_s=120)

    def openai(self) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=300
        )

    def add(self, name: str) -> httpx.Response:
        spec = self.lora.specs[name]
        body = {"name": name, "path": spec.path, "base_model": MODEL}
        return httpx.post(f"{self.url}/admin/loras", json=body, timeout=120)

    def registered(self) -> dict[str, dict[str, str]]:
        listed = httpx.get(f"{self.url}/admin/loras", timeout=10).json()["data"]
        return {entry["name"]: entry["workers"] for entry in listed}


@pytest.fixture(scope="module")
def gateway(lora: LoraStack, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    data_dir = tmp_path_factory.mktemp("gateway-data")
    process, url = lora.stack.start_gateway(
        CONVEYOR_DATA_DIR=str(data_dir), CONVEYOR_LORA_ROOTS="/"
    )
    wait_until(f"{url}/ready", status=200, process=process, timeout_s=120)
    live = Gateway(lora, data_dir, process, url)
    for name in ("a1", "a2"):
        response = live.add(name)
        assert response.status_code == 200, response.text
    yield live
    live.process.stop()


def token_ids(client: openai.OpenAI, model: str, prompt: list[int], **extra: Any) -> list[int]:
    completion = client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=extra.pop("max_tokens", 16),
        temperature=0,
        extra_body={"return_token_ids": True, **extra},
    )
    ids: list[int] = (completion.choices[0].model_extra or {})["token_ids"]
    return ids


def assert_parity(gateway: Gateway, served: tuple[str, ...]) -> None:
    client = gateway.openai()
    for name in served:
        for p in PARITY_PROMPTS:
            model = MODEL if name == "base" else name
            assert token_ids(client, model, PROMPTS[p]) == gateway.lora.reference[name][p], name


def test_adapters_are_listed_with_their_parent_and_match_offline_vllm(gateway: Gateway) -> None:
    cards = {model.id: model for model in gateway.openai().models.list().data}
    assert {"a1", "a2", MODEL} <= set(cards)
    assert (cards["a1"].model_extra or {})["parent"] == MODEL
    assert (cards[MODEL].model_extra or {})["parent"] is None
    assert_parity(gateway, ("base", "a1", "a2"))


def test_bad_adapters_are_400_with_nothing_registered_and_a_healthy_engine(
    gateway: Gateway,
) -> None:
    expected = {
        "missing": "no adapter folder at",
        "corrupt": "adapter_model.safetensors is corrupt",
        "wrong-base": "made for another model",
    }
    for name in BAD:
        response = gateway.add(name)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["code"] == "adapter_load_failed" and expected[name] in error["message"]
    assert set(gateway.registered()) == {"a1", "a2"}
    with pytest.raises(openai.NotFoundError):
        gateway.openai().completions.create(model="corrupt", prompt=[1, 2], max_tokens=2)
    assert gateway.lora.worker.popen.poll() is None
    assert_parity(gateway, ("base",))


def test_unload_during_a_stream_finishes_it_then_404(gateway: Gateway) -> None:
    client = gateway.openai()
    stream = client.completions.create(
        model="a2",
        prompt=PROMPTS[2],
        max_tokens=LONG,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    ids: list[int] = []
    removed: httpx.Response | None = None
    for chunk in stream:
        for choice in chunk.choices:
            ids += (choice.model_extra or {}).get("token_ids") or []
        if ids and removed is None:  # it runs: remove its adapter now
            removed = httpx.delete(f"{gateway.url}/admin/loras/a2", timeout=30)
            assert removed.status_code == 200, removed.text
            assert len(ids) < LONG
    reference = gateway.lora.reference["a2"][2]
    assert removed is not None and len(ids) == LONG and ids[: len(reference)] == reference
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="a2", prompt=PROMPTS[0], max_tokens=2)
    assert set(gateway.registered()) == {"a1"}


def test_vllm_load_and_unload_bodies(gateway: Gateway) -> None:
    body = {"lora_name": "a3", "lora_path": gateway.lora.specs["a3"].path}
    loaded = httpx.post(f"{gateway.url}/v1/load_lora_adapter", json=body, timeout=120)
    assert loaded.status_code == 200 and loaded.text.startswith("Success"), loaded.text
    assert_parity(gateway, ("a3",))
    gone = httpx.post(f"{gateway.url}/v1/unload_lora_adapter", json={"lora_name": "a3"})
    assert gone.status_code == 200 and gone.text.startswith("Success"), gone.text
    assert set(gateway.registered()) == {"a1"}


def test_the_registry_survives_a_gateway_restart_and_a_lost_desired_state(
    gateway: Gateway,
) -> None:
    client = redis.Redis.from_url(LORA_REDIS_URL)
    try:  # Redis forgets the desired state: the restarted gateway republishes it from SQL
        client.delete(names.adapters_desired(MODEL), names.adapters_generation(MODEL))
    finally:
        client.close()
    gateway.restart()
    assert set(gateway.registered()) == {"a1"}
    assert "a1" in {model.id for model in gateway.openai().models.list().data}
    assert_parity(gateway, ("a1",))


def test_a_sigkilled_workers_replacement_loads_the_registry_before_it_is_ready(
    gateway: Gateway,
) -> None:
    lora = gateway.lora
    old = lora.worker
    os.killpg(old.popen.pid, signal.SIGKILL)
    old.popen.wait(30)
    forget_dead_process(LORA_REDIS_URL, old.popen.pid)
    client = gateway.openai()
    with ThreadPoolExecutor(1) as pool:
        # Sent while no worker runs: queued (the gateway still counts the dead worker for
        # a grace period, then the replacement serves it) or refused with a 503.
        early = pool.submit(token_ids, client, "a1", PROMPTS[0])
        lora.workers.append(lora.stack.start_worker("replacement-2", **WORKER_ENV))
        entry = wait_ready(lora.worker)
        assert entry.adapters.get("a1") == LOADED, entry.adapters
        try:
            assert early.result(timeout=300) == lora.reference["a1"][0]
        except openai.APIStatusError as exc:
            assert exc.status_code == 503, exc
    time.sleep(1.5)  # the gateway's worker directory refreshes every second
    assert_parity(gateway, ("a1",))


def test_worker_admin_routes(gateway: Gateway) -> None:
    workers = httpx.get(f"{gateway.url}/admin/workers", timeout=10).json()["data"]
    [worker] = [w for w in workers if f"-{gateway.lora.worker.popen.pid}-" in w["worker_id"]]
    base = f"{gateway.url}/admin/workers/{worker['worker_id']}"
    cleared = httpx.post(f"{base}/clear-kv", timeout=60)
    assert cleared.status_code == 200, cleared.text
    for command in ("sleep", "wake"):
        refused = httpx.post(f"{base}/{command}", timeout=60)
        assert refused.status_code == 501, refused.text
        assert "no sleep mode" in refused.json()["error"]["message"]
    assert httpx.post(f"{base}/drain", timeout=60).status_code == 200
    deadline = time.monotonic() + 5
    while not any(w.draining for w in registrations() if w.worker_id == worker["worker_id"]):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert httpx.post(f"{base}/resume", timeout=60).status_code == 200
    deadline = time.monotonic() + 5
    while any(w.draining for w in registrations() if w.worker_id == worker["worker_id"]):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    time.sleep(1.5)  # the gateway's directory sees it taking jobs again
    assert_parity(gateway, ("base",))
