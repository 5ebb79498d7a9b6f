"""Where a JSON value ends in text that may still be growing (a model's output so far).

The tool-call parsers (:mod:`gateway.openai.tool_parsers`) stream a call's arguments as the
raw text of one JSON value: they need to know whether that value is complete yet and,
if it is, where it stops. Nothing is decoded here; ``json.loads`` checks a finished
value.
"""

from __future__ import annotations

WHITESPACE = " \t\r\n"
_PRIMITIVE_ENDS = frozenset(",]}" + WHITESPACE)


def skip_whitespace(text: str, position: int) -> int:
    while position < len(text) and text[position] in WHITESPACE:
        position += 1
    return position


def value_end(text: str, start: int) -> int | None:
    """The index just past the JSON value starting at ``text[start]``; None while the
    text ends before the value does. A number or literal at the very end of the text
    counts as unfinished (more digits may follow)."""
    if start >= len(text):
        return None
    first = text[start]
    if first == '"':
        return _string_end(text, start)
    if first in "{[":
        return _container_end(text, start)
    position = start
    while position < len(text) and text[position] not in _PRIMITIVE_ENDS:
        position += 1
    return position if position < len(text) else None


def _string_end(text: str, start: int) -> int | None:
    position = start + 1
    while position < len(text):
        char = text[position]
        if char == "\\":
            position += 2
            continue
        if char == '"':
            return position + 1
        position += 1
    return None


def _container_end(text: str, start: int) -> int | None:
    depth = 0
    position = start
    while position < len(text):
        char = text[position]
        if char == '"':
            end = _string_end(text, position)
            if end is None:
                return None
            position = end
            continue
        if char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return position + 1
        position += 1
    return None
