"""Streaming corners vLLM's server has: ``echo`` on a streamed completion (the prompt, and
with ``logprobs`` its scored tokens, in each choice's first chunk), and a grammar the
worker refuses answered as the request's 400 before the stream starts (real app in
process, fake workers, fakeredis)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from shared.errors import InvalidRequest
from shared.protocol import Event, Job, PromptLogprob, TokenEvent, TokenLogprob
from tests.gateway.fake_worker import error, finish, silent
from tests.gateway.harness import BODIES, CHAT, COMPLETIONS, LiveGateway, error_of
from tests.waiting import eventually

REGEX = {"structured_outputs": {"regex": "[a-z]+"}}


def chunks(text: str) -> list[dict[str, Any]]:
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: {")]
    return [json.loads(line) for line in lines]


async def scored(job: Job) -> AsyncIterator[Sequence[Event]]:
    """Two tokens, the first event carrying the prompt's logprobs (the worker's shape)."""
    prompt = job.prompt_token_ids
    rows: list[list[PromptLogprob] | None] = [None]
    rows += [[PromptLogprob(t, f"p{t}", -0.5, 1)] for t in prompt[1:]]
    first = TokenEvent(
        job.request_id, job.index, 0, 0, [7], "x ", [TokenLogprob(7, "x ", -1.0, [])], rows
    )
    second = TokenEvent(
        job.request_id, job.index, 1, 0, [8], "y ", [TokenLogprob(8, "y ", -2.0, [])]
    )
    yield [first]
    yield [second]
    yield [finish(job, 2, 2, "length")]


async def refuses_the_regex(job: Job) -> AsyncIterator[Sequence[Event]]:
    refusal = InvalidRequest("invalid regex", param="structured_outputs.regex")
    yield [error(job, 0, refusal)]


async def test_streamed_echo_starts_with_the_prompt(gateway: LiveGateway) -> None:
    body = {**BODIES[COMPLETIONS], "stream": True, "echo": True, "n": 2}
    response = await gateway.client.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    texts: dict[int, str] = {0: "", 1: ""}
    for chunk in chunks(response.text):
        for choice in chunk["choices"]:
            texts[choice["index"]] += choice["text"]
    assert texts == {0: "helloc0-0 c0-1 ", 1: "helloc1-0 c1-1 "}


async def test_streamed_echo_with_logprobs_scores_the_prompt_first(
    gateway: LiveGateway,
) -> None:
    gateway.workers[0].script = scored
    body = {**BODIES[COMPLETIONS], "stream": True, "echo": True, "logprobs": 1}
    response = await gateway.client.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    prompt_ids = gateway.workers[0].generate_jobs()[-1].prompt_token_ids
    first, second = (c["choices"][0] for c in chunks(response.text)[:2])
    assert first["text"] == "hello" + "x "
    logprobs = first["logprobs"]
    assert len(logprobs["tokens"]) == len(prompt_ids) + 1
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:] == [-0.5] * (len(prompt_ids) - 1) + [-1.0]
    assert second["text"] == "y " and second["logprobs"]["token_logprobs"] == [-2.0]
    assert second["logprobs"]["text_offset"] == [len(first["text"])]


async def test_streamed_echo_of_the_prompt_alone(gateway: LiveGateway) -> None:
    gateway.workers[0].script = scored
    body = {**BODIES[COMPLETIONS], "stream": True, "echo": True, "max_tokens": 0, "logprobs": 0}
    response = await gateway.client.post(COMPLETIONS, json=body)
    assert response.status_code == 200, response.text
    texts = [c["choices"][0]["text"] for c in chunks(response.text)]
    assert texts == ["hello", ""]  # the prompt, then the finish chunk: no generated token
    prompt_ids = gateway.workers[0].generate_jobs()[-1].prompt_token_ids
    tokens = chunks(response.text)[0]["choices"][0]["logprobs"]["tokens"]
    assert len(tokens) == len(prompt_ids)


async def test_a_refused_grammar_is_a_400_before_the_stream(gateway: LiveGateway) -> None:
    gateway.workers[0].script = refuses_the_regex
    for path in (CHAT, COMPLETIONS):
        body = {**BODIES[path], "stream": True, "n": 2, **REGEX}
        error = error_of(await gateway.client.post(path, json=body))
        assert error["param"] == "structured_outputs.regex"


async def test_a_valid_grammar_streams(gateway: LiveGateway) -> None:
    response = await gateway.client.post(CHAT, json={**BODIES[CHAT], "stream": True, **REGEX})
    assert response.status_code == 200, response.text
    assert response.text.endswith("data: [DONE]\n\n")
    assert (
        "".join(
            c["choices"][0]["delta"].get("content", "")
            for c in chunks(response.text)
            if c["choices"]
        )
        == "c0-0 c0-1 "
    )


async def test_leaving_before_the_first_event_closes_the_request(gateway: LiveGateway) -> None:
    gateway.workers[0].script = silent

    async def queued() -> bool:
        return len(gateway.workers[0].jobs) == 1

    async with gateway.call(CHAT, {**BODIES[CHAT], "stream": True, **REGEX}) as call:
        await eventually(queued, what="the job reached its worker")
        call.leave()
        await call.finished()

    async def closed() -> bool:
        return await gateway.open_requests() == 0

    await eventually(closed, what="the request closed")


async def test_plain_streams_do_not_wait_for_the_worker(gateway: LiveGateway) -> None:
    gateway.workers[0].script = silent
    async with gateway.call(CHAT, {**BODIES[CHAT], "stream": True}) as call:
        assert await call.start() == 200
        call.leave()


async def test_without_a_generation_prompt_the_answer_continues_the_last_role(
    gateway: LiveGateway,
) -> None:
    """vLLM's rule: with ``add_generation_prompt: false`` the answer's role is the last
    message's (the model continues that turn), streamed or not."""
    body = {**BODIES[CHAT], "add_generation_prompt": False}
    answer = (await gateway.client.post(CHAT, json=body)).json()
    assert answer["choices"][0]["message"]["role"] == "user"
    streamed = await gateway.client.post(CHAT, json={**body, "stream": True})
    assert chunks(streamed.text)[0]["choices"][0]["delta"]["role"] == "user"
    plain = (await gateway.client.post(CHAT, json=BODIES[CHAT])).json()
    assert plain["choices"][0]["message"]["role"] == "assistant"
