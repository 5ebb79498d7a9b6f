"""The LoRA e2e stack, shared by tests/e2e/test_lora.py (which drives the worker through
Redis, as the gateway does) and tests/e2e/test_lora_gateway.py (through a real gateway):
one worker with ``max_loras=2`` on a Redis db of its own, three good adapters and three
bad ones, and references from vLLM's offline ``LLM.generate`` with the same
``LoRARequest``, one prompt at a time. The session fixture lives in tests/e2e/conftest.py.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest
import redis
import redis.asyncio as aioredis

from shared.demo.lora import write_demo_lora
from shared.queue import names
from shared.queue.liveness import WorkerRegistration
from shared.queue.lora_registry import LoraSpec, publish_desired
from tests.e2e.stack import Process, Stack, run_offline

MODEL = "tiny"
LORA_REDIS_URL = os.environ.get("CONVEYOR_TEST_LORA_REDIS_URL", "redis://127.0.0.1:6379/4")
"""A db of its own: this module flushes it, and its model name is the shared stack's."""
GATEWAY = "gw-lora-test"
REPLY = names.reply_stream(GATEWAY)
GOOD = ("a1", "a2", "a3")
BAD = ("missing", "corrupt", "wrong-base")
PROMPTS = [
    [1, 300, 301, 302],
    [1, *range(1000, 1040)],
    [1, 50, 60, 70, 80, 90],
    [1, *range(2000, 2100)],
    [1, 7, 7, 7, 7],
    [1, *range(400, 430)],
    [1, 3333, 1234, 42],
    [1, *range(600, 700, 3)],
]
MAX_TOKENS = 16
WORKER_ENV = {
    "CONVEYOR_ENABLE_LORA": "true",
    "CONVEYOR_MAX_LORAS": "2",
    "CONVEYOR_MAX_LORA_RANK": "8",
    "CONVEYOR_WORKER_MAX_SLOTS": "48",
    "CONVEYOR_CANARY_IDLE_S": "3600",
    "CONVEYOR_LORA_ROOTS": "/",  # the adapters live in pytest's temporary folders
}


@dataclass
class LoraStack:
    stack: Stack
    specs: dict[str, LoraSpec]
    reference: dict[str, list[list[int]]]
    workers: list[Process] = field(default_factory=list)

    @property
    def worker(self) -> Process:
        return self.workers[-1]


def publish(specs: list[LoraSpec]) -> int:
    async def run() -> int:
        client = aioredis.Redis.from_url(LORA_REDIS_URL)
        try:
            return await publish_desired(client, MODEL, specs)
        finally:
            await client.aclose()

    return asyncio.run(run())


def registrations() -> list[WorkerRegistration]:
    client = redis.Redis.from_url(LORA_REDIS_URL)
    try:
        values = [client.get(k) for k in client.scan_iter(names.WORKER_HEARTBEAT_PATTERN)]
    finally:
        client.close()
    return [msgspec.json.decode(v, type=WorkerRegistration) for v in values if v]


def wait_ready(process: Process, timeout_s: float = 240) -> WorkerRegistration:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.popen.poll() is not None:
            raise RuntimeError(f"{process.name} exited:\n{process.log_tail()}")
        ready = [w for w in registrations() if w.ready and f"-{process.popen.pid}-" in w.worker_id]
        if ready:
            return ready[0]
        time.sleep(0.2)
    raise TimeoutError(f"{process.name} not ready in {timeout_s}s:\n{process.log_tail()}")


def write_adapters(folder: Path, base: Path) -> dict[str, Path]:
    paths = {
        name: write_demo_lora(folder / name, base=base, seed=seed)
        for seed, name in enumerate(GOOD, start=11)
    }
    corrupt = folder / "corrupt"
    shutil.copytree(paths["a1"], corrupt)
    weights = corrupt / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    other = folder / "other-base"
    other.mkdir()
    config = json.loads((base / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "hidden_size": 512, "head_dim": 128}))
    paths["corrupt"] = corrupt
    paths["wrong-base"] = write_demo_lora(folder / "wrong-base", base=other)
    paths["missing"] = folder / "never-written"
    return paths


def offline_reference(model: Path, adapters: dict[str, Path]) -> dict[str, list[list[int]]]:
    request = {
        "model": str(model),
        "prompts": PROMPTS,
        "max_tokens": MAX_TOKENS,
        "adapters": {name: str(path) for name, path in adapters.items()},
    }
    result: dict[str, list[list[int]]] = run_offline("offline_lora.py", request)
    return result


def lora_session(demo_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoraStack]:
    client = redis.Redis.from_url(LORA_REDIS_URL)
    client.flushdb()
    client.set(names.gateway_heartbeat(GATEWAY), b"1", ex=3600)
    client.close()
    paths = write_adapters(tmp_path_factory.mktemp("adapters"), demo_model)
    reference = offline_reference(demo_model, {name: paths[name] for name in GOOD})
    specs = {
        name: LoraSpec(name=name, path=str(path), base_model=MODEL) for name, path in paths.items()
    }
    publish(list(specs.values()))
    stack = Stack(demo_model, MODEL, LORA_REDIS_URL, tmp_path_factory.mktemp("logs"))
    env = LoraStack(stack, specs, reference)
    try:
        env.workers.append(stack.start_worker("worker", **WORKER_ENV))
        wait_ready(env.worker)
        yield env
    finally:
        stack.stop_all()
    stack.assert_no_safety_net()
