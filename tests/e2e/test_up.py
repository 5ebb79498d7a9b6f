"""`conveyor up`: private Redis when none answers, serves (with the demo LoRA adapter
preloaded), prints nothing while idle, and Ctrl-C leaves nothing running and says so once."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import psutil
import pytest

from conveyor.redis_server import redis_answers
from tests.e2e.stack import CONVEYOR, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.slow]

IDLE_S = 4.0
STOP_LIMIT_S = 15.0
"""Generous: an idle stack stops in about 2 s on a 2-core box (9.7 s before)."""


def test_up_starts_redis_serves_and_stops_everything(demo_model: Path, tmp_path: Path) -> None:
    redis_url = f"redis://127.0.0.1:{free_port()}/0"
    port = free_port()
    assert not redis_answers(redis_url)
    env = dict(
        os.environ,
        CONVEYOR_REDIS_URL=redis_url,
        CONVEYOR_MODEL=str(demo_model),
        CONVEYOR_DATA_DIR=str(tmp_path),
        CONVEYOR_PORT=str(port),
        CONVEYOR_LORA_DEMO="1",
        CONVEYOR_CANARY_IDLE_S="1",  # the idle canary (a vLLM request) runs in the idle window
    )
    log = (tmp_path / "up.log").open("wb")
    up = subprocess.Popen(
        [CONVEYOR, "up"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    console = tmp_path / "up.log"
    tree: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 240
        while "Conveyor is ready" not in console.read_text():
            assert up.poll() is None, console.read_text()[-3000:]
            assert time.monotonic() < deadline, console.read_text()[-3000:]
            time.sleep(0.5)
        at_ready = console.read_text()
        time.sleep(IDLE_S)
        assert console.read_text() == at_ready, "printed while idle"
        assert "logs/conveyor.log" in at_ready  # where the engines' lines went
        assert "vllm" in (tmp_path / "logs" / "conveyor.log").read_text()
        assert redis_answers(redis_url), "up did not start its own Redis"
        assert (tmp_path / "redis" / "appendonlydir").exists(), "private Redis must use AOF"
        tree = [psutil.Process(up.pid), *psutil.Process(up.pid).children(recursive=True)]
        commands = [" ".join(p.cmdline()) for p in tree]
        assert any("conveyor worker --role aggregated" in c for c in commands), commands
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": demo_model.name, "prompt": "hi", "max_tokens": 3},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"]
        assert {m["id"]: m["parent"] for m in models}["demo-lora"] == demo_model.name
        assert (tmp_path / "demo-lora" / "adapter_config.json").exists()
        adapted = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={"model": "demo-lora", "prompt": "hi", "max_tokens": 3},
            timeout=60,
        )
        assert adapted.status_code == 200, adapted.text
    finally:
        os.killpg(up.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground group
        try:
            up.wait(STOP_LIMIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(up.pid, signal.SIGKILL)
            raise
        finally:
            log.close()
    time.sleep(1)
    assert console.read_text().count("all children stopped") == 1
    survivors = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not survivors, [p.cmdline() for p in survivors]
    assert not redis_answers(redis_url)
