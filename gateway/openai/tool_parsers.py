"""Tool-call formats: a model's output text -> content and tool calls.

Each parser is a pure function of the text so far: ``parse(text, final)``. While
``final`` is false the text may still grow, so a parser holds back what it cannot yet
place (a partial ``<tool_call>`` tag, trailing whitespace, a call whose name is not
complete). What it returns for a prefix of the text is always a prefix of what it
returns for the whole (content, each call's name and arguments): the streaming
differ (:mod:`gateway.openai.output_parsing`) sends only the growth, so a stream, however it
is chunked, adds up to the non-streamed answer. Arguments are the raw text of the
model's JSON value, sent as it arrives. A parse of text that may grow says where it
ends in an open tail (:class:`gateway.openai.open_tail.OpenTail`): content or arguments
that the next deltas extend verbatim, so a stream need not parse the whole text again
for each token.

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
from dataclasses import dataclass, field

from gateway.openai.json_scan import skip_whitespace, value_end
from gateway.openai.open_tail import OpenTail, hold_tag_prefix


@dataclass(frozen=True, slots=True)
class CallText:
    name: str
    arguments: str
    """The raw JSON text of the arguments so far."""


@dataclass(frozen=True, slots=True)
class ToolParse:
    content: str
    calls: tuple[CallText, ...] = ()
    tail: OpenTail | None = field(default=None, compare=False)
    """Not final: where the text goes on verbatim (None: nowhere known)."""


ToolParser = Callable[[str, bool], ToolParse]

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
MISTRAL_TOOL_CALLS = "[TOOL_CALLS]"
MISTRAL_ARGS = "[ARGS]"
_HEADER = re.compile(
    r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*'
)


def tidy_content(content: str, final: bool, has_calls: bool) -> str:
    """Content without surrounding whitespace: trailing whitespace waits (it may sit
    between text and a call) and is dropped at the end when calls were made."""
    content = content.lstrip()
    return content.rstrip() if not final or has_calls else content


def content_tail(start: int, final: bool, stop_tag: str = "") -> OpenTail | None:
    """Tidied content from ``start`` on (see :func:`tidy_content`)."""
    return None if final else OpenTail(start, "content", stop_tag, strip=True)


def arguments_tail(start: int | None, final: bool, stop_tag: str = "") -> OpenTail | None:
    """The last call's unfinished JSON arguments from ``start`` on."""
    return None if final or start is None else OpenTail(start, "arguments", stop_tag, json=True)


@dataclass(frozen=True, slots=True)
class _Object:
    call: CallText | None
    """None: no name yet (or the object is not a call)."""
    end: int | None
    """Index past the object; None while it is unfinished."""
    open_arguments: int | None = None
    """Where the call's arguments start while their value is unfinished."""


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
        open_arguments = args_start if args_end is None else None
        return _Object(CallText(name, arguments), end, open_arguments)
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
    tail: OpenTail | None = None
    while True:
        start = text.find(TOOL_CALL_START, position)
        if start < 0:
            rest = text[position:]
            content.append(rest if final else hold_tag_prefix(rest, TOOL_CALL_START))
            tail = content_tail(position, final, TOOL_CALL_START)
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
            if parsed.call is not None:
                tail = arguments_tail(parsed.open_arguments, final, TOOL_CALL_END)
            break
        position = close + len(TOOL_CALL_END)
    return ToolParse(tidy_content("".join(content), final, bool(calls)), tuple(calls), tail)


