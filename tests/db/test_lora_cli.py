"""`conveyor lora add|rm|ls` against SQLite and PostgreSQL and the real Redis, with a fake
adapter worker (tests/gateway/fake_lora_worker.py) running in a thread of its own."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.asyncio as aioredis

from conveyor.cli import main
from shared.queue import names
from tests.conftest import REAL_REDIS_URL, _require_real_redis
from tests.gateway.fake_lora_worker import WORKER_ID, FakeLoraWorker
from tests.support.sql import SqlTarget

pytestmark = pytest.mark.redis


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _flush_adapter_keys() -> None:
    client = redis.Redis.from_url(REAL_REDIS_URL)
    try:
        stale = [*client.scan_iter(f"{names.PREFIX}:adapters*"), names.worker_heartbeat(WORKER_ID)]
        client.delete(*stale)
    finally:
        client.close()


@pytest.fixture
def fake_worker() -> Iterator[None]:
    """A fake adapter worker of `tiny` on the real Redis, in its own event loop."""
    _require_real_redis(REAL_REDIS_URL)
    _flush_adapter_keys()
    loop = asyncio.new_event_loop()
    started = threading.Event()
    stop = asyncio.Event()

    async def serve() -> None:
        client = aioredis.Redis.from_url(REAL_REDIS_URL)
        worker = FakeLoraWorker(client, "tiny")
        await worker.start()
        started.set()
        try:
            await stop.wait()
        finally:
            await worker.stop()
            await client.aclose()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(10)
    try:
        yield
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)
        loop.close()
        _flush_adapter_keys()


def test_add_ls_rm(
    sql_target: SqlTarget,
    fake_worker: None,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    where = ("--database-url", sql_target.url, "--redis-url", REAL_REDIS_URL)
    assert run(capsys, "db", "upgrade", *where)[0] == 0
    monkeypatch.setenv("CONVEYOR_LORA_ROOTS", str(tmp_path))
    folder = tmp_path / "a1"
    folder.mkdir()
    code, out, err = run(capsys, "lora", "add", "a1", str(folder), "--base-model", "tiny", *where)
    assert code == 0, err
    assert f"loaded on: {WORKER_ID}" in out
    code, out, _ = run(capsys, "lora", "ls", *where)
    assert code == 0 and f"a1  base tiny  {folder}" in out and f"{WORKER_ID}: loaded" in out

    code, _, err = run(
        capsys, "lora", "add", "a2", str(tmp_path / "missing"), "--base-model", "tiny", *where
    )
    assert code == 2 and "no adapter folder at" in err and "nothing registered" in err
    code, out, _ = run(capsys, "lora", "ls", "--json", *where)
    assert [row["name"] for row in json.loads(out)] == ["a1"]

    code, _, err = run(capsys, "lora", "add", "a3", str(folder), "--base-model", "nope", *where)
    assert code == 1 and "base_model `nope`" in err

    code, out, _ = run(capsys, "lora", "rm", "a1", *where)
    assert code == 0 and f"removed a1 (was {folder} for tiny)" in out
    code, _, err = run(capsys, "lora", "rm", "a1", *where)
    assert code == 1 and "no LoRA adapter `a1`" in err
    assert "no LoRA adapters registered" in run(capsys, "lora", "ls", *where)[1]
