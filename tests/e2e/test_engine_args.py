"""vLLM engine arguments reach the engine (CONVEYOR_ENGINE_ARGS, or vLLM's own flags after
`--`): a worker with prefix caching off reports no cached prompt tokens where the default
worker reports them (test_control_plane), and a misspelt argument stops the worker at
start-up with the config-error exit code, naming it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import E2E_REDIS_URL
from tests.e2e.stack import Stack, wait_until
from workers.main import EXIT_CONFIG_ERROR

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]


@pytest.fixture
def own_stack(demo_model: Path, tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(demo_model, "no-prefix-cache", E2E_REDIS_URL, tmp_path, data_dir=tmp_path)
    try:
        yield stack
    finally:
        stack.stop_all()


def test_prefix_caching_off_reports_no_cached_tokens(own_stack: Stack) -> None:
    worker = own_stack.start_worker(
        CONVEYOR_ENGINE_ARGS=json.dumps({"enable_prefix_caching": False})
    )
    _gateway, url = own_stack.start_gateway()
    wait_until(f"{url}/ready", status=200, process=worker, timeout_s=240)
    body = {
        "model": own_stack.model_name,
        "messages": [{"role": "user", "content": "the tide comes in and goes out " * 60}],
        "max_tokens": 2,
    }
    usages = [
        httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120).json()["usage"]
        for _ in range(2)
    ]
    assert usages[1]["prompt_tokens"] > 256
    assert not (usages[1].get("prompt_tokens_details") or {}).get("cached_tokens")
    assert "enable_prefix_caching" in worker.log_path.read_text()  # the worker says so


def test_an_unknown_engine_argument_refuses_to_start(own_stack: Stack) -> None:
    flags = ["--", "--block-sise", "16"]
    worker = own_stack.start("worker", ["worker", "--role", "aggregated", *flags])
    assert worker.popen.wait(timeout=180) == EXIT_CONFIG_ERROR
    assert "unknown vLLM engine argument 'block_sise'" in worker.log_path.read_text()
