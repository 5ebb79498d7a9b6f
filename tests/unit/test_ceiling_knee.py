"""The ceiling benchmark's arithmetic: the load ladder, the knee, the CPU split."""

from __future__ import annotations

import math

from bench.knee import CpuSplit, LatencyHistogram, Level, knee, next_offered, step_ms_for
from bench.stream_client import _completion_tokens


def level(
    offered: float, added_p99_ms: float, *, got: float | None = None, errors: int = 0
) -> Level:
    step = step_ms_for(100, offered)
    return Level(
        streams=100,
        step_ms=step,
        tokens_per_s=offered if got is None else got,
        requests_per_s=1.0,
        itl_p50_ms=step,
        itl_p99_ms=step + added_p99_ms,
        errors=errors,
    )


def test_the_load_doubles_while_the_path_keeps_up() -> None:
    assert next_offered([], 1000.0) == 1000.0
    assert next_offered([level(1000, 5)], 1000.0) == 2000.0
    assert next_offered([level(1000, 5), level(2000, 49)], 1000.0) == 4000.0


def test_one_try_between_the_last_level_that_held_and_the_first_that_did_not() -> None:
    levels = [level(1000, 5), level(2000, 10), level(4000, 80)]
    between = next_offered(levels, 1000.0)
    assert between is not None and math.isclose(between, math.sqrt(2000 * 4000))
    assert next_offered([*levels, level(between, 60)], 1000.0) is None
    assert next_offered([*levels, level(between, 20)], 1000.0) is None


def test_errors_fail_a_level_and_a_failed_start_is_halved_once() -> None:
    assert not level(1000, 1, errors=1).holds()
    assert next_offered([level(1000, 80)], 1000.0) == 500.0
    assert next_offered([level(1000, 80), level(500, 70)], 1000.0) is None


def test_the_knee_is_the_best_throughput_that_held() -> None:
    levels = [level(1000, 5), level(2000, 10, got=1900), level(2828, 30, got=2500), level(4000, 90)]
    best = knee(levels)
    assert best is not None and best.tokens_per_s == 2500
    assert knee([level(1000, 51)]) is None


def test_added_latency_is_the_gap_beyond_the_engine_step() -> None:
    lv = level(1000, 12.5)  # 100 streams at 1000 tokens/s: a 100 ms step
    assert math.isclose(lv.step_ms, 100.0)
    assert math.isclose(lv.added_itl_p99_ms, 12.5)
    assert math.isclose(lv.offered_tokens_per_s, 1000.0)


def test_the_cpu_split_per_token_and_per_core() -> None:
    split = CpuSplit(wall_s=10.0, tokens=200_000, seconds={"gateway": 5.0, "redis": 1.0})
    assert math.isclose(split.us_per_token("gateway"), 25.0)
    assert math.isclose(split.tokens_per_core_s("gateway"), 40_000.0)
    assert math.isclose(split.cores("gateway"), 0.5)
    assert split.us_per_token("client") == 0.0
    assert math.isnan(CpuSplit(wall_s=1.0, tokens=0, seconds={}).us_per_token("gateway"))


def test_latency_percentiles_from_merged_histograms() -> None:
    one, two = LatencyHistogram(), LatencyHistogram()
    for _ in range(98):
        one.add(0.010)
    two.add(0.200, times=2)
    one.merge(two)
    assert one.total() == 100
    assert math.isclose(one.percentile_ms(50), 10.1)
    assert math.isclose(one.percentile_ms(99), 200.1)
    assert math.isnan(LatencyHistogram().percentile_ms(99))


def test_usage_is_found_without_parsing_the_event() -> None:
    chunk = b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":64,"x":1}}\n\n'
    assert _completion_tokens(chunk) == 64
    assert _completion_tokens(b'data: {"choices":[{"text":"a"}]}\n\n') is None
