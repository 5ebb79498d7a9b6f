"""LoRA admin routes and adapter serving, in process: the real gateway (fakeredis, fake
workers) with the control plane on SQLite and PostgreSQL. A fake adapter worker
reconciles to the published desired state (tests/gateway/fake_lora_worker.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from gateway.catalog.served_models import ServedModel
from gateway.control.key_service import KeySpec
from gateway.control.plane import ControlPlane
from gateway.control.records import Scope
from gateway.db import lora_repo
from gateway.db.engine import Database, transaction
from shared.queue import names
from shared.queue.lora_registry import adapter_stream, read_desired
from shared.roles import Role
from tests.gateway.fake_lora_worker import WORKER_ID, FakeLoraWorker
from tests.gateway.harness import CHAT, EMBED_MODEL, LiveGateway, error_of, live_gateway
from tests.support.sql import SqlTarget

ADMIN_KEY = "admin-key-for-lora-tests-0123456789"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture
async def gateway(
    served_model: ServedModel, sql_target: SqlTarget, database: Database, tmp_path: Path
) -> AsyncIterator[LiveGateway]:
    async with live_gateway(
        served_model,
        workers=[(Role.EMBED, EMBED_MODEL)],
        database_url=sql_target.url,
        lora_roots=str(tmp_path),
        admin_key=ADMIN_KEY,
        lora_load_timeout_s=1.0,
        worker_command_timeout_s=0.5,
    ) as live:
        plane = ControlPlane(live.state.settings, live.redis, "gw-test", bases=live_bases(live))
        await plane.start()
        live.state.attach(plane)
        try:
            yield live
        finally:
            await plane.stop()


def live_bases(live: LiveGateway) -> Any:
    return live.state.catalog.bases


@pytest.fixture
async def worker(gateway: LiveGateway) -> AsyncIterator[FakeLoraWorker]:
    fake = FakeLoraWorker(gateway.redis, "tiny")
    await fake.start()
    await gateway.state.cells.home.directory.refresh()
    try:
        yield fake
    finally:
        await fake.stop()


@pytest.fixture
def adapter_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "a1"
    folder.mkdir()
    return folder


async def add(live: LiveGateway, name: str, path: Path | str, **extra: Any) -> Any:
    body = {"name": name, "path": str(path), "base_model": "tiny", **extra}
    return await live.client.post("/admin/loras", json=body, headers=ADMIN)


async def chat(live: LiveGateway, model: str, headers: dict[str, str] = ADMIN) -> Any:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    return await live.client.post(CHAT, json=body, headers=headers)


async def registered(live: LiveGateway) -> list[str]:
    assert live.state.control is not None
    async with transaction(live.state.control.database.sessions) as session:
        rows = await lora_repo.list_all(session)
    return [row.name for row in rows]


async def assert_nothing_registered(live: LiveGateway) -> None:
    assert await registered(live) == []
    desired = await read_desired(live.redis, "tiny")
    assert desired is not None and dict(desired.specs) == {}
    listed = (await live.client.get("/admin/loras", headers=ADMIN)).json()
    assert listed["data"] == []
    models = (await live.client.get("/v1/models", headers=ADMIN)).json()["data"]
    assert [m["id"] for m in models] == ["tiny", EMBED_MODEL]


async def test_an_adapter_is_loaded_listed_and_served_on_its_own_stream(
    gateway: LiveGateway, worker: FakeLoraWorker, adapter_dir: Path
) -> None:
    response = await add(gateway, "a1", adapter_dir)
    assert response.status_code == 200, response.text
    assert response.json()["loaded_on"] == [WORKER_ID]
    listed = (await gateway.client.get("/admin/loras", headers=ADMIN)).json()["data"]
    assert [(a["name"], a["base_model"], a["workers"]) for a in listed] == [
        ("a1", "tiny", {WORKER_ID: "loaded"})
    ]
    cards = (await gateway.client.get("/v1/models", headers=ADMIN)).json()["data"]
    assert {c["id"]: c["parent"] for c in cards} == {"tiny": None, EMBED_MODEL: None, "a1": "tiny"}
    card = (await gateway.client.get("/v1/models/a1", headers=ADMIN)).json()
    assert card["root"] == str(adapter_dir)  # an admin key sees the folder, as in vLLM
    await gateway.state.cells.home.directory.refresh()
    answered = await chat(gateway, "a1")
    assert answered.status_code == 200, answered.text
    assert answered.json()["model"] == "a1"
    [job] = worker.readers["a1"].generate_jobs()
    assert job.adapter == "a1" and job.model == "a1"
    workers = (await gateway.client.get("/admin/workers", headers=ADMIN)).json()["data"]
    assert [w["adapters"] for w in workers if w["worker_id"] == WORKER_ID] == [{"a1": "loaded"}]


async def test_the_same_spec_again_is_a_no_op_another_is_a_conflict(
    gateway: LiveGateway, worker: FakeLoraWorker, adapter_dir: Path, tmp_path: Path
) -> None:
    assert (await add(gateway, "a1", adapter_dir)).status_code == 200
    again = await add(gateway, "a1", adapter_dir)
    assert again.status_code == 200 and again.json()["loaded_on"] == [WORKER_ID]
    error = error_of(await add(gateway, "a1", tmp_path), 409)
    assert error["code"] == "adapter_conflict" and str(adapter_dir) in error["message"]
    assert await registered(gateway) == ["a1"]


async def test_a_load_every_worker_refuses_is_a_400_with_nothing_registered(
    gateway: LiveGateway, worker: FakeLoraWorker, tmp_path: Path
) -> None:
    missing = error_of(await add(gateway, "gone", tmp_path / "never-written"), 400)
    assert missing["code"] == "adapter_load_failed" and missing["param"] == "path"
    assert "no adapter folder at" in missing["message"] and WORKER_ID in missing["message"]
    await assert_nothing_registered(gateway)
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    (wrong / "WRONG_BASE").touch()
    refused = error_of(await add(gateway, "wrong", wrong), 400)
    assert "made for another model" in refused["message"]
    await assert_nothing_registered(gateway)


async def test_bad_input_is_refused_before_anything_is_registered(
    gateway: LiveGateway, worker: FakeLoraWorker, adapter_dir: Path
) -> None:
    cases = [
        ({"name": "bad name!"}, 400, "name"),
        ({"name": "tiny"}, 400, "name"),
        ({"path": "relative/folder"}, 400, "path"),
        ({"base_model": "no-such-model"}, 404, "base_model"),
        ({"base_model": EMBED_MODEL}, 404, "base_model"),
        ({"unknown_field": 1}, 400, "unknown_field"),
    ]
    for fields, status, param in cases:
        body = {"name": "a1", "path": str(adapter_dir), "base_model": "tiny", **fields}
        response = await gateway.client.post("/admin/loras", json=body, headers=ADMIN)
        assert error_of(response, status)["param"] == param, fields
    await assert_nothing_registered(gateway)


async def test_without_a_worker_of_the_base_it_is_a_503_and_nothing_registered(
    gateway: LiveGateway, adapter_dir: Path
) -> None:
    response = await add(gateway, "a1", adapter_dir)
    assert error_of(response, 503)["code"] == "no_live_worker"
    assert "Retry-After" in response.headers
    await assert_nothing_registered(gateway)


async def test_a_load_no_worker_finishes_in_time_is_rolled_back(
    gateway: LiveGateway, worker: FakeLoraWorker, adapter_dir: Path
) -> None:
    await worker.freeze()
    assert error_of(await add(gateway, "a1", adapter_dir), 503)["code"] == "adapter_load_timeout"
    worker.thaw()
    await assert_nothing_registered(gateway)


async def test_removed_adapters_are_404_at_once(
    gateway: LiveGateway, worker: FakeLoraWorker, adapter_dir: Path
) -> None:
    assert (await add(gateway, "a1", adapter_dir)).status_code == 200
    removed = await gateway.client.delete("/admin/loras/a1", headers=ADMIN)
    assert removed.status_code == 200 and removed.json()["deleted"] is True
    assert error_of(await chat(gateway, "a1"), 404)["code"] == "model_not_found"
    assert await gateway.redis.xlen(adapter_stream("a1")) == 0
    gone = error_of(await gateway.client.delete("/admin/loras/a1", headers=ADMIN), 404)
    assert gone["code"] == "adapter_not_found"
    huge = await gateway.client.delete("/admin/loras/" + "x" * 5000, headers=ADMIN)
    assert error_of(huge, 404)["code"] == "adapter_not_found"
    await assert_nothing_registered(gateway)


async def test_vllm_load_and_unload_bodies(
    gateway: LiveGateway, worker: FakeLoraWorker, adapter_dir: Path
) -> None:
    body = {"lora_name": "a1", "lora_path": str(adapter_dir)}
    loaded = await gateway.client.post("/v1/load_lora_adapter", json=body, headers=ADMIN)
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'a1' added successfully."
    assert await registered(gateway) == ["a1"]
    unload = {"lora_name": "a1"}
    unloaded = await gateway.client.post("/v1/unload_lora_adapter", json=unload, headers=ADMIN)
    assert unloaded.text == "Success: LoRA adapter 'a1' removed successfully."
    missing = await gateway.client.post("/v1/unload_lora_adapter", json=unload, headers=ADMIN)
    assert error_of(missing, 404)["code"] == "adapter_not_found"
    bad = {"lora_name": "a2", "lora_path": str(adapter_dir / "nope")}
    refused = await gateway.client.post("/v1/load_lora_adapter", json=bad, headers=ADMIN)
    assert error_of(refused, 400)["code"] == "adapter_load_failed"
    await assert_nothing_registered(gateway)


async def test_admin_scope_and_model_allow_lists(
    gateway: LiveGateway, worker: FakeLoraWorker, adapter_dir: Path
) -> None:
    assert (await add(gateway, "a1", adapter_dir)).status_code == 200
    await gateway.state.cells.home.directory.refresh()
    control = gateway.state.control
    assert control is not None
    only_a1 = await control.key_service.create(
        KeySpec("a1-only", frozenset({Scope.INFERENCE}), frozenset({"a1"}))
    )
    only_base = await control.key_service.create(
        KeySpec("base-only", frozenset({Scope.INFERENCE}), frozenset({"tiny"}))
    )
    await control.keys.reload()
    a1_key = {"Authorization": f"Bearer {only_a1.secret}"}
    base_key = {"Authorization": f"Bearer {only_base.secret}"}
    assert (await chat(gateway, "a1", a1_key)).status_code == 200
    assert error_of(await chat(gateway, "tiny", a1_key), 404)["code"] == "model_not_found"
    assert error_of(await chat(gateway, "a1", base_key), 404)["code"] == "model_not_found"
    models = (await gateway.client.get("/v1/models", headers=a1_key)).json()["data"]
    assert [m["id"] for m in models] == ["a1"]
    for method, path in [("GET", "/admin/loras"), ("DELETE", "/admin/loras/a1")]:
        response = await gateway.client.request(method, path, headers=a1_key)
        assert error_of(response, 403)["code"] == "insufficient_permissions"
    body = {"lora_name": "a2", "lora_path": str(adapter_dir)}
    response = await gateway.client.post("/v1/load_lora_adapter", json=body, headers=a1_key)
    assert error_of(response, 403)["code"] == "insufficient_permissions"
    assert await registered(gateway) == ["a1"]


async def forget_desired_state(live: LiveGateway) -> None:
    await live.redis.delete(names.adapters_desired("tiny"), names.adapters_generation("tiny"))
    assert await read_desired(live.redis, "tiny") is None


async def test_the_registry_survives_a_gateway_restart_and_a_redis_that_lost_it(
    gateway: LiveGateway, worker: FakeLoraWorker, adapter_dir: Path
) -> None:
    assert (await add(gateway, "a1", adapter_dir)).status_code == 200
    await forget_desired_state(gateway)  # Redis lost it; SQL is the truth
    restarted = ControlPlane(
        gateway.state.settings, gateway.redis, "gw-restarted", bases=live_bases(gateway)
    )
    await restarted.start()
    try:
        desired = await read_desired(gateway.redis, "tiny")
        assert desired is not None and list(desired.specs) == ["a1"]
        assert desired.specs["a1"].path == str(adapter_dir)
    finally:
        await restarted.stop()
    await forget_desired_state(gateway)  # and once more, while this gateway runs: the watch
    gateway.state.cells.home.adapters.republish = restarted.lora.publish
    await gateway.state.cells.home.adapters.refresh()
    desired = await read_desired(gateway.redis, "tiny")
    assert desired is not None and list(desired.specs) == ["a1"]


async def test_an_adapter_not_loaded_anywhere_is_a_503(
    gateway: LiveGateway, worker: FakeLoraWorker, adapter_dir: Path
) -> None:
    assert (await add(gateway, "a1", adapter_dir)).status_code == 200
    await worker.freeze({"a1": "unloading"})
    await gateway.state.cells.home.directory.refresh()
    response = await chat(gateway, "a1")
    assert error_of(response, 503)["code"] == "no_live_worker"
    assert await gateway.redis.xlen(adapter_stream("a1")) == 0


async def test_worker_admin_commands_map_to_statuses(
    gateway: LiveGateway, worker: FakeLoraWorker
) -> None:
    worker.answers = {
        "drain": ("ok", "draining"),
        "sleep": ("not_supported", "not supported on this engine: vLLM on cpu has no sleep"),
        "clear-kv": ("failed", "the engine refused to clear its KV cache"),
    }
    base = f"/admin/workers/{WORKER_ID}"
    drained = await gateway.client.post(f"{base}/drain", headers=ADMIN)
    assert drained.status_code == 200 and drained.json()["detail"] == "draining"
    slept = error_of(await gateway.client.post(f"{base}/sleep", headers=ADMIN), 501)
    assert slept["code"] == "not_supported" and "no sleep" in slept["message"]
    cleared = error_of(await gateway.client.post(f"{base}/clear-kv", headers=ADMIN), 500)
    assert cleared["code"] == "worker_command_failed"
    silent = error_of(await gateway.client.post(f"{base}/resume", headers=ADMIN), 504)
    assert silent["code"] == "worker_command_timeout"
    unknown = error_of(await gateway.client.post(f"{base}/explode", headers=ADMIN), 400)
    assert unknown["param"] == "command"
    nobody = await gateway.client.post("/admin/workers/nobody/drain", headers=ADMIN)
    assert error_of(nobody, 404)["code"] == "worker_not_found"


async def test_a_path_outside_the_lora_roots_is_refused_without_saying_if_it_exists(
    gateway: LiveGateway, worker: FakeLoraWorker, adapter_dir: Path, tmp_path: Path
) -> None:
    outside = tmp_path.parent / f"{tmp_path.name}-outside"
    outside.mkdir()
    (tmp_path / "link").symlink_to(outside)
    messages = set()
    for path in ("/etc", "/no/such/folder", str(outside), str(tmp_path / "link")):
        error = error_of(await add(gateway, "x1", path), 400)
        assert error["param"] == "path" and "CONVEYOR_LORA_ROOTS" in error["message"]
        messages.add(error["message"])
    assert len(messages) == 1  # nothing tells which of them exist
    await assert_nothing_registered(gateway)
    assert (await add(gateway, "a1", adapter_dir)).status_code == 200
