"""``tools`` / ``tool_choice`` / ``parallel_tool_calls`` -> what the request needs: the
tools the chat template renders, the grammar that forces a call, how the output is read.

- ``none`` (the default without tools): no tools in the prompt, the text is content.
- ``auto`` (the default with tools): the model decides; its own tool-call format
  (:mod:`gateway.openai.output_formats`) is parsed. A model with no known format is a 400:
  a plain-text answer must never pass for "the model chose not to call".
- ``required`` and a named function: structured outputs force the call, as vLLM's
  server does (``vllm.tool_parsers.utils.get_json_schema_from_tools``): a named
  function's output *is* its arguments (the function's parameter schema); ``required``
  makes the output a JSON array of ``{"name", "parameters"}`` objects, one ``anyOf``
  branch per tool (``maxItems: 1`` when ``parallel_tool_calls`` is false). This needs
  nothing from the chat template, so it works on any model.

Tool schemas are capped (count in :mod:`gateway.openai.schemas`, size and depth here) before
anything is tokenized or compiled into a grammar.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import msgspec

from gateway.catalog.served_models import ServedModel
from gateway.dispatch.plan import ChoiceSpec
from gateway.openai.output_parsing import REASONING_START, OutputParser
from gateway.openai.schemas import ChatCompletionRequest, NamedToolChoice, ToolDefinition
from gateway.openai.tool_parsers import PARSERS, named, required
from shared.errors import InvalidRequest, UnsupportedParameter

MAX_TOOL_SCHEMA_BYTES = 64 * 1024
"""One function's parameter schema (or a ``response_format`` schema), as JSON."""
MAX_TOOLS_BYTES = 512 * 1024
"""All tools of a request together, as JSON (descriptions included)."""
MAX_SCHEMA_DEPTH = 32
"""Nesting of objects and arrays in one parameter schema."""
_EMPTY_OBJECT: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    parser: OutputParser | None = None
    """How the choices' text is read (None: all of it is content)."""
    template_tools: list[dict[str, Any]] | None = None
    """The tools, for the chat template's ``tools`` variable."""
    forced_schema: str | None = None
    """The JSON schema (serialized) that forces the call, for ``required``/named."""
    special_tokens_in_text: bool = False
    """The format's tags are special tokens (Mistral's ``[TOOL_CALLS]``): keep them."""

    def apply(self, choices: list[ChoiceSpec]) -> list[ChoiceSpec]:
        if self.forced_schema is None and not self.special_tokens_in_text:
            return choices
        changes: dict[str, Any] = {}
        if self.forced_schema is not None:
            changes["json_schema"] = self.forced_schema
        if self.special_tokens_in_text:
            changes["skip_special_tokens"] = False
        return [
            dataclasses.replace(c, sampling=msgspec.structs.replace(c.sampling, **changes))
            for c in choices
        ]

    def opening_reasoning(self, opens: bool) -> ToolPlan:
        """This plan for a prompt whose template already opened ``<think>`` (or not)."""
        if self.parser is None or not self.parser.reasoning:
            return self
        parser = dataclasses.replace(self.parser, starts_in_reasoning=opens)
        return dataclasses.replace(self, parser=parser)


def plan_tools(request: ChatCompletionRequest, model: ServedModel) -> ToolPlan:
    tools = request.tools or []
    choice = request.tool_choice or ("auto" if tools else "none")
    check_caps(tools)
    reasoning = model.output_formats.reasoning
    if choice == "none" or (choice == "auto" and not tools):
        return ToolPlan(OutputParser(reasoning=True) if reasoning else None)
    if not tools:
        raise InvalidRequest(
            "tool_choice needs tools: send the tools to choose from", param="tool_choice"
        )
    rendered = template_tools(tools)
    if choice == "auto":
        return _auto(model, rendered)
    if request.structured_outputs is not None:
        raise InvalidRequest(
            "structured_outputs cannot be combined with a required or named tool_choice "
            "(both constrain the whole output)",
            param="structured_outputs",
        )
    if request.response_format is not None and request.response_format.type != "text":
        raise InvalidRequest(
            "response_format cannot be combined with a required or named tool_choice (both "
            "constrain the whole output)",
            param="response_format",
        )
    if isinstance(choice, NamedToolChoice):
        schema = _named_schema(tools, choice.function.name)
        parser = OutputParser(named(choice.function.name))
    else:
        schema = _required_schema(tools, request.parallel_tool_calls is not False)
        parser = OutputParser(required)
    return ToolPlan(parser, rendered, json.dumps(schema))


