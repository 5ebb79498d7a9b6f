"""What constrains a request's output (``response_format`` or vLLM's ``structured_outputs``),
as the :class:`~shared.protocol.SamplingOptions` fields that carry it, checked where cheap.

The grammar languages themselves (xgrammar's regex dialect, EBNF or Lark, structural
tags) are checked by the worker, which has xgrammar (it imports torch, which the gateway
must not): a bad one is the request's 400 naming the field (workers/engines/vllm/translate.py).
"""

from __future__ import annotations

import json
from typing import Any

from gateway.openai.schemas import StructuredOutputs
from gateway.serving.tool_choice import check_schema
from shared.errors import InvalidRequest, UnsupportedParameter

SCHEMA_PARAM = "response_format.json_schema.schema"
LEGACY_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def constraint(request: Any) -> dict[str, Any]:
    """The SamplingOptions fields constraining every choice of ``request`` (empty: none);
    a JSON schema is serialized and capped once per request."""
    structured: StructuredOutputs | None = request.structured_outputs
    from_format = _response_format(request)
    if structured is None:
        return from_format
    if from_format:
        raise InvalidRequest(
            "structured_outputs cannot be combined with a json_object or json_schema "
            "response_format (both constrain the whole output)",
            param="structured_outputs",
        )
    return _structured(structured)


def refuse_legacy(request: Any) -> None:
    """The removed ``guided_*`` fields: a 400 that says what to send instead."""
    for name in LEGACY_FIELDS:
        if getattr(request, name, None) is not None:
            raise UnsupportedParameter(
                f"{name} was removed from vLLM's API; send structured_outputs "
                f'(e.g. {{"structured_outputs": {{"{name.removeprefix("guided_")}": ...}}}})',
                param=name,
            )


def _response_format(request: Any) -> dict[str, Any]:
    response_format = request.response_format
    if response_format is None or response_format.type == "text":
        return {}
    if response_format.type == "json_object":
        return {"json_object": True}
    spec = response_format.json_schema
    if spec is None or not spec.schema_:
        raise InvalidRequest("json_schema.schema is required", param="response_format")
    return {"json_schema": check_schema(spec.schema_, SCHEMA_PARAM)}


def _structured(structured: StructuredOutputs) -> dict[str, Any]:
    if structured.disable_additional_properties or structured.whitespace_pattern is not None:
        name = (
            "disable_additional_properties"
            if structured.disable_additional_properties
            else "whitespace_pattern"
        )
        raise UnsupportedParameter(
            f"structured_outputs.{name} is not supported", param=f"structured_outputs.{name}"
        )
    kind = structured.kind()
    value = structured.kind_value(kind)
    if kind == "json":
        return {"json_schema": check_schema(_schema(value), "structured_outputs.json")}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "choice":
        return {"choice": tuple(value)}
    return {kind: value}


def _schema(value: dict[str, Any] | str) -> dict[str, Any]:
    if isinstance(value, dict):
        return value
    try:
        schema = json.loads(value)
    except ValueError as exc:
        raise InvalidRequest(
            f"structured_outputs.json is not valid JSON: {exc}", param="structured_outputs.json"
        ) from exc
    if not isinstance(schema, dict):
        raise InvalidRequest(
            "structured_outputs.json must be a JSON schema object",
            param="structured_outputs.json",
        )
    return schema
