"""`conveyor up`: private Redis when none answers, serves (with the demo LoRA adapter
preloaded), and Ctrl-C leaves nothing running."""

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
    tree: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            assert up.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
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
        up.send_signal(signal.SIGINT)
        up.wait(60)
        log.close()
    time.sleep(1)
    survivors = [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not survivors, [p.cmdline() for p in survivors]
    assert not redis_answers(redis_url)
