"""The OpenAI Agents SDK (``openai-agents``) on the real stack (shared gateway + vLLM
worker, demo model) through ``/v1/responses`` with ``OpenAIResponsesModel``; and the
official SDK's background responses on the same stack.

The demo model's weights are random and its chat template knows no tools, so the agent
forces what a real model would choose: ``tool_choice="required"`` while no tool has
answered (structured outputs make the call valid), ``"none"`` for the answer after the
tool's output (the model has no tool-call format, so ``auto`` is refused there)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, Literal

import openai
import pytest
from agents import (
    Agent,
    ModelSettings,
    OpenAIResponsesModel,
    Runner,
    function_tool,
    set_tracing_disabled,
)
from agents.items import ToolCallItem, ToolCallOutputItem
from pydantic import BaseModel

from tests.e2e.conftest import Running

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.redis]

CALLS: list[str] = []


@function_tool
def get_weather(city: Literal["Paris", "Tokyo"]) -> str:
    """The weather of a city."""
    CALLS.append(city)
    return f"Sunny in {city}."


class Answer(BaseModel):
    weather: Literal["sunny", "rainy"]


class ForcedToolModel(OpenAIResponsesModel):
    """``tool_choice="required"`` until a tool has answered; then ``"none"`` and the
    agent's output schema (structured outputs end the answer: the model has no reason to
    stop by itself, and the Agents SDK takes an ``incomplete`` answer for an error)."""

    async def get_response(
        self,
        system_instructions: str | None,
        input: Any,
        model_settings: ModelSettings,
        tools: list[Any],
        output_schema: Any,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        answered = isinstance(input, list) and any(
            isinstance(item, dict) and item.get("type") == "function_call_output" for item in input
        )
        forced = ModelSettings(tool_choice="none" if answered else "required")
        return await super().get_response(
            system_instructions,
            input,
            model_settings.resolve(forced),
            tools,
            output_schema if answered else None,
            *args,
            **kwargs,
        )


@pytest.fixture
async def client(running: Running) -> AsyncIterator[openai.AsyncOpenAI]:
    async with openai.AsyncOpenAI(
        base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0
    ) as client:
        yield client


async def test_an_agent_runs_a_tool_turn(running: Running, client: openai.AsyncOpenAI) -> None:
    set_tracing_disabled(True)
    agent = Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[get_weather],
        model=ForcedToolModel(model=running.model, openai_client=client),
        model_settings=ModelSettings(max_tokens=120, temperature=0.0, parallel_tool_calls=False),
        output_type=Answer,
    )
    result = await Runner.run(agent, "Weather in Paris?", max_turns=3)
    kinds = [type(item) for item in result.new_items]
    assert ToolCallItem in kinds and ToolCallOutputItem in kinds
    assert CALLS and CALLS[-1] in ("Paris", "Tokyo")
    assert isinstance(result.final_output, Answer)
    assert len(result.raw_responses) == 2


async def test_background_cancel_and_streamed_retrieve(client: openai.AsyncOpenAI) -> None:
    model = "tiny"
    made = await client.responses.create(
        model=model, input="hi", background=True, max_output_tokens=16
    )
    assert made.status == "queued"
    deadline = time.monotonic() + 60
    final = made
    while final.status in ("queued", "in_progress") and time.monotonic() < deadline:
        final = await client.responses.retrieve(made.id)
    assert final.status in ("completed", "incomplete")
    events = [
        e async for e in await client.responses.retrieve(made.id, stream=True, starting_after=2)
    ]
    assert [e.sequence_number for e in events] == list(range(3, 3 + len(events)))
    long = await client.responses.create(
        model=model, input="hi", background=True, max_output_tokens=2000
    )
    cancelled = await client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert (await client.responses.retrieve(long.id)).status == "cancelled"
