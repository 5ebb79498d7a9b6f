"""The process's tracer: :func:`build_tracer` gives an exporting one when an OTLP endpoint
is set (``CONVEYOR_OTLP_ENDPOINT``, else the standard ``OTEL_EXPORTER_OTLP_ENDPOINT``),
and otherwise a :class:`~shared.tracing.spans.Tracer` whose every call does nothing. The
OpenTelemetry SDK's tracer and exporter are imported only then (:mod:`shared.tracing.otlp`).
"""

from __future__ import annotations

import logging
import os
from typing import Final

from shared.tracing.spans import Tracer

log = logging.getLogger(__name__)

TRACES_PATH: Final = "/v1/traces"


def traces_url(configured: str | None) -> str | None:
    """Where spans go: ``configured`` (CONVEYOR_OTLP_ENDPOINT), else the standard
    variables; a base URL gets the OTLP path ``/v1/traces``, as the standard says."""
    exact = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    base = configured or (None if exact else os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))
    if base:
        base = base.rstrip("/")
        return base if base.endswith(TRACES_PATH) else base + TRACES_PATH
    return exact or None


def build_tracer(
    configured_url: str | None, sample_ratio: float, service: str, instance: str
) -> Tracer:
    """The process's tracer: exporting over OTLP/HTTP when an endpoint is set."""
    url = traces_url(configured_url)
    if url is None:
        return Tracer()
    from shared.tracing.otlp import OtlpTracer

    log.info("tracing to %s (sampling %.0f%% of new traces)", url, 100 * sample_ratio)
    return OtlpTracer(url, sample_ratio, service, instance)
