"""Streaming parsers do work proportional to what they receive: a long output fed in
small deltas is read a bounded number of times, not once per delta (counted in
characters read, not timed)."""

from __future__ import annotations

import json

from gateway.openai.json_scan import ValueScan, value_end
from gateway.openai.output_parsing import ChoiceOutput, OutputParser
from gateway.openai.tool_parsers import hermes, required
from tests.unit.test_tool_parsers import streamed

DELTA_CHARS = 4


def _deltas(text: str) -> list[str]:
    return [text[i : i + DELTA_CHARS] for i in range(0, len(text), DELTA_CHARS)]


def _feed_all(output: ChoiceOutput, text: str) -> None:
    for piece in _deltas(text):
        output.feed(piece)
    output.finish()


def test_a_64_kib_forced_call_streams_its_arguments_reading_each_char_a_few_times() -> None:
    arguments = json.dumps({"path": "notes.txt", "content": 'line \\ "quoted" é\n' * 3500})
    text = f'[{{"name": "write_file", "arguments": {arguments}}}]'
    assert len(text) >= 64 * 1024
    parser = OutputParser(required)
    result = streamed(parser, _deltas(text))
    assert [call.name for call in result.calls] == ["write_file"]
    assert result.calls[0].arguments == arguments
    assert json.loads(result.calls[0].arguments)["path"] == "notes.txt"
    output = ChoiceOutput(parser)
    _feed_all(output, text)
    assert output.parsed_chars <= 4 * len(text)


def test_long_reasoning_then_content_is_read_a_few_times() -> None:
    reasoning = "Rain is likely; take care.\n" * 1500
    answer = "Take an umbrella, and a coat. " * 1500
    text = f"<think>{reasoning}</think>\n\n{answer}"
    for parser in (OutputParser(reasoning=True), OutputParser(hermes, reasoning=True)):
        result = streamed(parser, _deltas(text))
        assert result == parser.parse(text, final=True)
        assert result.reasoning == reasoning
        assert result.content.strip() == answer.strip()
        output = ChoiceOutput(parser)
        _feed_all(output, text)
        assert output.parsed_chars <= 4 * len(text)


def test_value_scan_fed_in_pieces_ends_where_value_end_does() -> None:
    for text in ['{"a": [1, "}\\""]} tail', '"x\\\\" y', "12.5, 3", "[[], {}]", "true}"]:
        for size in (1, 2, 3, 7):
            scan, found, offset = ValueScan(), None, 0
            for piece in [text[i : i + size] for i in range(0, len(text), size)]:
                end = scan.feed(piece)
                if end is not None:
                    found = offset + end
                    break
                offset += len(piece)
            assert found == value_end(text, 0), (text, size)
