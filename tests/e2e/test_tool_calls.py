"""Tool calling on the real stack (shared gateway + vLLM worker, demo model), driven by
the unmodified openai SDK and LangChain. The demo model's text is noise and its chat
template knows nothing of tools: what is tested is what structured outputs force
(``required`` and a named function), the multi-turn loop, and the 400 of ``auto``."""

from __future__ import annotations

import json
from typing import Any, Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, ConfigDict

from tests.e2e.conftest import Running

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.redis]

PARAMS: dict[str, Any] = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Tokyo"]}, "days": {"enum": [1, 2, 3]}},
    "required": ["city", "days"],
    "additionalProperties": False,
}
WEATHER: Any = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Forecast", "parameters": PARAMS},
}
TIME: Any = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
SCHEMAS = {"get_weather": PARAMS, "get_time": TIME["function"]["parameters"]}
MESSAGES: Any = [{"role": "user", "content": "Weather in Paris?"}]
NAMED: Any = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture
def client(running: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0)


def _valid(name: str, arguments: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(arguments)
    jsonschema.validate(data, SCHEMAS[name])
    return data


def _ask(client: openai.OpenAI, running: Running, **fields: Any) -> Any:
    fields = {"max_tokens": 60, "temperature": 0, **fields}
    return client.chat.completions.create(
        model=running.model, messages=MESSAGES, tools=[WEATHER, TIME], **fields
    )


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_forced_calls_are_schema_valid(
    client: openai.OpenAI, running: Running, choice: Any
) -> None:
    result = _ask(client, running, tool_choice=choice, parallel_tool_calls=False)
    [made] = result.choices[0].message.tool_calls
    assert made.id.startswith("call_") and made.type == "function"
    if choice == NAMED:
        assert made.function.name == "get_weather"
    _valid(made.function.name, made.function.arguments)
    assert result.choices[0].finish_reason == "tool_calls"
    assert result.choices[0].message.content is None


@pytest.mark.parametrize("choice", ["required", NAMED], ids=["required", "named"])
def test_forced_calls_stream_in_the_openai_delta_shape(
    client: openai.OpenAI, running: Running, choice: Any
) -> None:
    chunks = list(_ask(client, running, tool_choice=choice, stream=True, parallel_tool_calls=False))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    parts = [tc for d in deltas for tc in d.tool_calls or []]
    first = parts[0]
    assert first.id and first.type == "function" and first.function.name
    assert all(p.id is None and p.index == 0 for p in parts[1:])
    arguments = "".join(p.function.arguments or "" for p in parts)
    _valid(first.function.name, arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_parallel_required_calls_are_each_valid(client: openai.OpenAI, running: Running) -> None:
    result = _ask(client, running, tool_choice="required", max_tokens=200)
    calls = result.choices[0].message.tool_calls
    assert calls
    complete = calls if result.choices[0].finish_reason == "tool_calls" else calls[:-1]
    for call in complete:
        _valid(call.function.name, call.function.arguments)


class GetWeather(BaseModel):
    """Forecast."""

    model_config = ConfigDict(extra="forbid")
    city: Literal["Paris", "Tokyo"]
    days: Literal[1, 2, 3]


def test_the_sdk_stream_helper_parses_a_strict_pydantic_tool(
    client: openai.OpenAI, running: Running
) -> None:
    tool = openai.pydantic_function_tool(GetWeather)
    named: Any = {"type": "function", "function": {"name": "GetWeather"}}
    with client.chat.completions.stream(
        model=running.model, messages=MESSAGES, tools=[tool], tool_choice=named, max_tokens=60,
        temperature=0,
    ) as stream:  # fmt: skip
        kinds = {event.type for event in stream}
        final = stream.get_final_completion()
    assert {"tool_calls.function.arguments.delta", "tool_calls.function.arguments.done"} <= kinds
    [call] = final.choices[0].message.tool_calls or []
    assert isinstance(call.function.parsed_arguments, GetWeather)


def test_a_three_turn_tool_loop(client: openai.OpenAI, running: Running) -> None:
    messages: list[Any] = list(MESSAGES)
    for turn, choice in enumerate(
        ["required", {"type": "function", "function": {"name": "get_time"}}]
    ):
        result = _ask_with(client, running, messages, choice)
        [call] = result.choices[0].message.tool_calls
        _valid(call.function.name, call.function.arguments)
        messages.append(result.choices[0].message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": f"result {turn}"})
    answer = _ask_with(client, running, messages, "none", max_tokens=5)
    assert answer.choices[0].message.content
    assert answer.choices[0].message.tool_calls is None


def _ask_with(
    client: openai.OpenAI, running: Running, messages: list[Any], choice: Any, max_tokens: int = 60
) -> Any:
    return client.chat.completions.create(
        model=running.model, messages=messages, tools=[WEATHER, TIME], tool_choice=choice,
        parallel_tool_calls=False, max_tokens=max_tokens, temperature=0,
    )  # fmt: skip


def test_auto_on_a_model_without_a_tool_format_is_a_400(
    client: openai.OpenAI, running: Running
) -> None:
    for fields in ({}, {"tool_choice": "auto"}):
        with pytest.raises(openai.BadRequestError) as caught:
            _ask(client, running, **fields)
        error: Any = caught.value.body
        assert error["param"] == "tool_choice"
        assert "tool-call format" in error["message"]


def test_langchain_bind_tools(running: Running) -> None:
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(
        model=running.model, base_url=f"{running.base_url}/v1", api_key="unused",  # type: ignore[arg-type]
        max_tokens=60, temperature=0, max_retries=0,  # type: ignore[call-arg]
    )  # fmt: skip
    bound = model.bind_tools([GetWeather], tool_choice="GetWeather")
    message = bound.invoke("Weather in Paris?")
    [call] = message.tool_calls  # type: ignore[attr-defined]
    assert call["name"] == "GetWeather"
    GetWeather.model_validate(call["args"])
    chunks = list(bound.stream("Weather in Tokyo?"))
    merged = chunks[0]
    for chunk in chunks[1:]:
        merged = merged + chunk  # type: ignore[assignment]
    [streamed] = merged.tool_calls  # type: ignore[attr-defined]
    GetWeather.model_validate(streamed["args"])
