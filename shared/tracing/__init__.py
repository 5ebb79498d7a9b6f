"""Tracing: W3C trace context through the job protocol, spans exported over OTLP."""
