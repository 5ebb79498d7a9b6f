"""The benchmark's results: the printed table and the JSON file."""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from bench.cpu import CpuReport, merge
from bench.load import LoadSummary

TTFT_BUDGET_MS = 5.0
NOISY_SHARE = 0.05  # other processes above this share of the machine's CPU: warn


@dataclass(slots=True)
class Measurement:
    server: str
    rounds: list[LoadSummary] = field(default_factory=list)
    cpu: list[CpuReport] = field(default_factory=list)
    transfers: list[tuple[int, float]] = field(default_factory=list)
    """Per round: KV transfers the decode workers made and the seconds they took."""

    def median(self, attr: str) -> float:
        if attr == "kv_transfer_ms":
            per_round = [1000 * s / n for n, s in self.transfers if n]
            return statistics.median(per_round) if per_round else math.nan
        if attr == "kv_transfers_per_request":
            per_round = [
                n / max(1, r.requests)
                for (n, _), r in zip(self.transfers, self.rounds, strict=False)
            ]
            return statistics.median(per_round) if per_round else math.nan
        if attr in _CPU_ROWS:
            return statistics.median(
                _CPU_ROWS[attr](c) / max(1, r.output_tokens) * 1e6
                for r, c in zip(self.rounds, self.cpu, strict=True)
            )
        return statistics.median(float(getattr(r, attr)) for r in self.rounds)


_CPU_ROWS: dict[str, Callable[[CpuReport], float]] = {
    "frontend_cpu_us_per_token": CpuReport.frontend_s,
    "engine_cpu_us_per_token": CpuReport.engine_s,
}


ROWS: list[tuple[str, str, int]] = [
    ("requests/s", "requests_per_s", 2),
    ("output tok/s", "output_tokens_per_s", 1),
    ("TTFT p50 (ms)", "ttft_p50_ms", 1),
    ("TTFT p99 (ms)", "ttft_p99_ms", 1),
    ("ITL p50 (ms)", "itl_p50_ms", 2),
    ("ITL p99 (ms)", "itl_p99_ms", 2),
    ("E2E p50 (ms)", "e2e_p50_ms", 1),
    ("token events/request", "token_events_per_request", 1),
    # CPU per output token is little disturbed by other processes, unlike the rates above.
    # Frontend: all but vLLM's engine processes (plus Conveyor's Redis); engine: VLLM::*
    # (their busy-polling between steps included).
    ("frontend CPU us/token", "frontend_cpu_us_per_token", 0),
    ("engine CPU us/token", "engine_cpu_us_per_token", 0),
    # Disaggregated only: NIXL's own telemetry of the prefill -> decode KV reads.
    ("KV transfer ms", "kv_transfer_ms", 2),
    ("KV transfers/request", "kv_transfers_per_request", 2),
]


def _fmt(value: float, digits: int = 1) -> str:
    return "n/a" if math.isnan(value) else f"{value:.{digits}f}"


def source_state() -> str:
    """The commit under test, and how many files (outside bench/) differ from it."""
    repo = Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(repo), "status", "--porcelain"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git)"
    dirty = [line for line in status.splitlines() if line[3:] and not line[3:].startswith("bench/")]
    return f"commit {head or '?'}" + (f" + {len(dirty)} uncommitted file(s)" if dirty else "")


