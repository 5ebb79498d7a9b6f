"""/admin/* in process (httpx.ASGITransport on the real routes and error funnel), with the
control plane on SQLite and PostgreSQL: keys, usage, /admin/state, /ready, and who may call."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from fakeredis.aioredis import FakeRedis

from gateway.app import build_app
from gateway.control.ledger import usage_row
from gateway.control.plane import ControlPlane
from gateway.db import usage_repo
from gateway.db.engine import Database
from gateway.db.schema import upgrade_to_head
from shared.queue.usage import UsageRecord
from shared.settings import Settings
from tests.support.sql import SqlTarget

ADMIN_KEY = "admin-key-for-route-tests-0123456789"
DAY1, DAY2 = 1748736000.0, 1748822400.0  # 2025-06-01, 2025-06-02 (UTC midnight)


class _Directory:
    def all(self) -> list[Any]:
        return []

    def pools(self) -> dict[str, Any]:
        return {}

    def loads(self) -> dict[str, Any]:
        return {}


class _Cells:
    """One cell with no workers and no open requests (gateway/dispatch/cells.py)."""

    sharded = False

    def all(self) -> list[Any]:
        return [
            SimpleNamespace(name="home", redis=FakeRedis(), directory=_Directory(), placement=None)
        ]

    def open_requests(self) -> int:
        return 0


@pytest.fixture
async def plane_factory(sql_target: SqlTarget, database: Database) -> AsyncIterator[Any]:
    planes: list[ControlPlane] = []

    async def make(**settings_fields: Any) -> tuple[httpx.AsyncClient, ControlPlane]:
        settings = Settings(
            database_url=sql_target.url, **{"allowed_hosts": "gw", **settings_fields}
        )
        plane = ControlPlane(settings, FakeRedis(), "gw-test")
        await plane.start()
        planes.append(plane)
        app = build_app(settings, None)
        app.state.gateway = SimpleNamespace(
            settings=settings,
            control=plane,
            gateway_id="gw-test",
            draining=False,
            redis=FakeRedis(),
            cells=_Cells(),
            catalog=SimpleNamespace(all=lambda: []),
        )
        transport = httpx.ASGITransport(app=app)
        return httpx.AsyncClient(transport=transport, base_url="http://gw"), plane

    yield make
    for plane in planes:
        await plane.stop()


def error_of(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error: dict[str, Any] = body["error"]
    return error


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


async def test_who_may_call_admin_routes(plane_factory: Any) -> None:
    client, _plane = await plane_factory(admin_key=ADMIN_KEY)
    async with client:
        assert error_of(await client.get("/admin/keys"), 401)["code"] == "invalid_api_key"
        malformed = await client.get("/admin/keys", headers={"Authorization": "Token abc"})
        assert error_of(malformed, 401)["code"] == "invalid_api_key"
        wrong = await client.get("/admin/keys", headers=bearer("cvy-" + "x" * 43))
        assert "cvy-xxxx\u2026xxxx" in error_of(wrong, 401)["message"]
        assert "x" * 20 not in wrong.text

        admin = bearer(ADMIN_KEY)
        created = await client.post("/admin/keys", json={"name": "team-a"}, headers=admin)
        assert created.status_code == 201, created.text
        inference = created.json()
        assert inference["key"].startswith("cvy-") and inference["id"].startswith("key_")
        assert inference["scopes"] == ["inference"]
        ops = (
            await client.post(
                "/admin/keys", json={"name": "ops", "scopes": ["admin"]}, headers=admin
            )
        ).json()
        # No wait for the generation poller: the gateway that made a key change reloads
        # its own cache before it answers.
        refused = error_of(await client.get("/admin/keys", headers=bearer(inference["key"])), 403)
        assert refused["code"] == "insufficient_permissions"
        listed = await client.get("/admin/keys", headers=bearer(ops["key"]))
        assert [k["name"] for k in listed.json()["data"]] == ["team-a", "ops"]
        assert "key" not in listed.json()["data"][0]  # the secret is shown once only
        assert (await client.get("/admin/state", headers=bearer(ops["key"]))).status_code == 200

        await client.delete(f"/admin/keys/{ops['id']}", headers=admin)
        error_of(await client.get("/admin/keys", headers=bearer(ops["key"])), 401)


async def test_key_crud_and_bad_input(plane_factory: Any) -> None:
    client, _ = await plane_factory()  # auth off, loopback
    async with client:
        bad = {
            "name": ({"scopes": ["inference"]}, 400),
            "rpmm": ({"name": "a", "rpmm": 5}, 400),
            "rpm": ({"name": "a", "rpm": -1}, 400),
            "tpm": ({"name": "a", "tpm": "5"}, 400),
            "scopes": ({"name": "a", "scopes": ["bogus"]}, 400),
            "budget_period": ({"name": "a", "budget_tokens": 10}, 400),
            "expires_at": ({"name": "a", "expires_at": "2001-01-01T00:00:00Z"}, 400),
            "models": ({"name": "a", "models": []}, 400),
        }
        for param, (body, status) in bad.items():
            assert error_of(await client.post("/admin/keys", json=body), status)["param"] == param

        created = await client.post(
            "/admin/keys",
            json={
                "name": "team-b",
                "scopes": ["inference", "metrics"],
                "models": ["m2", "m1"],
                "rpm": 60,
                "tpm": 1000,
                "max_concurrent": 2,
                "budget_tokens": 10_000,
                "budget_period": "day",
                "expires_at": "2999-01-01T00:00:00Z",
            },
        )
        key = created.json()
        assert (key["models"], key["rpm"], key["budget_period"], key["status"]) == (
            ["m1", "m2"],
            60,
            "day",
            "active",
        )
        assert key["masked_key"] == f"{key['key'][:8]}\u2026{key['key'][-4:]}"
        path = f"/admin/keys/{key['id']}"
        assert (await client.get(path)).json()["name"] == "team-b"

        patched = (await client.patch(path, json={"rpm": None, "name": "team-b2"})).json()
        assert (patched["rpm"], patched["tpm"], patched["name"]) == (None, 1000, "team-b2")
        assert error_of(await client.patch(path, json={"name": None}), 400)["param"] == "name"
        cleared = (await client.patch(path, json={"budget_tokens": None})).json()
        assert (cleared["budget_tokens"], cleared["budget_period"]) == (None, None)
        assert (
            error_of(await client.patch(path, json={"budget_tokens": 5}), 400)["param"]
            == "budget_period"
        )

        revoked = await client.delete(path)
        assert revoked.json()["status"] == "revoked"
        assert (await client.delete(path)).json()["revoked_at"] == revoked.json()["revoked_at"]
        assert error_of(await client.patch(path, json={"rpm": 1}), 409)["code"] == (
            "api_key_revoked"
        )
        assert (await client.get("/admin/keys")).json()["data"] == []
        assert len((await client.get("/admin/keys?include_revoked=true")).json()["data"]) == 1

        missing = error_of(await client.get("/admin/keys/key_nope"), 404)
        assert (missing["code"], missing["param"]) == ("api_key_not_found", "id")


async def test_usage_rows_and_totals(plane_factory: Any, database: Database) -> None:
    client, _ = await plane_factory()
    records = [
        UsageRecord(
            request_id="r1",
            key_id="key_a",
            model="m1",
            prompt_tokens=10,
            completion_tokens=1,
            status="completed",
            received_unix=DAY1 + 60,
            finished_unix=DAY1 + 61,
            cached_prompt_tokens=8,
        ),
        UsageRecord(
            request_id="r2",
            key_id="key_b",
            model="m1",
            prompt_tokens=20,
            completion_tokens=2,
            status="cancelled",
            received_unix=DAY2 + 60,
            finished_unix=DAY2 + 61,
        ),
        UsageRecord(
            request_id="r3",
            key_id="key_a",
            model="m2",
            prompt_tokens=30,
            completion_tokens=3,
            status="failed",
            received_unix=DAY2 + 120,
            finished_unix=DAY2 + 121,
            n=2,
            finish_reason="stop,length",
        ),
    ]
    async with database.sessions.begin() as session:
        await usage_repo.insert_batch(session, [usage_row(r, datetime.now(UTC)) for r in records])
    async with client:
        everything = (await client.get("/admin/usage")).json()
        assert [row["request_id"] for row in everything["data"]] == ["r3", "r2", "r1"]
        assert everything["total"]["total_tokens"] == 66 and not everything["has_more"]
        assert everything["data"][0]["finish_reason"] == "stop,length"

        by_day = (await client.get("/admin/usage?group_by=day")).json()
        assert [(g["day"], g["requests"]) for g in by_day["data"]] == [
            ("2025-06-01", 1),
            ("2025-06-02", 2),
        ]
        key_a = (await client.get("/admin/usage?key=key_a&group_by=model")).json()
        assert [(g["model"], g["prompt_tokens"]) for g in key_a["data"]] == [("m1", 10), ("m2", 30)]
        assert key_a["total"]["cached_prompt_tokens"] == 8
        window = (
            await client.get(
                "/admin/usage", params={"since": "2025-06-02", "until": str(DAY2 + 100)}
            )
        ).json()
        assert [row["request_id"] for row in window["data"]] == ["r2"]
        first = (await client.get("/admin/usage?limit=1")).json()
        assert len(first["data"]) == 1 and first["has_more"]

        for query, param in (
            ("group_by=week", "group_by"),
            ("since=yesterday", "since"),
            ("limit=0", "limit"),
            ("until=-5", "until"),
            ("since=99999999999d", "since"),
            ("until=99999999999999", "until"),
        ):
            assert error_of(await client.get(f"/admin/usage?{query}"), 400)["param"] == param


async def test_ready_reports_the_control_plane(plane_factory: Any) -> None:
    client, _ = await plane_factory()
    async with client:
        ready = await client.get("/ready")
        assert ready.status_code == 200, ready.text
        control = ready.json()["control"]
        assert control["database"]["schema"]["at_head"] and control["database"]["reachable"]
        assert control["auth"] == "off" and "url" not in control["database"]
        state = (await client.get("/admin/state")).json()
        assert state["control"]["database"]["url"] and state["gateway_id"] == "gw-test"


async def test_ready_details_are_for_an_admin_key_only(plane_factory: Any) -> None:
    client, plane = await plane_factory(admin_key=ADMIN_KEY)
    async with client:
        anyone = await client.get("/ready")
        assert anyone.status_code == 200
        assert anyone.json() == {"ready": True, "problems": []}
        admin = (await client.get("/ready", headers=bearer(ADMIN_KEY))).json()
        assert admin["control"]["auth"] == "on" and "dialect" in admin["control"]["database"]
        plane.schema_error = "OperationalError: connection to db.internal.corp refused"
        plane.schema = None
        anyone = await client.get("/ready")
        assert anyone.status_code == 503
        assert anyone.json() == {"ready": False, "problems": ["control plane not ready"]}
        admin = (await client.get("/ready", headers=bearer(ADMIN_KEY))).json()
        assert any("db.internal.corp" in problem for problem in admin["problems"])


async def test_an_external_database_behind_head_is_not_ready_and_not_migrated(
    sql_target: SqlTarget,
) -> None:
    settings = Settings(database_url=sql_target.url, redis_url="redis://unused")
    plane = ControlPlane(settings, FakeRedis(), "gw-test")
    await plane.start()
    try:
        problems, report = await plane.readiness()
        assert any("run `conveyor db upgrade`" in p for p in problems), problems
        assert report["database"]["schema"]["current"] is None  # untouched
        await upgrade_to_head(plane.database.engine)  # the operator runs it
        await plane.check_schema()
        assert (await plane.readiness())[0] == []
    finally:
        await plane.stop()


async def test_the_embedded_database_is_migrated_at_start(tmp_path: Any) -> None:
    settings = Settings(data_dir=tmp_path / "state", redis_url="redis://unused")
    plane = ControlPlane(settings, FakeRedis(), "gw-test")
    started = time.monotonic()
    await plane.start()
    try:
        assert plane.embedded and plane.schema_at_head
        assert (tmp_path / "state" / "conveyor.db").exists()
        assert (await plane.readiness())[0] == []
        print(f"embedded database created and migrated in {time.monotonic() - started:.2f} s")
    finally:
        await plane.stop()
