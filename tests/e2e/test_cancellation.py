"""A client that goes away leaves nothing behind: no engine request, no queue entry."""

from __future__ import annotations

import json
import time

import httpx
import pytest
import redis

from shared.queue import names
from shared.roles import Role
from tests.e2e.conftest import Running

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.redis]


def _workers(running: Running) -> list[dict[str, int]]:
    client = redis.Redis.from_url(running.stack.redis_url)
    try:
        found = list(client.scan_iter(names.WORKER_HEARTBEAT_PATTERN))
        return [json.loads(v) for v in client.mget(found) if v] if found else []
    finally:
        client.close()


def _queue_state(running: Running) -> tuple[int, int]:
    client = redis.Redis.from_url(running.stack.redis_url)
    stream = names.job_stream(running.model, Role.AGGREGATED)
    try:
        pending = client.xpending(stream, names.JOB_GROUP)["pending"]
        return int(client.xlen(stream)), int(pending)
    finally:
        client.close()


def _assert_nothing_left(running: Running, timeout_s: float = 8.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        workers = _workers(running)
        idle = all(w["active"] == 0 and w["engine_running"] == 0 for w in workers)
        if workers and idle and _queue_state(running) == (0, 0):
            return
        time.sleep(0.2)
    raise AssertionError(f"left behind: workers={_workers(running)} queue={_queue_state(running)}")


def test_stream_disconnect_aborts_the_engine_request(running: Running) -> None:
    body = {
        "model": running.model,
        "prompt": "x",
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.stream(
        "POST", f"{running.base_url}/v1/completions", json=body, timeout=60
    ) as response:
        for number, _ in enumerate(response.iter_lines()):
            if number > 6:
                break
    _assert_nothing_left(running)
    log = running.worker.log_path.read_text()
    assert "client disconnected" in log


def test_non_stream_disconnect_aborts_the_engine_request(running: Running) -> None:
    body = {"model": running.model, "prompt": "y", "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{running.base_url}/v1/completions", json=body, timeout=0.5)
    _assert_nothing_left(running)
