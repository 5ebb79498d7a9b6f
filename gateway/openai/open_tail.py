"""Following a parse's open tail a delta at a time, so streaming costs what it receives.

A parse of text that may still grow (:mod:`gateway.openai.tool_parsers`,
:class:`gateway.openai.output_parsing.OutputParser`) often ends in text that goes on
verbatim into one field: reasoning before ``</think>``, content before a tag, the
arguments of an unfinished call. It says so with an :class:`OpenTail`; a
:class:`TailFollower` then places each new delta by looking only at the delta (and
the few characters held back before it), as long as the tail stays open. When it may
have closed (its stop tag or the end of the arguments' JSON value arrived) the
follower gives up and the text is parsed again whole: a few times per call, not once
per token. vLLM's streaming parsers keep the same kind of state across deltas.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from gateway.openai.json_scan import ValueScan

TailField = Literal["reasoning", "content", "arguments"]


@dataclass(frozen=True, slots=True)
class OpenTail:
    """The text from ``start`` on goes verbatim to the end of ``field`` (``arguments``:
    the last call's), except what the flags hold back, until the tail closes."""

    start: int
    field: TailField
    stop_tag: str = ""
    """A tag that closes the tail; a partial one at the end waits."""
    strip: bool = False
    """Trailing whitespace waits (the field is shown stripped)."""
    json: bool = False
    """The tail is a JSON value; it closes where the value ends."""

    def shifted(self, offset: int) -> OpenTail:
        return OpenTail(self.start + offset, self.field, self.stop_tag, self.strip, self.json)


def hold_tag_prefix(text: str, tag: str) -> str:
    """``text`` without a trailing partial ``tag`` (which may yet become the tag)."""
    position = text.find(tag[0], max(len(text) - len(tag) + 1, 0))
    while position >= 0:
        if tag.startswith(text[position:]):
            return text[:position]
        position = text.find(tag[0], position + 1)
    return text


class TailFollower:
    """One open tail, followed delta by delta (see :func:`follow`)."""

    __slots__ = ("_pending", "_scan", "tail")

    def __init__(self, tail: OpenTail) -> None:
        self.tail = tail
        self._pending = ""
        """Text past what the field holds so far: held back, not yet placed."""
        self._scan = ValueScan() if tail.json else None

    def feed(self, piece: str) -> str | None:
        """What the field grows by with ``piece``; None: the tail may have closed
        (parse the whole text again)."""
        tag = self.tail.stop_tag
        searched_from = max(len(self._pending) - len(tag) + 1, 0)
        self._pending += piece
        if tag and self._pending.find(tag, searched_from) >= 0:
            return None
        placed = hold_tag_prefix(self._pending, tag) if tag else self._pending
        if self._scan is not None and self._scan.feed(placed) is not None:
            return None
        if self.tail.strip:
            placed = placed.rstrip()
        self._pending = self._pending[len(placed) :]
        return placed


def follow(tail: OpenTail, text: str) -> TailFollower | None:
    """A follower for ``tail`` in ``text`` (whose parse it came from), or None where
    following it could go wrong: stripped text whose shown end is not in the tail yet,
    or arguments with no character yet (the header's whitespace may still grow)."""
    follower = TailFollower(tail)
    placed = follower.feed(text[tail.start :])
    if placed is None or (not placed and (tail.strip or tail.json)):
        return None
    return follower
