"""Responses API objects (``response``, its output items, its stream events) built from a
chat choice's parsed output.

The chat path's parser (:mod:`gateway.openai.output_parsing`) reads the model's text into
reasoning, content and tool calls; here a whole parse becomes output items, and a
stream's chat deltas become Responses' typed events, each with its ``sequence_number``.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from gateway.openai.output_parsing import Parsed

Json = dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def item_id(prefix: str, response_id: str, index: int) -> str:
    """An output item's id, a function of its response and place: a response's events
    rendered again (a resumed background response) name the same items."""
    digest = hashlib.sha256(f"{response_id}:{index}".encode()).hexdigest()[:32]
    return f"{prefix}_{digest}"


def response_id_of(request_id: str) -> str:
    """The response id of a request (``chatcmpl-{hex}`` -> ``resp_{hex}``)."""
    return f"resp_{request_id.rpartition('-')[2]}"


def request_id_of(response_id: str) -> str:
    return f"chatcmpl-{response_id.removeprefix('resp_')}"


@dataclass(slots=True)
class ResponseDraft:
    """What a response echoes of its request; ``body`` renders it with an outcome."""

    id: str
    model: str
    request: Json
    """The echoed request fields (instructions, tools, tool_choice, text, ...)."""
    created_at: int = field(default_factory=lambda: int(time.time()))
    background: bool = False

    def body(
        self,
        status: str,
        output: list[Json],
        usage: Json | None = None,
        *,
        error: Json | None = None,
        incomplete: str | None = None,
    ) -> Json:
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "background": self.background,
            "error": error,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "model": self.model,
            "output": output,
            "usage": usage,
            **self.request,
        }


def echoed_fields(body: Any) -> Json:
    """The request's fields a response carries, in OpenAI's shape (``body``: the
    :class:`~gateway.openai.responses_schema.ResponsesRequest`)."""
    tools = [{"strict": True, **t.model_dump(exclude_none=True)} for t in body.tools or []]
    fmt = body.text.format if body.text and body.text.format else None
    return {
        "instructions": body.instructions,
        "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {},
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "reasoning": {"effort": None, "summary": None}
        if body.reasoning is None
        else body.reasoning.model_dump(include={"effort", "summary"}),
        "store": body.store,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True)}
        if fmt
        else {"format": {"type": "text"}},
        "tool_choice": _tool_choice(body.tool_choice),
        "tools": tools,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "truncation": body.truncation or "disabled",
        "user": body.user,
    }


def _tool_choice(choice: Any) -> Any:
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else {"type": "function", "name": choice.name}


def usage(prompt: int, completion: int, cached: int | None) -> Json:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached or 0, "cache_write_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def status_of(finish_reason: str | None) -> tuple[str, str | None]:
    """The response's status and incomplete reason for the engine's finish reason."""
    if finish_reason == "length":
        return "incomplete", "max_output_tokens"
    return "completed", None


# ------------------------------------------------------------------------ output items


def reasoning_item(item_id: str, text: str, status: str) -> Json:
    content = [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def message_item(item_id: str, text: str | None, status: str) -> Json:
    content = [] if text is None else [output_text(text)]
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": content,
    }


def output_text(text: str) -> Json:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> Json:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def output_items(parsed: Parsed, status: str) -> list[Json]:
    """A whole parse as output items: reasoning, then the message, then the calls."""
    items: list[Json] = []
    if parsed.reasoning:
        items.append(reasoning_item(new_id("rs"), parsed.reasoning, status))
    if parsed.content or not parsed.calls:
        items.append(message_item(new_id("msg"), parsed.content, status))
    for call in parsed.calls:
        call_id = new_id("call")
        items.append(call_item(new_id("fc"), call_id, call.name, call.arguments, status))
    return items
