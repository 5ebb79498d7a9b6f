"""The W3C ``traceparent`` header (https://www.w3.org/TR/trace-context/), parsed and
written without the OpenTelemetry SDK: a job carries it through Redis whether or not the
process that reads it exports spans.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

_FORMAT: Final = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")
_INVALID_TRACE: Final = "0" * 32
_INVALID_SPAN: Final = "0" * 16


@dataclass(frozen=True, slots=True)
class TraceParent:
    trace_id: int
    span_id: int
    sampled: bool

    @property
    def header(self) -> str:
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{'01' if self.sampled else '00'}"

    @property
    def trace_hex(self) -> str:
        return f"{self.trace_id:032x}"


def parse(value: str | None) -> TraceParent | None:
    """``value`` as a trace parent; None when it is missing or not a valid one (the
    spec's rule: an invalid header starts a new trace)."""
    if not value:
        return None
    match = _FORMAT.match(value.strip().lower())
    if match is None:
        return None
    version, trace, span, flags, rest = match.groups()
    if version == "ff" or (version == "00" and rest):
        return None
    if trace == _INVALID_TRACE or span == _INVALID_SPAN:
        return None
    return TraceParent(int(trace, 16), int(span, 16), bool(int(flags, 16) & 1))
