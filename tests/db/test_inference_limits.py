"""Per-key limits and the usage ledger on the request path: the real gateway in process
(fake workers, fakeredis) with the control plane on SQLite and PostgreSQL."""

from __future__ import annotations

from typing import Any

import pytest

from gateway.control.key_service import KeySpec
from gateway.control.records import BudgetPeriod, Limits, Scope
from gateway.images.fetch import ImageFetcher
from gateway.serving import translate
from shared.queue import names
from shared.queue.usage import decode_usage
from tests.db.test_inference_auth import bearer, gateway, queued  # noqa: F401 (fixture)
from tests.gateway.harness import BODIES, CHAT, COMPLETIONS, LiveGateway, error_of
from tests.waiting import eventually


async def limited_key(live: LiveGateway, limits: Limits) -> str:
    assert live.state.control is not None
    created = await live.state.control.key_service.create(
        KeySpec("limited", frozenset({Scope.INFERENCE}), None, limits)
    )
    await live.state.control.keys.reload()
    return created.secret


async def usage_rows(live: LiveGateway) -> list[Any]:
    entries: Any = await live.redis.xrange(names.USAGE_STREAM)
    return [decode_usage(fields) for _, fields in entries]


async def test_over_rpm_is_a_429_with_openai_headers(gateway: LiveGateway) -> None:  # noqa: F811
    secret = await limited_key(gateway, Limits(rpm=2))
    for remaining in ("1", "0"):
        ok = await gateway.client.post(
            COMPLETIONS, json=BODIES[COMPLETIONS], headers=bearer(secret)
        )
        assert ok.status_code == 200, ok.text
        assert ok.headers["x-ratelimit-limit-requests"] == "2"
        assert ok.headers["x-ratelimit-remaining-requests"] == remaining
    before = await queued(gateway)
    refused = await gateway.client.post(
        COMPLETIONS, json=BODIES[COMPLETIONS], headers=bearer(secret)
    )
    error = error_of(refused, 429)
    assert error["code"] == "rate_limit_exceeded"
    assert int(refused.headers["retry-after"]) >= 1
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert await queued(gateway) == before


async def test_over_tpm_reserves_max_tokens(gateway: LiveGateway) -> None:  # noqa: F811
    secret = await limited_key(gateway, Limits(tpm=50))
    body = {**BODIES[COMPLETIONS], "max_tokens": 60}
    error = error_of(await gateway.client.post(COMPLETIONS, json=body, headers=bearer(secret)), 429)
    assert error["code"] == "rate_limit_exceeded" and error["type"] == "tokens"


async def test_budget_gives_insufficient_quota(gateway: LiveGateway) -> None:  # noqa: F811
    secret = await limited_key(gateway, Limits(budget_tokens=4, budget_period=BudgetPeriod.DAY))
    error = error_of(
        await gateway.client.post(COMPLETIONS, json=BODIES[COMPLETIONS], headers=bearer(secret)),
        429,
    )
    assert error["code"] == "insufficient_quota" and error["type"] == "insufficient_quota"


async def test_concurrency_slot_returns_when_the_request_ends(
    gateway: LiveGateway,  # noqa: F811
) -> None:
    secret = await limited_key(gateway, Limits(max_concurrent=1))
    for _ in range(3):  # each request ends (its slot is given back) before the next
        response = await gateway.client.post(CHAT, json=BODIES[CHAT], headers=bearer(secret))
        assert response.status_code == 200, response.text

        async def slot_free() -> bool:
            return (
                int(await gateway.redis.zcard(names.key_concurrency(_key_id(gateway, secret)))) == 0
            )

        await eventually(slot_free, timeout_s=2.0, what="the concurrency slot to be given back")


async def test_one_usage_row_per_request_with_delivered_tokens(
    gateway: LiveGateway,  # noqa: F811
) -> None:
    secret = await limited_key(gateway, Limits(rpm=100))
    body = {**BODIES[COMPLETIONS], "max_tokens": 3, "n": 2}
    response = await gateway.client.post(COMPLETIONS, json=body, headers=bearer(secret))
    assert response.status_code == 200
    usage = response.json()["usage"]

    async def one_row() -> bool:
        return len(await usage_rows(gateway)) >= 1 or await _in_sql(gateway) >= 1

    await eventually(one_row, timeout_s=3.0, what="the usage row")

    async def in_sql() -> bool:
        return await _in_sql(gateway) == 1

    await eventually(in_sql, timeout_s=5.0, what="the ledger consumer to commit the row")
    listed = await gateway.client.get("/admin/usage", headers=bearer(_admin()))
    rows = [row for row in listed.json()["data"] if row["request_id"] == response.json()["id"]]
    assert len(rows) == 1
    assert rows[0]["completion_tokens"] == usage["completion_tokens"] == 6
    assert rows[0]["prompt_tokens"] == usage["prompt_tokens"]
    assert rows[0]["status"] == "completed"
    assert rows[0]["key_id"] == _key_id(gateway, secret)