def print_report(
    measurements: list[Measurement], args: argparse.Namespace, prompt: str, code: str, wall_s: float
) -> None:
    order = "interleaved" if args.interleave else "one server after the other"
    print()
    print(
        f"load: {args.requests} streaming requests per round, concurrency "
        f"{args.concurrency}, {args.output_tokens} output tokens each (ignore_eos, "
        f"temperature 0), dtype {args.dtype}"
    )
    print(
        f"rounds: {args.rounds} per server ({order}); the table shows "
        f"{'the median of the rounds' if args.rounds > 1 else 'the one round'}"
    )
    print(f"prompt: {prompt}")
    print(f"code under test: {code}")
    names = [m.server for m in measurements]
    pair = _compared_pair(measurements)
    header = f"{'metric':<22}" + "".join(f"{n:>12}" for n in names)
    if pair is not None:
        header += f"{pair[0].server + '/' + pair[1].server:>16}"
    print(header)
    print("-" * len(header))
    for label, attr, digits in ROWS:
        values = [m.median(attr) for m in measurements]
        if all(math.isnan(v) for v in values):
            continue
        line = f"{label:<22}" + "".join(f"{_fmt(v, digits):>12}" for v in values)
        if pair is not None:
            ours, theirs = pair[0].median(attr), pair[1].median(attr)
            ratio = ours / theirs if theirs else float("nan")
            line += f"{_fmt(ratio, 2) + 'x':>16}"
        print(line)
    errors = [sum(r.errors for r in m.rounds) for m in measurements]
    print(f"{'errors (all rounds)':<22}" + "".join(f"{e:>12}" for e in errors))
    for m in measurements:
        seen = sorted({t for r in m.rounds for t in r.prompt_tokens_seen})
        if seen != [args.input_tokens]:
            print(
                f"WARNING {m.server}: usage.prompt_tokens seen {seen}, wanted {args.input_tokens}"
            )
        for sample in sorted({e for r in m.rounds for e in r.error_samples}):
            print(f"  {m.server} error: {sample}")
        if len(m.rounds) > 1:
            spread = ", ".join(f"{r.output_tokens_per_s:.0f}" for r in m.rounds)
            print(f"  {m.server} output tok/s per round: {spread}")
    if pair is not None:
        _print_targets(*pair)
    print("CPU during the measured rounds (all rounds added up):")
    for m in measurements:
        print(f" {m.server}:")
        total = merge(m.cpu)
        for line in total.lines():
            print(line)
        if total.other_s > NOISY_SHARE * total.wall_s * (os.cpu_count() or 1):
            print(
                f"  WARNING: other processes used {total.other_s:.1f} core-s while "
                f"{m.server} was measured: its numbers are disturbed; run again"
            )
    print(f"total bench wall time: {wall_s:.0f}s")


def _compared_pair(measurements: list[Measurement]) -> tuple[Measurement, Measurement] | None:
    """Aggregated Conveyor against vLLM's server when both ran, else the first two."""
    by_name = {m.server: m for m in measurements}
    if "conveyor" in by_name and "vllm" in by_name:
        return by_name["conveyor"], by_name["vllm"]
    if len(measurements) == 2:
        return measurements[0], measurements[1]
    return None


def _print_targets(ours: Measurement, theirs: Measurement) -> None:
    ratio = ours.median("output_tokens_per_s") / theirs.median("output_tokens_per_s")
    delta = ours.median("ttft_p50_ms") - theirs.median("ttft_p50_ms")
    print(
        f"target: output tok/s >= 1.00x {theirs.server}: {ratio:.2f}x -> "
        f"{'met' if ratio >= 1.0 else 'MISSED'}"
    )
    print(
        f"target: TTFT p50 <= {theirs.server} + {TTFT_BUDGET_MS:.0f} ms: {delta:+.1f} ms -> "
        f"{'met' if delta <= TTFT_BUDGET_MS else 'MISSED'}"
    )


def write_json(
    path: Path,
    measurements: list[Measurement],
    args: argparse.Namespace,
    prompt: str,
    code: str,
    wall_s: float,
) -> None:
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    data: dict[str, Any] = {
        "config": config,
        "prompt": prompt,
        "code": code,
        "wall_s": wall_s,
        "results": {
            m.server: {
                "median": {attr: m.median(attr) for _, attr, _ in ROWS},
                "rounds": [
                    {**r.as_json(), "cpu": asdict(c)} for r, c in zip(m.rounds, m.cpu, strict=True)
                ],
            }
            for m in measurements
        },
    }
    path.write_text(json.dumps(data, indent=2) + "\n")
