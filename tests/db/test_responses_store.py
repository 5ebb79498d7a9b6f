"""Stored /v1/responses with the control plane (SQLite and PostgreSQL): store, retrieve,
input items, delete, the previous_response_id chain, key isolation, retention."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from openai.types.responses import Response

from gateway.control import response_store
from gateway.control.records import Scope
from shared.queue import names
from tests.db.test_inference_auth import ADMIN_KEY, bearer, gateway, new_key
from tests.gateway.harness import LiveGateway, error_of

__all__ = ["gateway"]

RESPONSES = "/v1/responses"


async def create(live: LiveGateway, secret: str, **fields: object) -> Response:
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2, **fields}
    answer = await live.client.post(RESPONSES, json=body, headers=bearer(secret))
    assert answer.status_code == 200, answer.text
    return Response.model_validate(answer.json())


async def test_store_retrieve_input_items_delete(gateway: LiveGateway) -> None:
    key = await new_key(gateway, {Scope.INFERENCE})
    made = await create(gateway, key, stream=False)
    got = await gateway.client.get(f"{RESPONSES}/{made.id}", headers=bearer(key))
    assert Response.model_validate(got.json()).model_dump() == made.model_dump()
    items = (
        await gateway.client.get(f"{RESPONSES}/{made.id}/input_items", headers=bearer(key))
    ).json()
    assert items["object"] == "list" and items["has_more"] is False
    assert [i["content"] for i in items["data"]] == ["hi"]
    assert items["first_id"] == items["data"][0]["id"]
    gone = await gateway.client.delete(f"{RESPONSES}/{made.id}", headers=bearer(key))
    assert gone.json() == {"id": made.id, "object": "response.deleted", "deleted": True}
    error_of(await gateway.client.get(f"{RESPONSES}/{made.id}", headers=bearer(key)), 404)


async def test_a_streamed_response_is_stored(gateway: LiveGateway) -> None:
    key = await new_key(gateway, {Scope.INFERENCE})
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 2, "stream": True}
    streamed = await gateway.client.post(RESPONSES, json=body, headers=bearer(key))
    response_id = streamed.text.split('"id":"', 1)[1].split('"', 1)[0]
    got = await gateway.client.get(f"{RESPONSES}/{response_id}", headers=bearer(key))
    assert Response.model_validate(got.json()).status in ("completed", "incomplete")


async def test_previous_response_id_prepends_the_history(gateway: LiveGateway) -> None:
    key = await new_key(gateway, {Scope.INFERENCE})
    first = await create(gateway, key, input="first question")
    second = await create(gateway, key, input="second", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    prompt = gateway.workers[0].generate_jobs()[-1].prompt_token_ids
    assert len(prompt) > len(gateway.workers[0].generate_jobs()[-2].prompt_token_ids)


async def test_a_key_sees_only_its_own_responses(gateway: LiveGateway) -> None:
    mine = await new_key(gateway, {Scope.INFERENCE})
    other = await new_key(gateway, {Scope.INFERENCE})
    made = await create(gateway, mine)
    path = f"{RESPONSES}/{made.id}"
    error_of(await gateway.client.get(path, headers=bearer(other)), 404)
    error_of(await gateway.client.delete(path, headers=bearer(other)), 404)
    body = {"model": "tiny", "input": "x", "previous_response_id": made.id}
    refused = error_of(await gateway.client.post(RESPONSES, json=body, headers=bearer(other)), 404)
    assert refused["param"] == "previous_response_id"
    assert (await gateway.client.get(path, headers=bearer(ADMIN_KEY))).status_code == 200


async def test_store_false_keeps_nothing(gateway: LiveGateway) -> None:
    key = await new_key(gateway, {Scope.INFERENCE})
    made = await create(gateway, key, store=False)
    error_of(await gateway.client.get(f"{RESPONSES}/{made.id}", headers=bearer(key)), 404)


async def test_retention_purges_old_responses(gateway: LiveGateway) -> None:
    key = await new_key(gateway, {Scope.INFERENCE})
    made = await create(gateway, key)
    assert gateway.state.control is not None
    sessions = gateway.state.control.database.sessions
    later = datetime.now(UTC) + timedelta(days=31)
    await gateway.redis.delete(names.RESPONSES_RETENTION_LOCK)  # the plane's first round
    assert await response_store.purge_once(gateway.redis, sessions, 30, now=later) == 1
    assert await response_store.purge_once(gateway.redis, sessions, 30, now=later) is None
    error_of(await gateway.client.get(f"{RESPONSES}/{made.id}", headers=bearer(key)), 404)
