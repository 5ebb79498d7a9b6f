"""What a span recorder offers; :class:`Tracer` itself is tracing off (every call does
nothing, no SDK tracer loaded). :mod:`shared.tracing.otlp` records for real.

Spans are recorded with the times they began and ended, once those are known: the
code that measures a stage passes two timestamps and a parent, and holds no span open
across awaits (a run's stages are recorded when the run ends).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping

from shared.tracing.traceparent import TraceParent

Attributes = Mapping[str, str | int | float | bool]


class OpenSpan:
    """A span whose end is not known yet (a request's span: jobs name it as their parent
    while it runs)."""

    def __init__(self, context: TraceParent) -> None:
        self.context = context

    def end(self, end_unix: float, attributes: Attributes | None = None) -> None:
        """Record the span (nothing, when tracing is off or the trace is not sampled)."""


class Tracer:
    """Tracing off: nothing is recorded, nothing imported."""

    enabled = False

    def open(
        self,
        name: str,
        parent: TraceParent | None,
        start_unix: float,
        attributes: Attributes | None = None,
    ) -> OpenSpan:
        """Start a server span under ``parent`` (a new trace when None); off, an unsampled
        context that records nothing."""
        trace_id = parent.trace_id if parent is not None else secrets.randbits(128) or 1
        return OpenSpan(TraceParent(trace_id, secrets.randbits(64) or 1, sampled=False))

    def record(
        self,
        name: str,
        parent: TraceParent,
        start_unix: float,
        end_unix: float,
        attributes: Attributes | None = None,
        *,
        failed: str | None = None,
    ) -> TraceParent | None:
        """Record a finished span under ``parent``; its context (for children), or None
        when nothing was recorded. ``failed``: the span's error status description."""
        return None

    def shutdown(self) -> None:
        """Export what is still buffered."""
