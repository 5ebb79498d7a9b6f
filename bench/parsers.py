"""CPU cost of reading streamed output for tool calls and reasoning, per token.

``python -m bench.parsers``: feeds recorded-format outputs token by token through
:class:`gateway.openai.output_parsing.ChoiceOutput` (what the gateway does for each token
event of a request with tools) and prints microseconds per token: first each format on
short outputs, then how the cost per token changes with output length (a forced call
whose arguments grow long, and a long reasoning + answer), which stays flat when the
parsers are incremental. The end-to-end effect on throughput is measured with
``bench.bench --variant ... --tools-for``.
"""

from __future__ import annotations

import argparse
import random
import time

from gateway.openai.output_parsing import ChoiceOutput, OutputParser
from gateway.openai.tool_parsers import hermes, llama3_json, mistral, required

WORDS = ["the", " sea", " is", " calm", ",", " and", " ships", " sail", ".", "\n", " 42"]
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"query": "QUERY"}}\n</tool_call>'
TOKEN_CHARS = 4


def _tokens(count: int, rng: random.Random, with_call: bool) -> list[str]:
    words = [rng.choice(WORDS) for _ in range(count)]
    if with_call:
        words += [CALL[i : i + 4] for i in range(0, len(CALL), 4)]
    return words


def _pieces(text: str) -> list[str]:
    return [text[i : i + TOKEN_CHARS] for i in range(0, len(text), TOKEN_CHARS)]


def forced_call_tokens(count: int) -> list[str]:
    """A ``tool_choice: "required"`` call array whose one string argument runs ``count``
    tokens of ``TOKEN_CHARS`` characters."""
    head, tail = '[{"name": "write_file", "arguments": {"content": "', '"}}]'
    body = "".join(f"line {i % 1000:03d}\\n" for i in range(count))[: count * TOKEN_CHARS]
    return _pieces(head + body + tail)


def reasoning_tokens(count: int, rng: random.Random) -> list[str]:
    """``<think>`` reasoning of ``count`` tokens, then an answer of ``count`` tokens."""
    thought = [rng.choice(WORDS) for _ in range(count)]
    answer = [rng.choice(WORDS) for _ in range(count)]
    return ["<think>", *thought, "</think>", "\n\n", *answer]


def _per_token_us(parser: OutputParser, tokens: list[str], repeats: int) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        output = ChoiceOutput(parser)
        for piece in tokens:
            output.feed(piece)
        output.finish()
    return (time.perf_counter() - started) / (repeats * len(tokens)) * 1e6


def _formats_table(counts: list[int], repeats: int) -> None:
    rng = random.Random(0)
    parsers = {
        "hermes": OutputParser(hermes),
        "hermes+think": OutputParser(hermes, reasoning=True),
        "llama3_json": OutputParser(llama3_json),
        "mistral": OutputParser(mistral),
        "required": OutputParser(required),
        "think": OutputParser(reasoning=True),
    }
    print(f"{'parser':<14} {'tokens':>7} {'text us/token':>14} {'text+call us/token':>19}")
    for count in counts:
        plain, called = _tokens(count, rng, False), _tokens(count, rng, True)
        for name, output_parser in parsers.items():
            text_us = _per_token_us(output_parser, plain, repeats)
            call_us = _per_token_us(output_parser, called, repeats)
            print(f"{name:<14} {count:>7} {text_us:>14.2f} {call_us:>19.2f}")


def _lengths_table(lengths: list[int]) -> None:
    rng = random.Random(0)
    cases = {
        "required (long arguments)": (OutputParser(required), forced_call_tokens),
        "hermes+think (long text)": (
            OutputParser(hermes, reasoning=True),
            lambda count: reasoning_tokens(count // 2, rng),
        ),
        "think (long text)": (
            OutputParser(reasoning=True),
            lambda count: reasoning_tokens(count // 2, rng),
        ),
    }
    print(f"\n{'case':<27} {'tokens':>7} {'us/token':>9}")
    for name, (output_parser, make) in cases.items():
        for count in lengths:
            tokens = make(count)
            repeats = max(1, 4096 // count)
            print(f"{name:<27} {count:>7} {_per_token_us(output_parser, tokens, repeats):>9.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.parsers", description=__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument(
        "--lengths", type=int, nargs="+", default=[256, 1024, 4096, 16384],
        help="output lengths (tokens) for the cost-per-token-by-length table",
    )  # fmt: skip
    args = parser.parse_args()
    _formats_table(args.tokens, args.repeats)
    _lengths_table(args.lengths)


if __name__ == "__main__":
    main()
