"""A forced tool call (``tool_choice`` names a function) streamed through the chaos cluster
with the ``openai`` client, optionally with its worker SIGKILLed mid-arguments."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import openai

from tests.chaos.cluster import MODEL_NAME, Cluster
from tests.chaos.scenarios import kill_worker

NOTE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        # Long enough that the kill lands inside the arguments, bounded so it ends.
        "title": {"type": "string", "minLength": 120, "maxLength": 200},
        "priority": {"type": "integer"},
    },
    "required": ["title", "priority"],
    "additionalProperties": False,
}
TOOL: Any = {
    "type": "function",
    "function": {"name": "write_note", "description": "Save a note.", "parameters": NOTE_SCHEMA},
}
KILL_AFTER_CHARS = 24


@dataclass
class StreamedCall:
    ids: set[str] = field(default_factory=set)
    names: list[str] = field(default_factory=list)
    arguments: str = ""
    finish_reason: str | None = None
    killed: bool = False


async def forced_call(cluster: Cluster, *, kill: bool) -> StreamedCall:
    client = openai.AsyncOpenAI(base_url=f"{cluster.base_url}/v1", api_key="unused")
    call = StreamedCall()
    fault: asyncio.Task[None] | None = None
    try:
        stream = await client.chat.completions.create(
            model=MODEL_NAME,
            messages=[{"role": "user", "content": "Write a note about the weather."}],
            tools=[TOOL],
            tool_choice={"type": "function", "function": {"name": "write_note"}},
            temperature=0,
            max_tokens=1500,
            stream=True,
        )
        async for chunk in stream:
            for choice in chunk.choices:
                for delta in choice.delta.tool_calls or []:
                    call.ids |= {delta.id} if delta.id else set()
                    if delta.function is not None:
                        call.names += [delta.function.name] if delta.function.name else []
                        call.arguments += delta.function.arguments or ""
                call.finish_reason = choice.finish_reason or call.finish_reason
            if kill and fault is None and _running_somewhere(cluster, call):
                fault = asyncio.create_task(kill_worker(cluster))
                call.killed = True
    finally:
        if fault is not None:
            await fault
        await client.close()
    return call


def _running_somewhere(cluster: Cluster, call: StreamedCall) -> bool:
    """Kill once the arguments have begun and the job stream shows which worker runs them."""
    if len(call.arguments) < KILL_AFTER_CHARS:
        return False
    return any(cluster.jobs_held().values())
