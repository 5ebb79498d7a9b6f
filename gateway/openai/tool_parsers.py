"""Tool-call formats: a model's output text -> content and tool calls.

Each parser is a pure function of the text so far: ``parse(text, final)``. While
``final`` is false the text may still grow, so a parser holds back what it cannot yet
place (a partial ``<tool_call>`` tag, trailing whitespace, a call whose name is not
complete). What it returns for a prefix of the text is always a prefix of what it
returns for the whole (content, each call's name and arguments): the streaming
differ (:mod:`gateway.openai.output_parsing`) sends only the growth, so a stream, however it
is chunked, adds up to the non-streamed answer. Arguments are the raw text of the
model's JSON value, sent as it arrives.

Why not vLLM's own parsers (``vllm.tool_parsers``): importing one takes ~20 s and
loads torch and transformers (checked: ``"torch" in sys.modules`` after
``from vllm.tool_parsers.hermes_tool_parser import Hermes2ProToolParser``), and the
gateway never imports torch. Nor do they run in the workers: a migrated stream
continues on another worker, which would start a parser mid-call with none of the
state, while the gateway sees the whole delivered text of every attempt. The formats
below follow vLLM's ``hermes``, ``llama3_json`` and ``mistral`` parsers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

from gateway.openai.json_scan import skip_whitespace, value_end


@dataclass(frozen=True, slots=True)
class CallText:
    name: str
    arguments: str
    """The raw JSON text of the arguments so far."""


@dataclass(frozen=True, slots=True)
class ToolParse:
    content: str
    calls: tuple[CallText, ...] = ()


ToolParser = Callable[[str, bool], ToolParse]

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
_HEADER = re.compile(
    r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)


def hold_tag_prefix(text: str, tag: str) -> str:
    """``text`` without a trailing partial ``tag`` (which may yet become the tag)."""
    position = text.find(tag[0], max(len(text) - len(tag) + 1, 0))
    while position >= 0:
        if tag.startswith(text[position:]):
            return text[:position]
        position = text.find(tag[0], position + 1)
    return text


def tidy_content(content: str, final: bool, has_calls: bool) -> str:
    """Content without surrounding whitespace: trailing whitespace waits (it may sit
    between text and a call) and is dropped at the end when calls were made."""
    content = content.lstrip()
    return content.rstrip() if not final or has_calls else content


@dataclass(frozen=True, slots=True)
class _Object:
    call: CallText | None
    """None: no name yet (or the object is not a call)."""
    end: int | None
    """Index past the object; None while it is unfinished."""


def _call_object(text: str, start: int) -> _Object:
    """``{"name": ..., "arguments"|"parameters": ...}`` at ``text[start]``. With the name
    first (the usual order) the arguments stream as they arrive; otherwise the call
    appears once the object is complete."""
    end = value_end(text, start) if start < len(text) and text[start] == "{" else None
    header = _HEADER.match(text, start)
    name = _json_string(header.group(1)) if header is not None else None
    if header is not None and name is not None:
        args_start = header.end()
        args_end = value_end(text, args_start)
        arguments = text[args_start : len(text) if args_end is None else args_end]
        return _Object(CallText(name, arguments), end)
    if end is None:
        return _Object(None, None)
    try:
        data = json.loads(text[start:end])
    except ValueError:
        return _Object(None, end)
    if not isinstance(data, dict) or not isinstance(data.get("name"), str):
        return _Object(None, end)
    value = data.get("arguments", data.get("parameters", {}))
    return _Object(CallText(data["name"], json.dumps(value, ensure_ascii=False)), end)


def _json_string(escaped: str) -> str | None:
    try:
        return str(json.loads(f'"{escaped}"'))
    except ValueError:
        return None


def hermes(text: str, final: bool) -> ToolParse:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen 2.5/3,
    and many fine-tunes); text around the calls is content."""
    content: list[str] = []
    calls: list[CallText] = []
    position = 0
    while True:
        start = text.find(TOOL_CALL_START, position)
        if start < 0:
            rest = text[position:]
            content.append(rest if final else hold_tag_prefix(rest, TOOL_CALL_START))
            break
        content.append(text[position:start])
        close = text.find(TOOL_CALL_END, start)
        closed = close >= 0 or final
        region = text[: close if close >= 0 else len(text)]
        if not closed:
            region = hold_tag_prefix(region, TOOL_CALL_END)
        parsed = _call_object(region, skip_whitespace(region, start + len(TOOL_CALL_START)))
        if parsed.call is not None:
            calls.append(parsed.call)
        elif closed:  # not a call after all: its text is content
            content.append(text[start : close + len(TOOL_CALL_END) if close >= 0 else len(text)])
        if close < 0:
            break
        position = close + len(TOOL_CALL_END)
    return ToolParse(tidy_content("".join(content), final, bool(calls)), tuple(calls))


