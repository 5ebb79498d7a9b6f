"""One real stack per session: Redis, a vLLM worker on the generated demo model, a gateway."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from shared.demo.model import write_demo_model
from tests.e2e.lora_stack import LoraStack, lora_session
from tests.e2e.reference import OfflineReference
from tests.e2e.stack import Process, Stack, wait_until

E2E_REDIS_URL = os.environ.get("CONVEYOR_TEST_E2E_REDIS_URL", "redis://127.0.0.1:6379/3")
MODEL_NAME = "tiny"


@dataclass(frozen=True)
class Running:
    stack: Stack
    base_url: str
    worker: Process
    gateway: Process

    @property
    def model(self) -> str:
        return self.stack.model_name


@pytest.fixture(scope="session")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("models") / "demo")


@pytest.fixture(scope="session")
def stack(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    client = redis.Redis.from_url(E2E_REDIS_URL)
    client.flushdb()
    client.close()
    stack = Stack(
        demo_model,
        MODEL_NAME,
        E2E_REDIS_URL,
        tmp_path_factory.mktemp("logs"),
        data_dir=tmp_path_factory.mktemp("data"),
    )
    try:
        yield stack
    finally:
        stack.stop_all()
    stack.assert_no_safety_net()


@pytest.fixture(scope="session")
def running(stack: Stack) -> Running:
    worker = stack.start_worker()  # the default slots, as `make run` has them
    gateway, base_url = stack.start_gateway()
    wait_until(f"{base_url}/ready", status=200, process=worker, timeout_s=240)
    return Running(stack, base_url, worker, gateway)


@pytest.fixture(scope="session")
def offline_engine(
    demo_model: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[OfflineReference]:
    users = sum("offline" in getattr(item, "fixturenames", ()) for item in request.session.items)
    engine = OfflineReference(demo_model, tmp_path_factory.mktemp("offline") / "vllm.log", users)
    try:
        yield engine
    finally:
        engine.close()


@pytest.fixture
def offline(offline_engine: OfflineReference) -> Iterator[OfflineReference]:
    """vLLM's offline engine on the demo model, shared by the tests that compare with it
    (tests/e2e/reference.py); started by the first, closed after the last."""
    yield offline_engine
    offline_engine.done()


@pytest.fixture(scope="session")
def lora(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoraStack]:
    """The LoRA stack (tests/e2e/lora_stack.py): its own Redis db and worker."""
    yield from lora_session(demo_model, tmp_path_factory)