def llama3_json(text: str, final: bool) -> ToolParse:
    """Llama 3.x JSON calls: the answer is ``{"name": ..., "parameters": {...}}``
    (``;``-separated when several, optionally after ``<|python_tag|>``), or plain text."""
    position = skip_whitespace(text, 0)
    if text.startswith(PYTHON_TAG, position):
        position = skip_whitespace(text, position + len(PYTHON_TAG))
    elif not final and PYTHON_TAG.startswith(text[position:]):
        return ToolParse("")
    if position >= len(text) or text[position] != "{":
        content = tidy_content(text[position:], final, False)
        return ToolParse(content, (), content_tail(position, final))
    calls: list[CallText] = []
    while position < len(text):
        parsed = _call_object(text, position)
        if parsed.call is None:
            if parsed.end is None and not final:
                return ToolParse("", tuple(calls))
            content = tidy_content(text[position:], final, bool(calls))
            return ToolParse(content, tuple(calls), content_tail(position, final))
        calls.append(parsed.call)
        if parsed.end is None:
            return ToolParse("", tuple(calls), arguments_tail(parsed.open_arguments, final))
        position = skip_whitespace(text, parsed.end)
        if text.startswith(";", position):
            position = skip_whitespace(text, position + 1)
        if position < len(text) and text[position] != "{":
            content = tidy_content(text[position:], final, True)
            return ToolParse(content, tuple(calls), content_tail(position, final))
    return ToolParse("", tuple(calls))


def call_array(text: str, start: int, final: bool, content: str = "") -> ToolParse:
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
            tail = arguments_tail(parsed.open_arguments, final)
            return ToolParse(content, tuple(calls), tail)
        position = skip_whitespace(text, parsed.end)
        if text.startswith(",", position):
            position = skip_whitespace(text, position + 1)
    return ToolParse(content, tuple(calls))


def required(text: str, final: bool) -> ToolParse:
    """``tool_choice: "required"``: the grammar makes the whole output a call array."""
    start = skip_whitespace(text, 0)
    if start >= len(text) or text[start] != "[":
        return ToolParse("")
    return call_array(text, start, final)


def named(name: str) -> ToolParser:
    """A named ``tool_choice``: the grammar makes the whole output that call's arguments."""

    def parse(text: str, final: bool) -> ToolParse:
        tail = None if final else OpenTail(0, "arguments", strip=True)
        return ToolParse("", (CallText(name, tidy_content(text, final, True)),), tail)

    return parse


def mistral(text: str, final: bool) -> ToolParse:
    """``[TOOL_CALLS][{"name": ..., "arguments": {...}}]`` (Mistral v3 tokenizers) or
    ``[TOOL_CALLS]name[ARGS]{...}`` (v11+), after any content."""
    tag = text.find(MISTRAL_TOOL_CALLS)
    if tag < 0:
        content = tidy_content(
            text if final else hold_tag_prefix(text, MISTRAL_TOOL_CALLS), final, False
        )
        return ToolParse(content, (), content_tail(0, final, MISTRAL_TOOL_CALLS))
    content = tidy_content(text[:tag], final, True)
    position = skip_whitespace(text, tag + len(MISTRAL_TOOL_CALLS))
    if text.startswith("[", position) and not text.startswith(MISTRAL_ARGS, position):
        return call_array(text, position, final, content)
    calls: list[CallText] = []
    tail: OpenTail | None = None
    while True:
        args_tag = text.find(MISTRAL_ARGS, position)
        if args_tag < 0:
            break
        name = text[position:args_tag].strip()
        args_start = skip_whitespace(text, args_tag + len(MISTRAL_ARGS))
        args_end = value_end(text, args_start)
        arguments = text[args_start : len(text) if args_end is None else args_end]
        calls.append(CallText(name, arguments))
        if args_end is None:
            tail = arguments_tail(args_start, final)
            break
        next_tag = text.find(MISTRAL_TOOL_CALLS, args_end)
        if next_tag < 0:
            break
        position = next_tag + len(MISTRAL_TOOL_CALLS)
    return ToolParse(content, tuple(calls), tail)


PARSERS: dict[str, ToolParser] = {
    "hermes": hermes,
    "llama3_json": llama3_json,
    "mistral": mistral,
}
"""Tool-call formats by name (the ``tool_call_parser`` setting's values)."""
