"""vLLM's ``POST /v1/chat/completions/batch``: the real app in process, fake workers,
fakeredis. One job per conversation, one ``chat.completion`` answer, choice ``i`` for
conversation ``i``, the usage of all of them; every refusal a 400 before anything is
queued."""

from __future__ import annotations

from typing import Any

import pytest

from tests.gateway.fake_worker import silent
from tests.gateway.harness import LiveGateway, error_of
from tests.waiting import eventually

BATCH = "/v1/chat/completions/batch"
CONVERSATIONS = [
    [{"role": "user", "content": "hello"}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}],
    [{"role": "user", "content": "a third"}],
]


def batch(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": CONVERSATIONS, "max_tokens": 2, **fields}


async def test_one_choice_per_conversation(gateway: LiveGateway) -> None:
    response = await gateway.client.post(BATCH, json=batch(return_token_ids=True))
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion" and body["id"].startswith("chatcmpl-")
    assert response.headers["X-Request-Id"] == body["id"]
    assert [choice["index"] for choice in body["choices"]] == [0, 1, 2]
    for choice in body["choices"]:
        assert choice["message"]["role"] == "assistant"
        assert choice["message"]["content"] == "c0-0 c0-1 "  # each is its own request
        assert choice["finish_reason"] == "length" and len(choice["token_ids"]) == 2
    jobs = gateway.workers[0].generate_jobs()
    assert len(jobs) == 3
    assert sorted(job.request_id for job in jobs) == [f"{body['id']}_{i}" for i in range(3)]
    prompts = sorted(len(job.prompt_token_ids) for job in jobs)
    usage = body["usage"]
    assert usage["prompt_tokens"] == sum(prompts)
    assert usage["completion_tokens"] == 6
    assert usage["total_tokens"] == sum(prompts) + 6


async def test_each_conversation_is_templated_as_a_chat_completion(
    gateway: LiveGateway,
) -> None:
    for messages in CONVERSATIONS:
        single = {"model": "tiny", "messages": messages, "max_tokens": 1}
        assert (await gateway.client.post("/v1/chat/completions", json=single)).is_success
    singles = [job.prompt_token_ids for job in gateway.workers[0].generate_jobs()]
    response = await gateway.client.post(BATCH, json=batch(max_tokens=1))
    assert response.status_code == 200, response.text
    jobs = sorted(gateway.workers[0].generate_jobs()[3:], key=lambda job: job.request_id)
    assert [job.prompt_token_ids for job in jobs] == singles


async def test_echo_uses_each_conversations_last_message(gateway: LiveGateway) -> None:
    conversations = [
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "first "}],
        [{"role": "user", "content": "q"}, {"role": "assistant", "content": "second "}],
    ]
    body = batch(messages=conversations, echo=True, max_tokens=1)
    answer = (await gateway.client.post(BATCH, json=body)).json()
    contents = [choice["message"]["content"] for choice in answer["choices"]]
    assert contents == ["first c0-0 ", "second c0-0 "]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stream": True}, "stream"),
        ({"n": 2}, "n"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}]}, "messages[0]"),
        ({"messages": [CONVERSATIONS[0], []]}, "messages[1]"),
        ({"messages": [CONVERSATIONS[0], [{"role": "user"}]]}, "messages[1][0]"),
        ({"temperature": 9}, "temperature"),
    ],
)
async def test_bad_batches_are_refused_before_anything_is_queued(
    gateway: LiveGateway, fields: dict[str, Any], param: str
) -> None:
    error = error_of(await gateway.client.post(BATCH, json=batch(**fields)))
    assert error["param"] == param, error
    assert gateway.workers[0].generate_jobs() == []


async def test_garbled_and_unknown_model(gateway: LiveGateway) -> None:
    garbled = await gateway.client.post(BATCH, content=b"{nope")
    assert error_of(garbled)["message"] == "The request body is not valid JSON."
    assert error_of(await gateway.client.post(BATCH, json=[1]))["param"] is None
    unknown = await gateway.client.post(BATCH, json=batch(model="nope"))
    assert error_of(unknown, 404)["code"] == "model_not_found"


async def test_a_repeated_idempotency_key_refuses_the_whole_batch(
    gateway: LiveGateway,
) -> None:
    headers = {"Idempotency-Key": "batch-1"}
    assert (await gateway.client.post(BATCH, json=batch(), headers=headers)).is_success
    again = await gateway.client.post(BATCH, json=batch(), headers=headers)
    assert again.status_code == 409, again.text
    assert len(gateway.workers[0].generate_jobs()) == 3


async def test_leaving_cancels_every_conversation(gateway: LiveGateway) -> None:
    gateway.workers[0].script = silent

    async def queued() -> bool:
        return len(gateway.workers[0].jobs) == 3

    async with gateway.call(BATCH, batch()) as call:
        await eventually(queued, what="every conversation reached the worker")
        assert await gateway.open_requests() == 3
        call.leave()

    async def closed() -> bool:
        return await gateway.open_requests() == 0

    await eventually(closed, timeout_s=2.0, what="every conversation closed")
