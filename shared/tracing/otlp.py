"""The exporting tracer: OpenTelemetry's SDK, a batch span processor and the OTLP/HTTP
(protobuf) exporter. Imported only when tracing is on."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace import Span as OtelSpan

from shared.tracing.spans import Attributes, OpenSpan, Tracer
from shared.tracing.traceparent import TraceParent


def _ns(unix: float) -> int:
    return int(unix * 1e9)


def _context(span: OtelSpan) -> TraceParent:
    ctx = span.get_span_context()
    return TraceParent(ctx.trace_id, ctx.span_id, ctx.trace_flags.sampled)


def _parent(parent: TraceParent | None) -> Context | None:
    if parent is None:
        return None
    flags = trace.TraceFlags(trace.TraceFlags.SAMPLED if parent.sampled else 0)
    remote = SpanContext(parent.trace_id, parent.span_id, is_remote=True, trace_flags=flags)
    return trace.set_span_in_context(NonRecordingSpan(remote))


class _OtlpSpan(OpenSpan):
    def __init__(self, span: OtelSpan) -> None:
        super().__init__(_context(span))
        self._span = span

    def end(self, end_unix: float, attributes: Attributes | None = None) -> None:
        if attributes:
            self._span.set_attributes(dict(attributes))
        self._span.end(_ns(end_unix))


class OtlpTracer(Tracer):
    enabled = True

    def __init__(self, url: str, sample_ratio: float, service: str, instance: str) -> None:
        resource = Resource.create({"service.name": service, "service.instance.id": instance})
        self._provider = TracerProvider(
            resource=resource, sampler=ParentBased(TraceIdRatioBased(sample_ratio))
        )
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url)))
        self._tracer = self._provider.get_tracer("conveyor")

    def open(
        self,
        name: str,
        parent: TraceParent | None,
        start_unix: float,
        attributes: Attributes | None = None,
    ) -> OpenSpan:
        span = self._tracer.start_span(
            name,
            context=_parent(parent),
            kind=SpanKind.SERVER,
            attributes=dict(attributes or {}),
            start_time=_ns(start_unix),
        )
        return _OtlpSpan(span)

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
        if not parent.sampled:
            return None
        span = self._tracer.start_span(
            name,
            context=_parent(parent),
            attributes=dict(attributes or {}),
            start_time=_ns(start_unix),
        )
        if failed is not None:
            span.set_status(Status(StatusCode.ERROR, failed))
        span.end(_ns(max(start_unix, end_unix)))
        return _context(span)

    def shutdown(self) -> None:
        self._provider.shutdown()
