"""tool_choice plans and tool caps, and which formats a chat template implies."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest

from gateway.catalog.served_models import ServedModel
from gateway.openai.output_formats import OutputFormats, detect
from gateway.openai.schemas import ChatCompletionRequest
from gateway.serving.tool_choice import MAX_SCHEMA_DEPTH, MAX_TOOL_SCHEMA_BYTES, plan_tools
from shared.errors import InvalidRequest, UnsupportedParameter

QWEN_LIKE = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}<tool_call>...</tool_call>"
LLAMA_LIKE = "<|start_header_id|>ipython<|end_header_id|>{{- '<|python_tag|>' }}"
MISTRAL_LIKE = "[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS][TOOL_CALLS]"
R1_LIKE = "{{ '<|Assistant|><think>\\n' }}"


def tool(name: str = "f", parameters: Any = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


def request(**fields: Any) -> ChatCompletionRequest:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatCompletionRequest.model_validate(body)


@pytest.mark.parametrize(
    ("template", "tools", "reasoning"),
    [
        (QWEN_LIKE, "hermes", False),
        (LLAMA_LIKE, "llama3_json", False),
        (MISTRAL_LIKE, "mistral", False),
        (R1_LIKE, None, True),
        ("{{ messages }}", None, False),
        (None, None, False),
    ],
)
def test_formats_come_from_the_chat_template(
    template: str | None, tools: str | None, reasoning: bool
) -> None:
    formats = detect(template, "auto", "auto")
    assert (formats.tool_calls, formats.reasoning) == (tools, reasoning)


def test_settings_override_the_template() -> None:
    assert detect("{{ messages }}", "mistral", "think") == OutputFormats(
        "mistral", True, "the tool_call_parser setting"
    )
    assert detect(QWEN_LIKE, "none", "none").tool_calls is None
    with pytest.raises(ValueError, match="tool_call_parser"):
        detect(None, "pythonic", "auto")


def test_auto_without_a_format_is_a_400_naming_the_reason(served_model: ServedModel) -> None:
    with pytest.raises(UnsupportedParameter) as caught:
        plan_tools(request(tools=[tool()]), served_model)
    assert caught.value.param == "tool_choice"
    assert "renders no known tool-call tags" in caught.value.message


def test_auto_with_a_format_parses_and_renders_the_tools(served_model: ServedModel) -> None:
    model = dataclasses.replace(served_model, output_formats=OutputFormats("mistral"))
    plan = plan_tools(request(tools=[tool()]), model)
    assert plan.parser is not None and plan.forced_schema is None
    assert plan.template_tools == [tool()]
    assert plan.special_tokens_in_text  # [TOOL_CALLS] is a special token


def test_none_sends_no_tools_and_parses_nothing(served_model: ServedModel) -> None:
    plan = plan_tools(request(tools=[tool()], tool_choice="none"), served_model)
    assert (plan.parser, plan.template_tools, plan.forced_schema) == (None, None, None)


def test_named_without_parameters_still_forces_an_object(served_model: ServedModel) -> None:
    named = {"type": "function", "function": {"name": "f"}}
    plan = plan_tools(request(tools=[tool()], tool_choice=named), served_model)
    assert json.loads(plan.forced_schema or "") == {"type": "object", "properties": {}}


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"x": schema}}
    return schema


@pytest.mark.parametrize(
    ("tools", "param", "says"),
    [
        ([tool(parameters=_nested(MAX_SCHEMA_DEPTH))], "tools[0].function.parameters", "deeper"),
        (
            [tool(parameters={"description": "x" * MAX_TOOL_SCHEMA_BYTES})],
            "tools[0].function.parameters",
            "bytes",
        ),
        ([tool(), tool()], "tools[1]", "two tools"),
    ],
)
def test_tools_are_capped_before_any_work(
    served_model: ServedModel, tools: list[Any], param: str, says: str
) -> None:
    with pytest.raises(InvalidRequest) as caught:
        plan_tools(request(tools=tools, tool_choice="required"), served_model)
    assert caught.value.param == param
    assert says in caught.value.message


def test_a_schema_just_inside_the_depth_cap_is_taken(served_model: ServedModel) -> None:
    shallow = [tool(parameters=_nested(MAX_SCHEMA_DEPTH // 2 - 1))]
    assert plan_tools(request(tools=shallow, tool_choice="required"), served_model).forced_schema


def test_more_than_128_tools_is_a_validation_error() -> None:
    with pytest.raises(ValueError, match="128"):
        request(tools=[tool(f"f{i}") for i in range(129)])
