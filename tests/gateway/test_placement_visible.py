"""Cache-aware placement as the gateway shows it: the prefix index in /admin/state, the
decisions in /metrics, and ``prompt_cache_key`` taken by the OpenAI routes."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi.testclient import TestClient

from gateway.catalog.served_models import ServedModel
from gateway.openai.responses_schema import ResponsesRequest
from gateway.placement.placer import Candidate, PlacementRequest
from gateway.serving.responses_input import chat_request
from shared.queue.kv_events import KvBatch, KvEventWriter, StoredBlocks
from shared.roles import Role
from shared.tasks import cancel_and_wait
from tests.gateway.harness import (
    BODIES,
    CHAT,
    COMPLETIONS,
    LiveGateway,
    build_gateway,
    error_of,
    passed_every_check,
)
from tests.waiting import eventually


async def test_admin_state_shows_indexed_blocks(gateway: LiveGateway) -> None:
    cell = gateway.state.cells.home
    assert cell.placement is not None
    worker_id = "aggregated-test-tiny-x"  # registered by the harness: alive
    batch = KvBatch(worker_id, "tiny", 4, 0, [StoredBlocks([1, 2], None, list(range(8)))])
    await KvEventWriter(cell.redis, worker_id).publish(batch)
    feeder = asyncio.create_task(cell.placement.feeder.run())
    try:

        async def indexed() -> bool:
            state = (await gateway.client.get("/admin/state")).json()
            return bool(state["placement_index"]["workers"] == {worker_id: 2})

        await eventually(indexed, what="the worker's 2 blocks in /admin/state")
    finally:
        await cancel_and_wait([feeder])


async def test_placements_are_counted(gateway: LiveGateway) -> None:
    placement = gateway.state.cells.home.placement
    assert placement is not None
    request = PlacementRequest("tiny", Role.AGGREGATED, None, list(range(9)))
    placement.placer.place(request, [Candidate("w1", 0, 0, 8, 0.0, 0)])
    placement.placer.place(request, [])
    text = (await gateway.client.get("/metrics")).text
    assert 'conveyor_placements_total{model_name="tiny",reason="load"} 1.0' in text
    assert 'conveyor_placements_total{model_name="tiny",reason="shared"} 1.0' in text
    assert 'conveyor_placement_matched_blocks_count{model_name="tiny"} 1.0' in text


def test_prompt_cache_key_is_accepted(served_model: ServedModel) -> None:
    gw = build_gateway(served_model, workers=True, request_timeout_s=0.05)
    with TestClient(gw.app) as client:
        for path in (CHAT, COMPLETIONS):
            passed_every_check(client.post(path, json={**BODIES[path], "prompt_cache_key": "t1"}))
            long_key = {**BODIES[path], "prompt_cache_key": "k" * 1025}
            assert error_of(client.post(path, json=long_key))["param"] == "prompt_cache_key"


def test_the_plan_carries_prompt_cache_key(served_model: ServedModel) -> None:
    gw = build_gateway(served_model, workers=True, request_timeout_s=0.05)
    dispatcher = gw.state.cells.home.dispatcher
    submit = dispatcher.submit
    seen: list[str | None] = []

    async def spy(plan: Any) -> Any:
        seen.append(plan.cache_key)
        return await submit(plan)

    dispatcher.submit = spy  # type: ignore[method-assign]
    with TestClient(gw.app) as client:
        client.post(CHAT, json={**BODIES[CHAT], "prompt_cache_key": "t1"})
        client.post(COMPLETIONS, json=BODIES[COMPLETIONS])
    assert seen == ["t1", None]


def test_responses_carry_prompt_cache_key() -> None:
    body = ResponsesRequest(model="tiny", input="hi", prompt_cache_key="tenant-7")
    assert chat_request(body, []).prompt_cache_key == "tenant-7"
