"""Tool calls and reasoning through the real gateway in process: fake workers write a
model's text token by token; the client sees OpenAI's tool_calls, whole and streamed
(also through the unmodified openai SDK's stream helper)."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import openai
import pytest
from msgspec.structs import replace

from gateway.catalog.served_models import ServedModel
from gateway.openai.output_formats import OutputFormats
from shared.protocol import Event, GenerateJob, Job
from tests.gateway.fake_worker import finish, token
from tests.gateway.harness import CHAT, LiveGateway, live_gateway
from tests.gateway.sse import events

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
ARGS = '{"city": "Paris"}'
HERMES_CALL = ["Checking.", "\n<tool", "_call>\n", '{"name": "get_weather", ', '"arguments": ',
               '{"city": ', '"Paris"}', "}\n</tool_call>"]  # fmt: skip
USER = [{"role": "user", "content": "Paris?"}]


def says(*pieces: str, reason: str = "stop") -> Callable[[Job], AsyncIterator[Sequence[Event]]]:
    async def script(job: Job) -> AsyncIterator[Sequence[Event]]:
        for seq, piece in enumerate(pieces):
            yield [token(job, seq, piece)]
        yield [finish(job, len(pieces), len(pieces), reason)]

    return script


@pytest.fixture
async def hermes_gateway(served_model: ServedModel) -> AsyncIterator[LiveGateway]:
    """``tiny`` as a model whose template renders hermes tool calls and <think>."""
    model = dataclasses.replace(served_model, output_formats=OutputFormats("hermes", True))
    async with live_gateway(model, workers=()) as live:
        yield live


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": USER, "max_tokens": 8, "tools": [WEATHER], **fields}


async def test_auto_returns_tool_calls_and_finish_reason_tool_calls(
    hermes_gateway: LiveGateway,
) -> None:
    await hermes_gateway.add_worker(script=says(*HERMES_CALL))
    response = await hermes_gateway.client.post(CHAT, json=chat())
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    message = choice["message"]
    assert message["content"] == "Checking."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": ARGS}


async def test_auto_streams_the_openai_delta_shape(hermes_gateway: LiveGateway) -> None:
    await hermes_gateway.add_worker(script=says(*HERMES_CALL))
    response = await hermes_gateway.client.post(CHAT, json=chat(stream=True))
    chunks = [e.data for e in events(response.text)[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks]
    content = "".join(d.get("content") or "" for d in deltas)
    assert content == "Checking."
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    first, *rest = calls
    assert set(first) == {"index", "id", "type", "function"}
    assert first["function"]["name"] == "get_weather" and first["index"] == 0
    assert all(set(c) == {"index", "function"} for c in rest)
    assert len(rest) >= 2  # the arguments arrive in fragments, as generated
    assert "".join(c["function"]["arguments"] for c in calls) == ARGS
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
    assert all("<tool" not in (d.get("content") or "") for d in deltas)


async def test_the_openai_sdk_stream_helper_assembles_the_call(
    hermes_gateway: LiveGateway,
) -> None:
    await hermes_gateway.add_worker(script=says(*HERMES_CALL))
    client = openai.AsyncOpenAI(
        base_url="http://gw/v1",
        api_key="x",
        http_client=hermes_gateway.client,  # type: ignore[arg-type]
    )
    async with client.chat.completions.stream(
        model="tiny",
        messages=USER,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        max_tokens=8,
    ) as stream:
        kinds = [event.type async for event in stream]
        final = await stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in kinds
    assert "tool_calls.function.arguments.done" in kinds
    [call] = final.choices[0].message.tool_calls or []
    assert (call.function.name, call.function.arguments) == ("get_weather", ARGS)
    assert final.choices[0].finish_reason == "tool_calls"


async def test_reasoning_is_split_from_content(hermes_gateway: LiveGateway) -> None:
    pieces = ["<th", "ink>Sunny", " usually.</thi", "nk>\n\nIt is", " sunny."]
    await hermes_gateway.add_worker(script=says(*pieces))
    whole = await hermes_gateway.client.post(CHAT, json=chat(tools=None))
    message = whole.json()["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": "\n\nIt is sunny.",
        "reasoning_content": "Sunny usually.",
    }
    streamed = await hermes_gateway.client.post(CHAT, json=chat(tools=None, stream=True))
    deltas = [e.data["choices"][0]["delta"] for e in events(streamed.text)[:-1]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "Sunny usually."
    assert "".join(d.get("content") or "" for d in deltas) == "\n\nIt is sunny."


async def test_required_forces_a_call_array_on_a_model_without_a_tool_format(
    gateway: LiveGateway,
) -> None:
    output = '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    gateway.workers[0].script = says(output[:20], output[20:])
    body = chat(tool_choice="required", parallel_tool_calls=False)
    response = await gateway.client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    [call] = response.json()["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": ARGS}
    job = gateway.workers[0].generate_jobs()[-1]
    schema = json.loads(job.sampling.json_schema or "")
    assert schema["type"] == "array" and schema["maxItems"] == 1
    [branch] = schema["items"]["anyOf"]
    assert branch["properties"]["name"] == {"type": "string", "enum": ["get_weather"]}
    assert branch["properties"]["parameters"] == WEATHER["function"]["parameters"]  # type: ignore[index]


async def test_a_named_function_forces_its_arguments(gateway: LiveGateway) -> None:
    gateway.workers[0].script = says('{"city": ', '"Paris"}')
    named = {"type": "function", "function": {"name": "get_weather"}}
    response = await gateway.client.post(CHAT, json=chat(tool_choice=named, stream=True))
    deltas = [e.data["choices"][0] for e in events(response.text)[:-1]]
    calls = [tc for d in deltas for tc in d["delta"].get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather"
    assert "".join(c["function"]["arguments"] for c in calls) == ARGS
    assert deltas[-1]["finish_reason"] == "tool_calls"
    job: GenerateJob = gateway.workers[0].generate_jobs()[-1]
    assert json.loads(job.sampling.json_schema or "") == WEATHER["function"]["parameters"]  # type: ignore[index]


async def test_a_tool_loop_history_renders_into_the_prompt(gateway: LiveGateway) -> None:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": ARGS}}  # fmt: skip
    history = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 24 C"},
    ]
    body = chat(messages=history, tool_choice="required", max_tokens=1)
    response = await gateway.client.post(CHAT, json=body)
    assert response.status_code == 200, response.text
    job = gateway.workers[0].generate_jobs()[-1]
    served: ServedModel = gateway.state.catalog.get("tiny")
    assert "sunny, 24 C" in served.tokenizer.decode(job.prompt_token_ids)


async def test_length_cut_call_keeps_finish_reason_length(hermes_gateway: LiveGateway) -> None:
    await hermes_gateway.add_worker(script=says(*HERMES_CALL[:6], reason="length"))
    response = await hermes_gateway.client.post(CHAT, json=chat())
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"city": '


async def test_a_call_cut_by_a_migration_still_arrives_whole(hermes_gateway: LiveGateway) -> None:
    """Attempt 0 dies mid-call; attempt 1 (another worker) goes on from the seq the
    journal kept (a retried write repeats one event): the parse runs on the delivered
    text."""

    async def migrated(job: Job) -> AsyncIterator[Sequence[Event]]:
        for seq in range(5):
            yield [replace(token(job, seq, HERMES_CALL[seq]), attempt=0)]
        yield [replace(token(job, 4, HERMES_CALL[4]), attempt=0)]
        for seq in range(5, len(HERMES_CALL)):
            yield [replace(token(job, seq, HERMES_CALL[seq]), attempt=1)]
        yield [replace(finish(job, len(HERMES_CALL), 8), attempt=1)]

    await hermes_gateway.add_worker(script=migrated)
    response = await hermes_gateway.client.post(CHAT, json=chat(stream=True))
    deltas = [e.data["choices"][0]["delta"] for e in events(response.text)[:-1]]
    calls = [tc for d in deltas for tc in d.get("tool_calls", [])]
    assert [c["id"] for c in calls if "id" in c] and calls[0]["function"]["name"] == "get_weather"
    assert json.loads("".join(c["function"]["arguments"] for c in calls)) == json.loads(ARGS)