def template_tools(tools: list[ToolDefinition]) -> list[dict[str, Any]]:
    """The tools as the chat template's ``tools`` variable sees them."""
    return [tool.model_dump(exclude_none=True) for tool in tools]


def opens_reasoning(prompt: list[int], model: ServedModel) -> bool:
    """Whether the rendered prompt ends inside ``<think>`` (templates that open it for
    the model, as DeepSeek-R1's and Qwen3's thinking variants do)."""
    if not model.output_formats.reasoning:
        return False
    return model.tokenizer.decode(prompt[-8:]).rstrip().endswith(REASONING_START)


def _auto(model: ServedModel, rendered: list[dict[str, Any]]) -> ToolPlan:
    formats = model.output_formats
    if formats.tool_calls is None:
        raise UnsupportedParameter(
            f'tool_choice "auto" needs the tool-call format of model `{model.name}`, and it '
            f'has none ({formats.source}). Send tool_choice "required" or a named function, '
            "which work on any model, or set CONVEYOR_TOOL_CALL_PARSER to its format "
            f"({', '.join(PARSERS)}).",
            param="tool_choice",
        )
    parser = OutputParser(PARSERS[formats.tool_calls], formats.reasoning)
    return ToolPlan(parser, rendered, special_tokens_in_text=formats.tool_calls == "mistral")


def _named_schema(tools: list[ToolDefinition], name: str) -> dict[str, Any]:
    for tool in tools:
        if tool.function.name == name:
            return tool.function.parameters or _EMPTY_OBJECT
    raise InvalidRequest(
        f"tool_choice names function `{name}`, which is not in tools", param="tool_choice"
    )


def _required_schema(tools: list[ToolDefinition], parallel: bool) -> dict[str, Any]:
    branches = [
        {
            "properties": {
                "name": {"type": "string", "enum": [tool.function.name]},
                "parameters": tool.function.parameters or _EMPTY_OBJECT,
            },
            "required": ["name", "parameters"],
        }
        for tool in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": {"type": "object", "anyOf": branches},
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema


def check_caps(tools: list[ToolDefinition]) -> None:
    total = 0
    names: set[str] = set()
    for index, tool in enumerate(tools):
        param = f"tools[{index}].function.parameters"
        if tool.function.name in names:
            raise InvalidRequest(
                f"two tools are named `{tool.function.name}`", param=f"tools[{index}]"
            )
        names.add(tool.function.name)
        size = len(check_schema(tool.function.parameters or {}, param))
        total += size + len(tool.function.description or "")
        if total > MAX_TOOLS_BYTES:
            raise InvalidRequest(
                f"tools add up to more than {MAX_TOOLS_BYTES} bytes", param="tools"
            )


def check_schema(schema: dict[str, Any], param: str) -> str:
    """``schema`` serialized, once it is known to be at most :data:`MAX_TOOL_SCHEMA_BYTES`
    as JSON and :data:`MAX_SCHEMA_DEPTH` deep (a tool's parameters, or a
    ``response_format`` schema: both become a grammar)."""
    if _depth(schema, MAX_SCHEMA_DEPTH + 1) > MAX_SCHEMA_DEPTH:
        raise InvalidRequest(f"the schema nests deeper than {MAX_SCHEMA_DEPTH}", param=param)
    text = json.dumps(schema)
    if len(text) > MAX_TOOL_SCHEMA_BYTES:
        raise InvalidRequest(
            f"the schema is {len(text)} bytes as JSON; at most {MAX_TOOL_SCHEMA_BYTES}",
            param=param,
        )
    return text


def _depth(value: Any, limit: int) -> int:
    """Nesting depth of ``value``, counted no further than ``limit``."""
    if limit <= 0 or not isinstance(value, dict | list):
        return 0
    children = value.values() if isinstance(value, dict) else value
    return 1 + max((_depth(child, limit - 1) for child in children), default=0)
