"""GET /v1/requests/{id} and POST /v1/requests/{id}/cancel: where a request is (queued,
its position; running, on which worker; finished, why), for its key or an admin only."""

from __future__ import annotations

import time

import pytest

from gateway.control.records import UNLIMITED, Principal, Scope
from gateway.routes.requests import _find
from shared.errors import RequestNotFound
from shared.queue import names
from shared.roles import Role
from tests.gateway.fake_worker import silent
from tests.gateway.harness import BODIES, CHAT, LiveGateway


async def status_of(gateway: LiveGateway, request_id: str) -> dict[str, object]:
    response = await gateway.client.get(f"/v1/requests/{request_id}")
    assert response.status_code == 200, response.text
    body: dict[str, object] = response.json()
    return body


async def test_a_queued_stream_shows_its_position_and_a_cancel_ends_it(
    gateway: LiveGateway,
) -> None:
    await gateway.workers[0].stop()  # no taker
    body = {**BODIES[CHAT], "max_tokens": 3, "stream": True}
    # One after the other: two calls started together may be queued in either order. A
    # stream starts once its request is queued.
    async with gateway.call(CHAT, body) as first:
        assert await first.start() == 200
        async with gateway.call(CHAT, body) as second:
            assert await second.start() == 200
            request_id = second.headers["x-request-id"]
            status = await status_of(gateway, request_id)
            assert status["state"] == "queued"
            assert status["queue"] == {  # type: ignore[comparison-overlap]
                "stream": "conveyor:jobs:tiny:aggregated",
                "position": 2,
                "eta_s": None,  # nothing drained yet: no rate to go by
            }
            timestamps = status["timestamps"]
            assert isinstance(timestamps, dict)
            assert abs(timestamps["received_at"] - time.time()) < 30
            cancelled = await gateway.client.post(f"/v1/requests/{request_id}/cancel")
            assert cancelled.status_code == 200, cancelled.text
            assert cancelled.json()["cancel_requested"] is True
            text = await second.read_until("request_cancelled")
            assert "request_cancelled" in text
            await second.finished()
            assert (await status_of(gateway, first.headers["x-request-id"]))["queue"] == {
                "stream": "conveyor:jobs:tiny:aggregated",
                "position": 1,
                "eta_s": None,
            }
            first.leave()
    await gateway.state.cells.wait_background()
    status = await status_of(gateway, request_id)
    assert (status["state"], status["outcome"]) == ("finished", "cancelled")


async def test_a_finished_request_says_why(gateway: LiveGateway) -> None:
    response = await gateway.client.post(CHAT, json={**BODIES[CHAT], "max_tokens": 2})
    request_id = response.headers["x-request-id"]
    assert response.json()["id"] == request_id
    await gateway.state.cells.wait_background()
    status = await status_of(gateway, request_id)
    assert status["state"] == "finished"
    assert (status["outcome"], status["finish_reason"]) == ("completed", "length")
    assert status["migrations"] == 0
    timestamps = status["timestamps"]
    assert isinstance(timestamps, dict)
    assert timestamps["received_at"] <= timestamps["first_token_at"] <= timestamps["finished_at"]
    again = await gateway.client.post(f"/v1/requests/{request_id}/cancel")
    assert again.json()["cancel_requested"] is False


async def test_a_running_request_names_its_worker_stage_and_runs(gateway: LiveGateway) -> None:
    gateway.workers[0].script = silent
    async with gateway.call(CHAT, {**BODIES[CHAT], "stream": True}) as call:
        assert await call.start() == 200
        request_id = call.headers["x-request-id"]
        began_ms = int(time.time() * 1000)
        await gateway.redis.hset(  # what the run journal's begin script leaves
            names.job_run(f"{request_id}/0", Role.AGGREGATED),
            mapping={"owner": "worker-7/ab12cd34", "began_ms": began_ms, "starts": 2},
        )
        status = await status_of(gateway, request_id)
        assert status["state"] == "running"
        assert status["sequences"] == [
            {
                "index": 0,
                "stage": "aggregated",
                "worker": "worker-7",
                "started_at": began_ms / 1000,
                "runs": 2,
            }
        ]
        assert status["migrations"] == 1
        call.leave()


async def test_only_its_key_or_an_admin_sees_a_request(gateway: LiveGateway) -> None:
    response = await gateway.client.post(CHAT, json={**BODIES[CHAT], "max_tokens": 1})
    request_id = response.headers["x-request-id"]
    other = Principal("key-2", "other", frozenset({Scope.INFERENCE}), None, UNLIMITED)
    with pytest.raises(RequestNotFound):
        await _find(gateway.state, request_id, other)
    admin = Principal("key-3", "ops", frozenset({Scope.ADMIN}), None, UNLIMITED)
    _, status = await _find(gateway.state, request_id, admin)
    assert status.request_id == request_id
    missing = await gateway.client.get("/v1/requests/chatcmpl-nope")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "request_not_found"
