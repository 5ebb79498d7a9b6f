"""A chat choice's generated text -> reasoning, content and tool calls, whole or streamed.

:class:`OutputParser` reads the text so far (reasoning first, then the tool-call
format on what follows it); :class:`ChoiceOutput` keeps one streamed choice's text
and turns each new parse into an OpenAI delta carrying only what grew. Parsing runs
in the gateway, on the text as delivered: a migrated stream's text arrives whole,
whichever worker produced each part (see :mod:`gateway.openai.tool_parsers` for why not in
the workers, nor with vLLM's parsers).
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from gateway.openai.json_scan import skip_whitespace
from gateway.openai.open_tail import OpenTail, TailFollower, follow, hold_tag_prefix
from gateway.openai.tool_parsers import CallText, ToolParse, ToolParser

log = logging.getLogger(__name__)

Json = dict[str, Any]
REASONING_START = "<think>"
REASONING_END = "</think>"


@dataclass(frozen=True, slots=True)
class Parsed:
    reasoning: str = ""
    content: str = ""
    calls: tuple[CallText, ...] = ()
    tail: OpenTail | None = field(default=None, compare=False)
    """Not final: where the text goes on verbatim (see :mod:`gateway.openai.open_tail`)."""


@dataclass(frozen=True, slots=True)
class _Split:
    reasoning: str
    rest: int | None
    """Where the text after the reasoning starts; None: nothing placed there yet."""
    tail: OpenTail | None = None


@dataclass(frozen=True, slots=True)
class OutputParser:
    """How one request's choices are read."""

    tools: ToolParser | None = None
    """The tool-call format (None: the text is content)."""
    reasoning: bool = False
    """Split ``<think>...</think>`` off as reasoning."""
    starts_in_reasoning: bool = False
    """The prompt ends inside ``<think>`` (the template opened it): no start tag comes."""

    def parse(self, text: str, final: bool) -> Parsed:
        split = self._split_reasoning(text, final) if self.reasoning else _Split("", 0)
        rest = "" if split.rest is None else text[split.rest :] if split.rest else text
        if self.tools is None:
            found = ToolParse(rest, (), OpenTail(0, "content"))
        else:
            found = self.tools(rest, final)
        return Parsed(split.reasoning, found.content, found.calls, _tail(split, found, final))

    def _split_reasoning(self, text: str, final: bool) -> _Split:
        start = 0
        if not self.starts_in_reasoning:
            lead = skip_whitespace(text, 0)
            if text.startswith(REASONING_START, lead):
                start = lead + len(REASONING_START)
            elif not final and REASONING_START.startswith(text[lead:]):
                return _Split("", None)  # may yet be the start tag
            else:
                return _Split("", 0)
        end = text.find(REASONING_END, start)
        if end >= 0:
            return _Split(text[start:end], end + len(REASONING_END))
        if final:
            return _Split(text[start:], None)
        reasoning = hold_tag_prefix(text[start:], REASONING_END)
        return _Split(reasoning, None, OpenTail(start, "reasoning", REASONING_END))


def _tail(split: _Split, found: ToolParse, final: bool) -> OpenTail | None:
    if final:
        return None
    if split.rest is None:
        return split.tail
    return found.tail.shifted(split.rest) if found.tail is not None else None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _growth(sent: str, now: str, what: str) -> str:
    if now.startswith(sent):
        return now[len(sent) :]
    log.error("BUG: the parsed %s shrank while streaming (%r -> %r)", what, sent, now)
    return ""


class _Text:
    """Text built by appending, joined only when read."""

    __slots__ = ("_pieces",)

    def __init__(self, text: str = "") -> None:
        self._pieces = [text] if text else []

    def append(self, piece: str) -> None:
        self._pieces.append(piece)

    def value(self) -> str:
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""


