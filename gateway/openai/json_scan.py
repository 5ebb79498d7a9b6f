"""Where a JSON value ends in text that may still be growing (a model's output so far).

The tool-call parsers (:mod:`gateway.openai.tool_parsers`) stream a call's arguments as the
raw text of one JSON value: they need to know whether that value is complete yet and,
if it is, where it stops. Nothing is decoded here; ``json.loads`` checks a finished
value.
"""

from __future__ import annotations

import re

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


_STRING_STOPS = re.compile(r'["\\]')


class ValueScan:
    """:func:`value_end`, a piece of text at a time: each piece is read once, whatever
    was read before (for a value that streams in, e.g. a call's arguments)."""

    __slots__ = ("_depth", "_escaped", "_in_string", "_kind")

    def __init__(self) -> None:
        self._kind = ""
        """``"`` a string, ``{`` an object or array, ``p`` a number or literal; "" no char yet."""
        self._depth = 0
        self._in_string = False
        self._escaped = False

    def feed(self, piece: str) -> int | None:
        """The index in ``piece`` just past the value's end; None while it goes on."""
        position = 0
        while position < len(piece):
            if self._escaped:
                self._escaped = False
                position += 1
            elif self._in_string:
                position = self._in_string_step(piece, position)
                if not self._in_string and self._depth == 0:
                    return position
            else:
                end = self._step(piece[position])
                position += 1
                if end:
                    return position - 1 if self._kind == "p" else position
        return None

    def _in_string_step(self, piece: str, position: int) -> int:
        stop = _STRING_STOPS.search(piece, position)
        if stop is None:
            return len(piece)
        if stop.group() == "\\":
            self._escaped = True
        else:
            self._in_string = False
        return stop.end()

    def _step(self, char: str) -> bool:
        """Reads one char outside any string; True when the value ends at it."""
        if not self._kind:
            self._kind = '"' if char == '"' else "{" if char in "{[" else "p"
        if self._kind == "p":
            return char in _PRIMITIVE_ENDS
        if char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1
            return self._depth == 0
        return False
