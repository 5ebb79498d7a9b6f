"""Reading an SSE body the way a client does."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

DONE = "[DONE]"


@dataclass(frozen=True)
class SseEvent:
    id: str | None
    data: Any
    """The decoded JSON, or ``"[DONE]"``."""


def parse_sse(text: str) -> list[SseEvent | str]:
    """Events, and comment lines (``": keep-alive"``) where they came."""
    items: list[SseEvent | str] = []
    for block in text.split("\n\n"):
        if not block:
            continue
        if block.startswith(":"):
            items.append(block)
            continue
        event_id = None
        data = None
        for line in block.split("\n"):
            field, _, value = line.partition(": ")
            if field == "id":
                event_id = value
            elif field == "data":
                data = value if value == DONE else json.loads(value)
        items.append(SseEvent(event_id, data))
    return items


def events(text: str) -> list[SseEvent]:
    return [item for item in parse_sse(text) if isinstance(item, SseEvent)]


def content(text: str, index: int = 0) -> str:
    """The text one chat choice streamed."""
    parts = []
    for event in events(text):
        if isinstance(event.data, dict):
            for choice in event.data.get("choices", []):
                if choice["index"] == index:
                    parts.append(choice.get("delta", {}).get("content") or choice.get("text", ""))
    return "".join(parts)
