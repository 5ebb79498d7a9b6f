"""``POST /v1/responses`` through the real gateway in process (fake workers): the response
and every streamed event validate against the ``openai`` package's own pydantic types."""

from __future__ import annotations

import json
from typing import Any

import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from tests.gateway.harness import LiveGateway, error_of
from tests.gateway.sse import events
from tests.gateway.test_tool_calls import HERMES_CALL, hermes_gateway, says

__all__ = ["hermes_gateway"]  # the fixture, used here

RESPONSES = "/v1/responses"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
EVENT = TypeAdapter(ResponseStreamEvent)


def stream_events(text: str) -> list[Any]:
    parsed = [e.data for e in events(text)]
    for number, event in enumerate(parsed):
        EVENT.validate_python(event)
        assert event["sequence_number"] == number
    return parsed


async def test_a_plain_input_answers_a_response(gateway: LiveGateway) -> None:
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 4, "instructions": "Be brief."}
    response = await gateway.client.post(RESPONSES, json=body)
    assert response.status_code == 200, response.text
    answer = Response.model_validate(response.json())
    assert answer.status in ("completed", "incomplete")
    assert answer.id.startswith("resp_")
    assert answer.output[0].type == "message"
    assert answer.output_text
    assert answer.usage is not None and answer.usage.input_tokens > 0
    assert answer.instructions == "Be brief."


async def test_a_stream_sends_openais_events(gateway: LiveGateway) -> None:
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 4, "stream": True}
    response = await gateway.client.post(RESPONSES, json=body)
    assert response.status_code == 200, response.text
    parsed = stream_events(response.text)
    kinds = [e["type"] for e in parsed]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert "response.output_text.delta" in kinds
    assert kinds[-1] in ("response.completed", "response.incomplete")
    final = Response.model_validate(parsed[-1]["response"])
    text = "".join(e["delta"] for e in parsed if e["type"] == "response.output_text.delta")
    assert final.output_text == text


async def test_a_function_call_round_trip(hermes_gateway: LiveGateway) -> None:
    await hermes_gateway.add_worker(script=says(*HERMES_CALL))
    body = {"model": "tiny", "input": "Paris?", "tools": [WEATHER], "max_output_tokens": 8}
    first = Response.model_validate((await hermes_gateway.client.post(RESPONSES, json=body)).json())
    call = next(item for item in first.output if item.type == "function_call")
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    hermes_gateway.workers[0].script = says("Sunny.")
    history = [
        {"role": "user", "content": "Paris?"},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
    ]
    second = await hermes_gateway.client.post(RESPONSES, json={**body, "input": history})
    assert Response.model_validate(second.json()).output_text == "Sunny."


async def test_a_streamed_function_call(hermes_gateway: LiveGateway) -> None:
    await hermes_gateway.add_worker(script=says(*HERMES_CALL))
    body = {"model": "tiny", "input": "Paris?", "tools": [WEATHER], "stream": True}
    parsed = stream_events((await hermes_gateway.client.post(RESPONSES, json=body)).text)
    kinds = [e["type"] for e in parsed]
    assert "response.function_call_arguments.delta" in kinds
    [done] = [e for e in parsed if e["type"] == "response.function_call_arguments.done"]
    assert json.loads(done["arguments"]) == {"city": "Paris"}
    final = Response.model_validate(parsed[-1]["response"])
    assert [item.type for item in final.output] == ["message", "function_call"]


async def test_text_format_json_schema_reaches_the_job(gateway: LiveGateway) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    body = {"model": "tiny", "input": "hi", "text": {"format": fmt}, "max_output_tokens": 4}
    response = await gateway.client.post(RESPONSES, json=body)
    answer = Response.model_validate(response.json())
    assert answer.text is not None and answer.text.format is not None
    assert answer.text.format.type == "json_schema"
    job = gateway.workers[0].generate_jobs()[-1]
    assert job.sampling.json_schema is not None and json.loads(job.sampling.json_schema) == schema


@pytest.mark.parametrize(
    ("field", "value"),
    [("include", ["reasoning.encrypted_content"]), ("top_logprobs", 2)],
)
async def test_unsupported_fields_are_refused_by_name(
    gateway: LiveGateway, field: str, value: Any
) -> None:
    body = {"model": "tiny", "input": "hi", field: value}
    error = error_of(await gateway.client.post(RESPONSES, json=body))
    assert error["param"] == field
