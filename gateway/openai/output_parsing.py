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
from dataclasses import dataclass
from typing import Any

from gateway.openai.json_scan import skip_whitespace
from gateway.openai.tool_parsers import CallText, ToolParser, hold_tag_prefix

log = logging.getLogger(__name__)

Json = dict[str, Any]
REASONING_START = "<think>"
REASONING_END = "</think>"


@dataclass(frozen=True, slots=True)
class Parsed:
    reasoning: str = ""
    content: str = ""
    calls: tuple[CallText, ...] = ()


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
        reasoning, rest = self._split_reasoning(text, final) if self.reasoning else ("", text)
        if self.tools is None:
            return Parsed(reasoning, rest)
        found = self.tools(rest, final)
        return Parsed(reasoning, found.content, found.calls)

    def _split_reasoning(self, text: str, final: bool) -> tuple[str, str]:
        start = 0
        if not self.starts_in_reasoning:
            lead = skip_whitespace(text, 0)
            if text.startswith(REASONING_START, lead):
                start = lead + len(REASONING_START)
            elif not final and REASONING_START.startswith(text[lead:]):
                return "", ""  # may yet be the start tag
            else:
                return "", text
        end = text.find(REASONING_END, start)
        if end < 0:
            reasoning = text[start:]
            return (reasoning if final else hold_tag_prefix(reasoning, REASONING_END)), ""
        return text[start:end], text[end + len(REASONING_END) :]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _growth(sent: str, now: str, what: str) -> str:
    if now.startswith(sent):
        return now[len(sent) :]
    log.error("BUG: the parsed %s shrank while streaming (%r -> %r)", what, sent, now)
    return ""


class ChoiceOutput:
    """One streamed choice: its text so far and what the client has been sent of it."""

    def __init__(self, parser: OutputParser) -> None:
        self._parser = parser
        self._text = ""
        self._sent = Parsed()
        self._call_ids: list[str] = []

    @property
    def made_calls(self) -> bool:
        return bool(self._sent.calls)

    def feed(self, text: str) -> Json:
        """The delta for ``text`` (may be empty: held back until it can be placed)."""
        self._text += text
        return self._delta(final=False)

    def finish(self) -> Json:
        """The delta of what was held back, once the text is complete."""
        return self._delta(final=True)

    def _delta(self, final: bool) -> Json:
        now = self._parser.parse(self._text, final)
        delta: Json = {}
        reasoning = _growth(self._sent.reasoning, now.reasoning, "reasoning")
        if reasoning:
            delta["reasoning_content"] = reasoning
        content = _growth(self._sent.content, now.content, "content")
        if content:
            delta["content"] = content
        calls = [
            self._call_delta(index, call)
            for index, call in enumerate(now.calls)
            if index >= len(self._sent.calls) or call != self._sent.calls[index]
        ]
        if calls:
            delta["tool_calls"] = calls
        self._sent = now
        return delta

    def _call_delta(self, index: int, call: CallText) -> Json:
        if index >= len(self._call_ids):  # OpenAI's first delta: id, type and name
            self._call_ids.append(new_call_id())
            function = {"name": call.name, "arguments": call.arguments}
            call_id = self._call_ids[index]
            return {"index": index, "id": call_id, "type": "function", "function": function}
        arguments = _growth(self._sent.calls[index].arguments, call.arguments, "arguments")
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