async def test_idempotency_keys_are_per_api_key(gateway: LiveGateway) -> None:  # noqa: F811
    alice = await limited_key(gateway, Limits(rpm=100))
    bob = await limited_key(gateway, Limits(rpm=100))
    headers = {"Idempotency-Key": "order-1"}
    first = await gateway.client.post(CHAT, json=BODIES[CHAT], headers={**headers, **bearer(alice)})
    assert first.status_code == 200, first.text
    other = await gateway.client.post(CHAT, json=BODIES[CHAT], headers={**headers, **bearer(bob)})
    assert other.status_code == 200, other.text  # bob's key: bob's own namespace
    again = await gateway.client.post(CHAT, json=BODIES[CHAT], headers={**headers, **bearer(bob)})
    error = error_of(again, 409)
    assert other.json()["id"] in error["message"]
    assert first.json()["id"] not in error["message"]  # never another key's request id


def _key_id(live: LiveGateway, secret: str) -> str:
    assert live.state.control is not None
    principal: Any = live.state.control.keys.resolve(secret)
    key_id: str = principal.key_id
    return key_id


def _admin() -> str:
    from tests.db.test_inference_auth import ADMIN_KEY

    return ADMIN_KEY


async def _in_sql(live: LiveGateway) -> int:
    response = await live.client.get("/admin/usage", headers=bearer(_admin()))
    return len(response.json().get("data", []))


async def test_a_key_over_its_limit_costs_no_templating_or_fetch(
    gateway: LiveGateway,  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The key's counters are read before any work: the 429 (same headers as admission's)
    comes without the chat template, the tokenizer or an image fetch."""
    secret = await limited_key(gateway, Limits(rpm=1))
    ok = await gateway.client.post(CHAT, json=BODIES[CHAT], headers=bearer(secret))
    assert ok.status_code == 200, ok.text
    work: list[str] = []

    def spy(name: str, real: Any) -> Any:
        def called(*args: Any, **kwargs: Any) -> Any:
            work.append(name)
            return real(*args, **kwargs)

        return called

    monkeypatch.setattr(translate, "chat_prompt", spy("template", translate.chat_prompt))
    monkeypatch.setattr(
        translate, "completion_prompts", spy("tokenize", translate.completion_prompts)
    )
    monkeypatch.setattr(ImageFetcher, "fetch", spy("fetch", ImageFetcher.fetch))
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with_image = {**BODIES[CHAT], "messages": [{"role": "user", "content": [image]}]}
    before = await queued(gateway)
    for path, body in (
        (CHAT, BODIES[CHAT]),
        (COMPLETIONS, BODIES[COMPLETIONS]),
        (CHAT, with_image),
    ):
        refused = await gateway.client.post(path, json=body, headers=bearer(secret))
        error = error_of(refused, 429)
        assert (error["code"], error["type"]) == ("rate_limit_exceeded", "requests")
        assert int(refused.headers["retry-after"]) >= 1
        assert refused.headers["x-ratelimit-limit-requests"] == "1"
        assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert work == []
    assert await queued(gateway) == before


async def test_a_batch_is_charged_per_conversation(gateway: LiveGateway) -> None:  # noqa: F811
    secret = await limited_key(gateway, Limits(rpm=2))
    body = {**BODIES[CHAT], "messages": [BODIES[CHAT]["messages"]] * 2}
    batch = "/v1/chat/completions/batch"
    answered = await gateway.client.post(batch, json=body, headers=bearer(secret))
    assert answered.status_code == 200, answered.text
    assert answered.headers["x-ratelimit-remaining-requests"] == "0"
    refused = await gateway.client.post(batch, json=body, headers=bearer(secret))
    assert error_of(refused, 429)["code"] == "rate_limit_exceeded"

    batch_id = answered.headers["x-request-id"]

    async def two_rows() -> bool:
        # in the usage stream until the ledger consumer has moved them to SQL
        streamed = [row.request_id for row in await usage_rows(gateway)]
        listed = await gateway.client.get("/admin/usage", headers=bearer(_admin()))
        stored = [row["request_id"] for row in listed.json().get("data", [])]
        ours = sorted(r for r in {*streamed, *stored} if r.startswith(batch_id))
        return ours == [f"{batch_id}_0", f"{batch_id}_1"]

    await eventually(two_rows, what="one usage row per conversation")