class ChoiceOutput:
    """One streamed choice: its text so far and what the client has been sent of it.

    Each delta is placed by the open tail of the last parse when it can be (work
    proportional to the delta); otherwise the whole text is parsed again and compared
    with what was sent."""

    def __init__(self, parser: OutputParser) -> None:
        self._parser = parser
        self._text = _Text()
        self._reasoning = _Text()
        self._content = _Text()
        self._calls: list[tuple[str, _Text]] = []
        """Each call sent: its name and arguments so far."""
        self._call_ids: list[str] = []
        self._follower: TailFollower | None = None
        self.parsed_chars = 0
        """Characters read so far (the text parsed whole, plus deltas placed by a tail)."""

    @property
    def made_calls(self) -> bool:
        return bool(self._calls)

    def feed(self, text: str) -> Json:
        """The delta for ``text`` (may be empty: held back until it can be placed)."""
        self._text.append(text)
        if self._follower is not None:
            self.parsed_chars += len(text)
            growth = self._follower.feed(text)
            if growth is not None:
                return self._tail_delta(self._follower.tail, growth)
        return self._delta(final=False)

    def finish(self) -> Json:
        """The delta of what was held back, once the text is complete."""
        return self._delta(final=True)

    def _tail_delta(self, tail: OpenTail, growth: str) -> Json:
        if not growth:
            return {}
        if tail.field == "reasoning":
            self._reasoning.append(growth)
            return {"reasoning_content": growth}
        if tail.field == "content":
            self._content.append(growth)
            return {"content": growth}
        self._calls[-1][1].append(growth)
        return {"tool_calls": [{"index": len(self._calls) - 1, "function": {"arguments": growth}}]}

    def _delta(self, final: bool) -> Json:
        text = self._text.value()
        self.parsed_chars += len(text)
        now = self._parser.parse(text, final)
        delta: Json = {}
        reasoning = _growth(self._reasoning.value(), now.reasoning, "reasoning")
        if reasoning:
            delta["reasoning_content"] = reasoning
        content = _growth(self._content.value(), now.content, "content")
        if content:
            delta["content"] = content
        calls = [self._call_delta(index, call) for index, call in enumerate(now.calls)]
        if any(calls):
            delta["tool_calls"] = [call for call in calls if call]
        self._reasoning, self._content = _Text(now.reasoning), _Text(now.content)
        self._calls = [(call.name, _Text(call.arguments)) for call in now.calls]
        tail = None if final else now.tail
        self._follower = follow(tail, text) if tail is not None else None
        return delta

    def _call_delta(self, index: int, call: CallText) -> Json:
        """The delta for one call ({} where it did not change)."""
        if index >= len(self._call_ids):  # OpenAI's first delta: id, type and name
            self._call_ids.append(new_call_id())
            function = {"name": call.name, "arguments": call.arguments}
            call_id = self._call_ids[index]
            return {"index": index, "id": call_id, "type": "function", "function": function}
        if index >= len(self._calls):  # sent once, lost in a shrunk parse
            return {"index": index, "function": {"arguments": call.arguments}}
        name, sent = self._calls[index]
        if name == call.name and sent.value() == call.arguments:
            return {}
        arguments = _growth(sent.value(), call.arguments, "arguments")
        return {"index": index, "function": {"arguments": arguments}}


def message(parsed: Parsed) -> Json:
    """A non-streamed choice's ``message``."""
    body: Json = {"role": "assistant", "content": parsed.content or None}
    if not parsed.calls and not parsed.content:
        body["content"] = ""
    if parsed.reasoning:
        body["reasoning_content"] = parsed.reasoning
    if parsed.calls:
        body["tool_calls"] = [
            {
                "id": new_call_id(),
                "type": "function",
                "function": {"name": call.name, "arguments": call.arguments},
            }
            for call in parsed.calls
        ]
    return body


def finish_reason(engine_reason: str, made_calls: bool) -> str:
    """OpenAI's ``tool_calls`` when the model stopped after calling tools."""
    return "tool_calls" if made_calls and engine_reason == "stop" else engine_reason
