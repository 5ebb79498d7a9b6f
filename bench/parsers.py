"""CPU cost of reading streamed output for tool calls and reasoning, per token.

``python -m bench.parsers``: feeds recorded-format outputs token by token through
:class:`gateway.openai.output_parsing.ChoiceOutput` (what the gateway does for each token
event of a request with tools) and prints microseconds per token. The end-to-end
effect on throughput is measured with ``bench.bench --variant ... --tools-for``.
"""

from __future__ import annotations

import argparse
import random
import time

from gateway.openai.output_parsing import ChoiceOutput, OutputParser
from gateway.openai.tool_parsers import hermes, llama3_json, mistral, required

WORDS = ["the", " sea", " is", " calm", ",", " and", " ships", " sail", ".", "\n", " 42"]
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"query": "QUERY"}}\n</tool_call>'


def _tokens(count: int, rng: random.Random, with_call: bool) -> list[str]:
    words = [rng.choice(WORDS) for _ in range(count)]
    if with_call:
        words += [CALL[i : i + 4] for i in range(0, len(CALL), 4)]
    return words


def _per_token_us(parser: OutputParser, tokens: list[str], repeats: int) -> float:
    started = time.perf_counter()
    for _ in range(repeats):
        output = ChoiceOutput(parser)
        for piece in tokens:
            output.feed(piece)
        output.finish()
    return (time.perf_counter() - started) / (repeats * len(tokens)) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.parsers", description=__doc__)
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 1024])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
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
    for count in args.tokens:
        plain, called = _tokens(count, rng, False), _tokens(count, rng, True)
        for name, output_parser in parsers.items():
            text_us = _per_token_us(output_parser, plain, args.repeats)
            call_us = _per_token_us(output_parser, called, args.repeats)
            print(f"{name:<14} {count:>7} {text_us:>14.2f} {call_us:>19.2f}")


if __name__ == "__main__":
    main()
