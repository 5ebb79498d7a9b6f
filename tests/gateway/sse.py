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
    """Events, and comment lines (``": keep-alive"``) where they came, read line by line
    as the SSE spec says (a blank line ends an event)."""
    items: list[SseEvent | str] = []
    event_id: str | None = None
    data: str | None = None
    for line in text.split("\n"):
        if line.startswith(":"):
            items.append(line)
        elif line:
            field, _, value = line.partition(": ")
            if field == "id":
                event_id = value
            elif field == "data":
                data = value
        elif data is not None:
            items.append(SseEvent(event_id, data if data == DONE else json.loads(data)))
            event_id, data = None, None
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
