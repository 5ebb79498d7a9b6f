"""The placement benchmark's figures: one round's summary, the table, the JSON files."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.chat_load import Message, TurnResult
from bench.conversations import ideal_cached_tokens
from bench.load import percentile

MAX_ERROR_SAMPLES = 5


@dataclass(frozen=True, slots=True)
class RoundSummary:
    turns: int
    completed: int
    errors: int
    duration_s: float
    output_tokens_per_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    prompt_tokens: int
    cached_tokens: int
    ideal_cached_tokens: int
    cached_ratio: float
    ideal_ratio: float
    of_ideal: float
    """cached / ideal: how much of what one infinite cache would hit the fleet hit."""
    usage_without_cached: int
    """Completed turns whose usage carried no ``prompt_tokens_details.cached_tokens``."""
    token_count_mismatches: int
    """Turns whose prompt, tokenized here, is not ``usage.prompt_tokens`` long."""
    error_samples: list[str]
    missed_by_turn: dict[int, int] = field(default_factory=dict)
    """Turn number (1 = a conversation's first) -> ideal minus cached tokens: where the
    fleet's caches fell short of one infinite cache."""
    ttft_by_turn: dict[int, tuple[float, float]] = field(default_factory=dict)
    """Turn number -> TTFT p50 and p99 (ms) of that turn across conversations."""


def summarize(
    results: Sequence[TurnResult],
    duration_s: float,
    tokenize: Callable[[list[Message]], list[int]],
    block_tokens: int,
) -> RoundSummary:
    """``results`` in the order sent; the ideal counts every prompt sent, in that order."""
    prompts = [tokenize(r.messages) for r in results]
    ideal_all = ideal_cached_tokens(prompts, block_tokens)
    good = [i for i, r in enumerate(results) if r.error is None]
    ttfts = [(results[i].first_token or results[i].start) - results[i].start for i in good]
    itls = [
        b - a
        for i in good
        for a, b in zip(results[i].token_times, results[i].token_times[1:], strict=False)
    ]
    prompt_tokens = sum(results[i].prompt_tokens or 0 for i in good)
    cached = sum(results[i].cached_tokens or 0 for i in good)
    ideal = sum(ideal_all[i] for i in good)
    output = sum(results[i].completion_tokens or 0 for i in good)
    errors = sorted({r.error for r in results if r.error is not None})
    return RoundSummary(
        turns=len(results),
        completed=len(good),
        errors=len(results) - len(good),
        duration_s=duration_s,
        output_tokens_per_s=output / duration_s if duration_s > 0 else 0.0,
        ttft_p50_ms=percentile(ttfts, 50) * 1000,
        ttft_p90_ms=percentile(ttfts, 90) * 1000,
        ttft_p99_ms=percentile(ttfts, 99) * 1000,
        itl_p50_ms=percentile(itls, 50) * 1000,
        itl_p99_ms=percentile(itls, 99) * 1000,
        prompt_tokens=prompt_tokens,
        cached_tokens=cached,
        ideal_cached_tokens=ideal,
        cached_ratio=cached / prompt_tokens if prompt_tokens else math.nan,
        ideal_ratio=ideal / prompt_tokens if prompt_tokens else math.nan,
        of_ideal=cached / ideal if ideal else math.nan,
        usage_without_cached=sum(results[i].cached_tokens is None for i in good),
        token_count_mismatches=sum(results[i].prompt_tokens != len(prompts[i]) for i in good),
        error_samples=errors[:MAX_ERROR_SAMPLES],
        missed_by_turn=_missed_by_turn(results, good, ideal_all),
        ttft_by_turn=_ttft_by_turn(results, good),
    )


def _missed_by_turn(
    results: Sequence[TurnResult], good: Sequence[int], ideal: Sequence[int]
) -> dict[int, int]:
    missed: dict[int, int] = {}
    for i in good:
        turn = results[i].turn + 1
        missed[turn] = missed.get(turn, 0) + ideal[i] - (results[i].cached_tokens or 0)
    return dict(sorted(missed.items()))


def _ttft_by_turn(
    results: Sequence[TurnResult], good: Sequence[int]
) -> dict[int, tuple[float, float]]:
    ttfts: dict[int, list[float]] = {}
    for i in good:
        r = results[i]
        ttfts.setdefault(r.turn + 1, []).append((r.first_token or r.start) - r.start)
    return {
        turn: (percentile(values, 50) * 1000, percentile(values, 99) * 1000)
        for turn, values in sorted(ttfts.items())
    }


@dataclass(slots=True)
class VariantResult:
    name: str
    env: dict[str, str]
    rounds: list[RoundSummary] = field(default_factory=list)
    prefill_probe_ms: float = math.nan
    """TTFT of a 2k-token prompt minus that of a 16-token one (uncached, one at a time)."""
    placed: dict[str, float] = field(default_factory=dict)
    """The gateway's placements by reason (and steals) as of the last round."""

    def median(self, attr: str) -> float:
        values = [float(getattr(r, attr)) for r in self.rounds]
        values = [v for v in values if not math.isnan(v)]
        return statistics.median(values) if values else math.nan


ROWS: list[tuple[str, str, int]] = [
    ("output tok/s", "output_tokens_per_s", 1),
    ("TTFT p50 (ms)", "ttft_p50_ms", 1),
    ("TTFT p90 (ms)", "ttft_p90_ms", 1),
    ("TTFT p99 (ms)", "ttft_p99_ms", 1),
    ("ITL p50 (ms)", "itl_p50_ms", 2),
    ("ITL p99 (ms)", "itl_p99_ms", 2),
    ("cached ratio", "cached_ratio", 3),
    ("ideal ratio", "ideal_ratio", 3),
    ("cached / ideal", "of_ideal", 3),
]


def _fmt(value: float, digits: int) -> str:
    return "n/a" if math.isnan(value) else f"{value:.{digits}f}"


def print_table(variants: Sequence[VariantResult], heading: Sequence[str]) -> None:
    print()
    for line in heading:
        print(line)
    names = [v.name for v in variants]
    pair = f"{names[1]}/{names[0]}" if len(variants) == 2 else None
    header = f"{'metric':<18}" + "".join(f"{n:>12}" for n in names)
    header += f"{pair:>12}" if pair else ""
    print(header)
    print("-" * len(header))
    for label, attr, digits in ROWS:
        values = [v.median(attr) for v in variants]
        line = f"{label:<18}" + "".join(f"{_fmt(x, digits):>12}" for x in values)
        if pair:
            ratio = values[1] / values[0] if values[0] else math.nan
            line += f"{'n/a' if math.isnan(ratio) else f'{ratio:.2f}x':>12}"
        print(line)
    print(f"{'errors':<18}" + "".join(f"{sum(r.errors for r in v.rounds):>12}" for v in variants))
    print(
        f"{'2k prefill (ms)':<18}" + "".join(f"{_fmt(v.prefill_probe_ms, 0):>12}" for v in variants)
    )
    for v in variants:
        _print_warnings(v)


def _print_warnings(variant: VariantResult) -> None:
    if len(variant.rounds) > 1:
        spread = ", ".join(f"{r.ttft_p50_ms:.0f}" for r in variant.rounds)
        print(f"  {variant.name} TTFT p50 per round (ms): {spread}")
    for sample in sorted({e for r in variant.rounds for e in r.error_samples}):
        print(f"  {variant.name} error: {sample}")
    missing = sum(r.usage_without_cached for r in variant.rounds)
    if missing:
        print(f"  WARNING {variant.name}: {missing} answers without cached_tokens in usage")
    mismatched = sum(r.token_count_mismatches for r in variant.rounds)
    if mismatched:
        print(
            f"  WARNING {variant.name}: {mismatched} prompts tokenized here to another length "
            "than usage.prompt_tokens: the ideal ratio is approximate"
        )


def write_json(path: Path, config: dict[str, Any], variants: Sequence[VariantResult]) -> None:
    data = {
        "config": config,
        "results": {
            v.name: {
                "env": v.env,
                "prefill_probe_ms": v.prefill_probe_ms,
                "median": {attr: v.median(attr) for _, attr, _ in ROWS},
                "rounds": [asdict(r) for r in v.rounds],
            }
            for v in variants
        },
    }
    path.write_text(json.dumps(data, indent=2, default=str) + "\n")


def write_turns(path: Path, variant: str, number: int, results: list[TurnResult]) -> None:
    """One JSON line per turn, appended; times in seconds from the round's first start."""
    zero = min((r.start for r in results), default=0.0)
    with path.open("a") as out:
        for r in results:
            row = {
                "variant": variant,
                "round": number + 1,
                "conversation": r.conversation,
                "turn": r.turn + 1,
                "start_s": round(r.start - zero, 4),
                "ttft_ms": None
                if r.first_token is None
                else round((r.first_token - r.start) * 1e3, 1),
                "end_s": round(r.end - zero, 4),
                "prompt_tokens": r.prompt_tokens,
                "cached_tokens": r.cached_tokens,
                "completion_tokens": r.completion_tokens,
                "error": r.error,
            }
            out.write(json.dumps(row) + "\n")
