"""A streamed response's events: chat deltas (:class:`~gateway.openai.output_parsing.ChoiceOutput`)
become Responses' typed events, one output item open at a time, each event numbered."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.openai.responses_api import (
    Json,
    ResponseDraft,
    call_item,
    item_id,
    message_item,
    output_text,
    reasoning_item,
)


@dataclass(slots=True)
class _OpenItem:
    kind: str
    """``reasoning``, ``message`` or ``function_call``."""
    id: str
    index: int
    text: str = ""
    call_id: str = ""
    name: str = ""


class ResponseEvents:
    """The events of one streamed response; ``output`` is its items so far."""

    def __init__(self, draft: ResponseDraft) -> None:
        self.draft = draft
        self.output: list[Json] = []
        self._seq = 0
        self._open: _OpenItem | None = None

    def _id(self, prefix: str, index: int) -> str:
        return item_id(prefix, self.draft.id, index)

    @property
    def next_sequence_number(self) -> int:
        return self._seq

    def _event(self, kind: str, **fields: object) -> Json:
        body: Json = {"type": kind, **fields, "sequence_number": self._seq}
        self._seq += 1
        return body

    def start(self) -> list[Json]:
        body = self.draft.body("in_progress", [])
        return [
            self._event("response.created", response=body),
            self._event("response.in_progress", response=body),
        ]

    def feed(self, delta: Json) -> list[Json]:
        """The events of one chat delta (reasoning_content, content, tool_calls)."""
        events: list[Json] = []
        if delta.get("reasoning_content"):
            events += self._text("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._text("message", delta["content"])
        for call in delta.get("tool_calls", ()):
            if "id" in call:
                events += self._close()
                function = call["function"]
                events += self._open_call(call["id"], function["name"])
            arguments = call.get("function", {}).get("arguments", "")
            if arguments and self._open is not None:
                self._open.text += arguments
                events.append(self._item_event("response.function_call_arguments.delta", arguments))
        return events

    def finish(self, status: str, usage: Json, incomplete: str | None) -> list[Json]:
        events = self._close()
        body = self.draft.body(status, self.output, usage, incomplete=incomplete)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*events, self._event(kind, response=body)]

    def fail(self, message: str) -> list[Json]:
        events = self._close("incomplete")
        error = {"code": "server_error", "message": message}
        body = self.draft.body("failed", self.output, error=error)
        return [*events, self._event("response.failed", response=body)]

    def _text(self, kind: str, text: str) -> list[Json]:
        events: list[Json] = []
        if self._open is None or self._open.kind != kind:
            events += self._close()
            events += self._open_text(kind)
        assert self._open is not None
        self._open.text += text
        event = (
            "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        )
        extra: dict[str, object] = {"logprobs": []} if kind == "message" else {}
        events.append(self._item_event(event, text, content_index=0, **extra))
        return events

    def _item_event(self, kind: str, delta: str, **fields: object) -> Json:
        assert self._open is not None
        item = {"item_id": self._open.id, "output_index": self._open.index}
        return self._event(kind, **item, **fields, delta=delta)

    def _open_text(self, kind: str) -> list[Json]:
        index = len(self.output)
        if kind == "message":
            item = _OpenItem(kind, self._id("msg", index), index)
            added = message_item(item.id, None, "in_progress")
            part = output_text("")
        else:
            item = _OpenItem(kind, self._id("rs", index), index)
            added = reasoning_item(item.id, "", "in_progress")
            added["content"] = []
            part = {"type": "reasoning_text", "text": ""}
        self._open = item
        self.output.append(added)
        ids = {"item_id": item.id, "output_index": index, "content_index": 0}
        return [
            self._event("response.output_item.added", output_index=index, item=added),
            self._event("response.content_part.added", **ids, part=part),
        ]

    def _open_call(self, call_id: str, name: str) -> list[Json]:
        index = len(self.output)
        call_id = self._id("call", index)  # not the parser's: the same when rendered again
        self._open = _OpenItem(
            "function_call", self._id("fc", index), index, call_id=call_id, name=name
        )
        added = call_item(self._open.id, call_id, name, "", "in_progress")
        self.output.append(added)
        return [self._event("response.output_item.added", output_index=index, item=added)]

    def _close(self, status: str = "completed") -> list[Json]:
        item, self._open = self._open, None
        if item is None:
            return []
        ids = {"item_id": item.id, "output_index": item.index}
        events: list[Json] = []
        if item.kind == "function_call":
            done = call_item(item.id, item.call_id, item.name, item.text, status)
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    **ids,
                    name=item.name,
                    arguments=item.text,
                )
            )
        elif item.kind == "message":
            done = message_item(item.id, item.text, status)
            part = output_text(item.text)
            events.append(
                self._event(
                    "response.output_text.done", **ids, content_index=0, text=item.text, logprobs=[]
                )
            )
            events.append(
                self._event("response.content_part.done", **ids, content_index=0, part=part)
            )
        else:
            done = reasoning_item(item.id, item.text, status)
            part = {"type": "reasoning_text", "text": item.text}
            events.append(
                self._event("response.reasoning_text.done", **ids, content_index=0, text=item.text)
            )
            events.append(
                self._event("response.content_part.done", **ids, content_index=0, part=part)
            )
        self.output[item.index] = done
        events.append(self._event("response.output_item.done", output_index=item.index, item=done))
        return events
