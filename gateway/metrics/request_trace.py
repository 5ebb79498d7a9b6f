"""Each inference request's trace on the gateway (tracing on: ``CONVEYOR_OTLP_ENDPOINT``).

:class:`RequestTracing` (ASGI middleware) opens the request's server span under the
client's W3C ``traceparent`` (a new trace without one), answers with the trace id in
``X-Trace-Id``, and when the response has ended records its stages:

- ``admission``: the dispatcher queuing the request's jobs (the serving step notes it);
- ``delivery``: from the first event back from a worker (or the end of admission, for
  a request answered in one piece) to the response's last byte.

The jobs carry the request span as their ``traceparent``, so the workers' spans (queue
wait, encode, prefill, KV transfer, decode: shared/tracing) join the same trace. With
tracing off the middleware passes requests through untouched.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Final

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.dispatch.request_tally import RequestTally
from shared.tracing.spans import OpenSpan, Tracer
from shared.tracing.traceparent import parse

if TYPE_CHECKING:
    from gateway.state import GatewayState

TRACE_ID_HEADER: Final = b"x-trace-id"
TRACED_PREFIX: Final = "/v1/"


class RequestTrace:
    """One traced request: its span, and what the serving step noted about it."""

    def __init__(self, span: OpenSpan) -> None:
        self.span = span
        self.admission: tuple[float, float] | None = None
        self.tally: RequestTally | None = None

    @property
    def traceparent(self) -> str:
        """What the request's jobs carry: the request span as their parent."""
        return self.span.context.header

    def admitted(self, start_unix: float, tally: RequestTally) -> None:
        self.admission = (start_unix, time.time())
        self.tally = tally

    def finish(self, tracer: Tracer, status: int) -> None:
        end = time.time()
        parent = self.span.context
        if self.admission is not None:
            start, admitted = self.admission
            tracer.record("admission", parent, start, admitted)
            first = self.tally.first_token_unix if self.tally is not None else None
            tracer.record("delivery", parent, first or admitted, end)
        self.span.end(end, {"http.response.status_code": status})


def request_trace(request: Request) -> RequestTrace | None:
    """The request's trace (None: tracing is off)."""
    trace = getattr(request.state, "trace", None)
    return trace if isinstance(trace, RequestTrace) else None


class RequestTracing:
    """ASGI middleware: a server span per ``POST /v1/...`` while tracing is on."""

    def __init__(self, app: ASGIApp) -> None:
        self._app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        tracer = self._tracer(scope)
        if tracer is None:
            await self._app(scope, receive, send)
            return
        trace = self._open(tracer, scope)
        scope.setdefault("state", {})["trace"] = trace
        header = (TRACE_ID_HEADER, trace.span.context.trace_hex.encode())
        status = 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                message["headers"] = [*message.get("headers", []), header]
            await send(message)

        try:
            await self._app(scope, receive, sending)
        finally:
            trace.finish(tracer, status)

    @staticmethod
    def _tracer(scope: Scope) -> Tracer | None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return None
        if not scope["path"].startswith(TRACED_PREFIX):
            return None
        state: GatewayState | None = getattr(scope["app"].state, "gateway", None)
        tracer = getattr(state, "tracer", None)
        return tracer if isinstance(tracer, Tracer) and tracer.enabled else None

    @staticmethod
    def _open(tracer: Tracer, scope: Scope) -> RequestTrace:
        headers = dict(scope["headers"])
        raw = headers.get(b"traceparent")
        parent = parse(raw.decode("latin-1")) if raw is not None else None
        name = f"POST {scope['path']}"
        return RequestTrace(tracer.open(name, parent, time.time(), {"http.request.method": "POST"}))