def llama3_json(text: str, final: bool) -> ToolParse:
    """Llama 3.x JSON calls: the answer is ``{"name": ..., "parameters": {...}}``
    (``;``-separated when several, optionally after ``<|python_tag|>``), or plain text."""
    position = skip_whitespace(text, 0)
    if text.startswith(PYTHON_TAG, position):
        position = skip_whitespace(text, position + len(PYTHON_TAG))
    elif not final and PYTHON_TAG.startswith(text[position:]):
        return ToolParse("")
    if position >= len(text) or text[position] != "{":
        return ToolParse(tidy_content(text[position:], final, False))
    calls: list[CallText] = []
    while position < len(text):
        parsed = _call_object(text, position)
        if parsed.call is None:
            rest = text[position:] if parsed.end is not None or final else ""
            return ToolParse(tidy_content(rest, final, bool(calls)), tuple(calls))
        calls.append(parsed.call)
        if parsed.end is None:
            break
        position = skip_whitespace(text, parsed.end)
        if text.startswith(";", position):
            position = skip_whitespace(text, position + 1)
        if position < len(text) and text[position] != "{":
            return ToolParse(tidy_content(text[position:], final, True), tuple(calls))
    return ToolParse("", tuple(calls))


def call_array(text: str, start: int) -> tuple[CallText, ...]:
    """``[{"name": ..., "arguments"|"parameters": ...}, ...]`` at ``text[start]``:
    the calls so far (the output of ``tool_choice: "required"``, and Mistral's)."""
    calls: list[CallText] = []
    position = skip_whitespace(text, start + 1)
    while position < len(text) and text[position] == "{":
        parsed = _call_object(text, position)
        if parsed.call is None:
            break
        calls.append(parsed.call)
        if parsed.end is None:
            break
        position = skip_whitespace(text, parsed.end)
        if text.startswith(",", position):
            position = skip_whitespace(text, position + 1)
    return tuple(calls)


def required(text: str, final: bool) -> ToolParse:
    """``tool_choice: "required"``: the grammar makes the whole output a call array."""
    start = skip_whitespace(text, 0)
    if start >= len(text) or text[start] != "[":
        return ToolParse("")
    return ToolParse("", call_array(text, start))


def named(name: str) -> ToolParser:
    """A named ``tool_choice``: the grammar makes the whole output that call's arguments."""

    def parse(text: str, final: bool) -> ToolParse:
        return ToolParse("", (CallText(name, tidy_content(text, final, True)),))

    return parse


def mistral(text: str, final: bool) -> ToolParse:
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}]`` (Mistral v3 tokenizers) or
    ``[TOOL_CALLS]name[ARGS]{...}`` (v11+), after any content."""
    tag = text.find(MISTRAL_TOOL_CALLS)
    if tag < 0:
        return ToolParse(
            tidy_content(text if final else hold_tag_prefix(text, MISTRAL_TOOL_CALLS), final, False)
        )
    content = tidy_content(text[:tag], final, True)
    position = skip_whitespace(text, tag + len(MISTRAL_TOOL_CALLS))
    if text.startswith("[", position) and not text.startswith(MISTRAL_ARGS, position):
        return ToolParse(content, call_array(text, position))
    calls: list[CallText] = []
    while True:
        args_tag = text.find(MISTRAL_ARGS, position)
        if args_tag < 0:
            break
        name = text[position:args_tag].strip()
        args_start = skip_whitespace(text, args_tag + len(MISTRAL_ARGS))
        args_end = value_end(text, args_start)
        arguments = text[args_start : len(text) if args_end is None else args_end]
        calls.append(CallText(name, arguments))
        next_tag = -1 if args_end is None else text.find(MISTRAL_TOOL_CALLS, args_end)
        if next_tag < 0:
            break
        position = next_tag + len(MISTRAL_TOOL_CALLS)
    return ToolParse(content, tuple(calls))


PARSERS: dict[str, ToolParser] = {
    "hermes": hermes,
    "llama3_json": llama3_json,
    "mistral": mistral,
}
"""Tool-call formats by name (the ``tool_call_parser`` setting's values)."""
