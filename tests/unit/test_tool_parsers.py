"""Tool-call and reasoning parsers: each format on sample outputs, and every way of
chunking a stream adds up to the non-streamed answer (Hypothesis)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.openai.output_parsing import ChoiceOutput, OutputParser, Parsed, message
from gateway.openai.tool_parsers import CallText, hermes, llama3_json, mistral, named, required

WEATHER = '{"city": "Paris", "unit": "celsius"}'
TIME = '{"timezone": "Europe/Paris"}'
HERMES = OutputParser(hermes)
THINKING_HERMES = OutputParser(hermes, reasoning=True)
PARSERS: dict[str, OutputParser] = {
    "hermes": HERMES,
    "llama3_json": OutputParser(llama3_json),
    "mistral": OutputParser(mistral),
    "required": OutputParser(required),
    "named": OutputParser(named("get_weather")),
    "think": OutputParser(reasoning=True),
    "think+hermes": THINKING_HERMES,
    "opened-think": OutputParser(reasoning=True, starts_in_reasoning=True),
}

# (parser, model output, reasoning, content, calls): outputs in each model family's
# documented format (Qwen 2.5 / Hermes 2 Pro, Llama 3.1, Mistral v3 and v11, DeepSeek-R1).
SAMPLES: list[tuple[str, str, str, str, list[tuple[str, str]]]] = [
    (
        "hermes",
        f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n'
        "</tool_call>",
        "",
        "Let me check.",
        [("get_weather", WEATHER)],
    ),
    (
        "hermes",
        f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>\n'
        f'<tool_call>\n{{"name": "get_time", "arguments": {TIME}}}\n</tool_call>',
        "",
        "",
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    (
        "hermes",
        "Paris is sunny; a < b and <tool is not a tag.",
        "",
        "Paris is sunny; a < b and <tool is not a tag.",
        [],
    ),
    (
        "hermes",
        '<tool_call>\n{"arguments": {"x": 1}, "name": "late_name"}\n</tool_call>',
        "",
        "",
        [("late_name", '{"x": 1}')],
    ),
    (
        "hermes",
        "<tool_call>not json</tool_call> after",
        "",
        "<tool_call>not json</tool_call> after",
        [],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        "",
        "",
        [("get_weather", '{"city": "Par')],
    ),
    (
        "llama3_json",
        f'{{"name": "get_weather", "parameters": {WEATHER}}}',
        "",
        "",
        [("get_weather", WEATHER)],
    ),
    (
        "llama3_json",
        f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER}}}; '
        f'{{"name": "get_time", "parameters": {TIME}}}',
        "",
        "",
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    ("llama3_json", "The weather is fine.", "", "The weather is fine.", []),
    (
        "mistral",
        f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {WEATHER}}}]',
        "",
        "",
        [("get_weather", WEATHER)],
    ),
    (
        "mistral",
        f"Sure.[TOOL_CALLS]get_weather[ARGS]{WEATHER}[TOOL_CALLS]get_time[ARGS]{TIME}",
        "",
        "Sure.",
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    (
        "required",
        f'[{{"name": "get_weather", "parameters": {WEATHER}}}, '
        f'{{"name": "get_time", "parameters": {TIME}}}]',
        "",
        "",
        [("get_weather", WEATHER), ("get_time", TIME)],
    ),
    ("named", WEATHER, "", "", [("get_weather", WEATHER)]),
    (
        "think",
        "<think>\nRain is likely.\n</think>\n\nTake an umbrella.",
        "\nRain is likely.\n",
        "\n\nTake an umbrella.",
        [],
    ),
    ("opened-think", "Rain is likely.</think>Umbrella.", "Rain is likely.", "Umbrella.", []),
    (
        "think+hermes",
        f'<think>I need the weather.</think>\n<tool_call>\n{{"name": "get_weather", '
        f'"arguments": {WEATHER}}}\n</tool_call>',
        "I need the weather.",
        "",
        [("get_weather", WEATHER)],
    ),
]


def _as_tuples(calls: tuple[CallText, ...]) -> list[tuple[str, str]]:
    return [(call.name, call.arguments) for call in calls]


def streamed(parser: OutputParser, pieces: list[str]) -> Parsed:
    """What a client that concatenates the deltas (as the openai SDK does) ends with."""
    output = ChoiceOutput(parser)
    reasoning, content = [], []
    calls: dict[int, list[str]] = {}
    for delta in [*(output.feed(piece) for piece in pieces), output.finish()]:
        reasoning.append(delta.get("reasoning_content", ""))
        content.append(delta.get("content", ""))
        for call in delta.get("tool_calls", []):
            if "id" in call:
                assert call["type"] == "function"
                assert call["index"] not in calls
                calls[call["index"]] = [call["function"]["name"], ""]
            calls[call["index"]][1] += call["function"]["arguments"]
    ordered = tuple(CallText(*calls[i]) for i in sorted(calls))
    assert sorted(calls) == list(range(len(calls)))
    return Parsed("".join(reasoning), "".join(content), ordered)


def _split(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in itertools.pairwise(points)]


@pytest.mark.parametrize(("kind", "text", "reasoning", "content", "calls"), SAMPLES)
def test_each_format_on_sample_outputs(
    kind: str, text: str, reasoning: str, content: str, calls: list[tuple[str, str]]
) -> None:
    parsed = PARSERS[kind].parse(text, final=True)
    assert (parsed.reasoning, parsed.content, _as_tuples(parsed.calls)) == (
        reasoning,
        content,
        calls,
    )
    for call in parsed.calls:
        if call.arguments.endswith("}"):
            json.loads(call.arguments)


@pytest.mark.parametrize(("kind", "text"), [(s[0], s[1]) for s in SAMPLES])
def test_token_by_token_stream_equals_the_whole(kind: str, text: str) -> None:
    parser = PARSERS[kind]
    assert streamed(parser, list(text)) == parser.parse(text, final=True)


@settings(max_examples=60, deadline=None)
@given(sample=st.sampled_from(SAMPLES), cuts=st.lists(st.integers(0, 10_000), max_size=30))
def test_every_chunking_of_a_sample_equals_the_whole(sample: Any, cuts: list[int]) -> None:
    parser, text = PARSERS[sample[0]], sample[1]
    assert streamed(parser, _split(text, cuts)) == parser.parse(text, final=True)


FRAGMENTS = [
    "<tool_call>", "</tool_call>", "<tool", "_call>", '{"name": "f", "arguments": ',
    '{"name": "g", "parameters": ', '{"a": [1, "}"]}', "}", "{", "]", "[", '"', "\\", " ",
    "\n", "x", ";", ",", "<", "[TOOL_CALLS]", "[ARGS]", "<|python_tag|>", "<think>",
    "</think>", "12",
]  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(
    kind=st.sampled_from(sorted(PARSERS)),
    parts=st.lists(st.sampled_from(FRAGMENTS), max_size=14),
    cuts=st.lists(st.integers(0, 10_000), max_size=12),
)
def test_any_text_streams_to_what_it_parses_to(
    kind: str, parts: list[str], cuts: list[int]
) -> None:
    """Garbage, truncations and stray tags included: a stream never takes back what it
    sent, so it always adds up to the non-streamed answer."""
    text = "".join(parts)
    parser = PARSERS[kind]
    assert streamed(parser, _split(text, cuts)) == parser.parse(text, final=True)


def test_first_tool_call_delta_has_id_type_and_name_then_argument_fragments() -> None:
    output = ChoiceOutput(HERMES)
    deltas = [output.feed(piece) for piece in ["<tool_call>", '{"name": "get_weather", ',
              '"arguments": {"city"', ': "Paris"}', "}</tool_call>"]]  # fmt: skip
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    assert calls[0]["id"].startswith("call_")
    assert calls[0]["function"] == {"name": "get_weather", "arguments": '{"city"'}
    assert [c["function"]["arguments"] for c in calls[1:]] == [': "Paris"}']
    assert all("id" not in c for c in calls[1:])
    assert output.made_calls


def test_a_tag_split_across_tokens_is_never_sent_as_content() -> None:
    output = ChoiceOutput(HERMES)
    sent = [output.feed(piece).get("content", "") for piece in ["Hi ", "<tool", "_ca"]]
    assert "".join(sent) == "Hi"


def test_message_with_calls_has_null_content_and_ids() -> None:
    body = message(HERMES.parse(SAMPLES[1][1], final=True))
    assert body["content"] is None
    assert [c["function"]["name"] for c in body["tool_calls"]] == ["get_weather", "get_time"]
    assert len({c["id"] for c in body["tool_calls"]}) == 2
    assert message(Parsed(content="hi"))["content"] == "hi"
    assert message(Parsed(reasoning="r"))["reasoning_content"] == "r"
