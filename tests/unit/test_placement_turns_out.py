"""The placement benchmark's per-turn file (bench/placement_report.py: --turns-out)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.chat_load import TurnResult
from bench.placement_report import write_turns


def turn(conversation: int, number: int, start: float, first: float | None) -> TurnResult:
    result = TurnResult(conversation, number, [{"role": "user", "content": "hi"}])
    result.start, result.first_token, result.end = start, first, start + 1.0
    result.prompt_tokens, result.cached_tokens, result.completion_tokens = 1200, 1008, 16
    return result


def test_every_turn_is_one_line_timed_from_the_rounds_first_start(tmp_path: Path) -> None:
    path = tmp_path / "turns.jsonl"
    write_turns(path, "on", 0, [turn(0, 0, 100.0, 100.25), turn(1, 2, 101.5, None)])
    write_turns(path, "off", 1, [turn(0, 0, 7.0, 7.5)])

    rows = [json.loads(line) for line in path.read_text().splitlines()]

    assert [(r["variant"], r["round"], r["conversation"], r["turn"]) for r in rows] == [
        ("on", 1, 0, 1),
        ("on", 1, 1, 3),
        ("off", 2, 0, 1),
    ]
    assert [r["start_s"] for r in rows] == [0.0, 1.5, 0.0]
    assert [r["ttft_ms"] for r in rows] == [250.0, None, 500.0]
    assert rows[0]["prompt_tokens"] - rows[0]["cached_tokens"] == 192
