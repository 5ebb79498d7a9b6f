"""The ceiling benchmark's arithmetic: the offered-load ladder, the knee, the CPU split.

At a fixed number of concurrent streams the offered load is set by the fake engine's
step time (every running stream gets one token per step): ``tokens/s = streams / step``.
The ladder doubles the offered load until the latency the serving path adds to each
token (measured inter-token latency minus the step time) passes the budget at p99,
then tries once between the last level that held and the first that did not.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

ADDED_ITL_BUDGET_MS = 50.0
BIN_MS = 0.1
MAX_MS = 5_000.0
BISECT_RATIO = 1.5
"""Stop refining once the last level that held and the first that did not are closer."""


class LatencyHistogram:
    """Inter-token gaps in 0.1 ms bins (one list of counts: cheap to fill and to merge
    across client processes); gaps above 5 s land in the last bin."""

    def __init__(self, counts: Sequence[int] | None = None) -> None:
        size = int(MAX_MS / BIN_MS) + 1
        self.counts = list(counts) if counts is not None else [0] * size

    def add(self, gap_s: float, times: int = 1) -> None:
        index = min(int(gap_s * 1000.0 / BIN_MS), len(self.counts) - 1)
        self.counts[index] += times

    def merge(self, other: LatencyHistogram) -> None:
        for index, count in enumerate(other.counts):
            self.counts[index] += count

    def total(self) -> int:
        return sum(self.counts)

    def percentile_ms(self, q: float) -> float:
        """The upper edge of the bin holding the ``q``-th percentile; NaN when empty."""
        total = self.total()
        if total == 0:
            return math.nan
        rank = math.ceil(total * q / 100.0)
        seen = 0
        for index, count in enumerate(self.counts):
            seen += count
            if seen >= max(rank, 1):
                return (index + 1) * BIN_MS
        return MAX_MS


@dataclass(frozen=True, slots=True)
class Level:
    """One measured level of offered load at one concurrency."""

    streams: int
    step_ms: float
    tokens_per_s: float
    requests_per_s: float
    itl_p50_ms: float
    itl_p99_ms: float
    errors: int

    @property
    def offered_tokens_per_s(self) -> float:
        return offered_tokens_per_s(self.streams, self.step_ms)

    @property
    def added_itl_p99_ms(self) -> float:
        return self.itl_p99_ms - self.step_ms

    def holds(self, budget_ms: float = ADDED_ITL_BUDGET_MS) -> bool:
        return self.errors == 0 and self.added_itl_p99_ms <= budget_ms


def offered_tokens_per_s(streams: int, step_ms: float) -> float:
    return streams * 1000.0 / step_ms


def step_ms_for(streams: int, tokens_per_s: float) -> float:
    return streams * 1000.0 / tokens_per_s


def next_offered(
    levels: Sequence[Level], start: float, budget_ms: float = ADDED_ITL_BUDGET_MS
) -> float | None:
    """The offered tokens/s to measure next, or None when the knee is found: double
    while every level holds; after the first that does not, one try halfway (geometric)
    between it and the best that held, then stop."""
    if not levels:
        return start
    held = [lv.offered_tokens_per_s for lv in levels if lv.holds(budget_ms)]
    failed = [lv.offered_tokens_per_s for lv in levels if not lv.holds(budget_ms)]
    if not failed:
        return 2.0 * max(held)
    if not held:
        lower = min(failed) / 2.0
        return lower if lower >= start / 2.0 else None
    best = max(held)
    above = [offered for offered in failed if offered > best]
    if not above or min(above) / best <= BISECT_RATIO:
        return None
    return math.sqrt(best * min(above))


def knee(levels: Iterable[Level], budget_ms: float = ADDED_ITL_BUDGET_MS) -> Level | None:
    """The level with the most streamed tokens/s among those that held the budget."""
    held = [lv for lv in levels if lv.holds(budget_ms)]
    return max(held, key=lambda lv: lv.tokens_per_s) if held else None


@dataclass(frozen=True, slots=True)
class CpuSplit:
    """CPU seconds per role over one measured window, and the tokens streamed in it."""

    wall_s: float
    tokens: int
    seconds: dict[str, float]

    def us_per_token(self, role: str) -> float:
        return self.seconds.get(role, 0.0) * 1e6 / self.tokens if self.tokens else math.nan

    def cores(self, role: str) -> float:
        """How many cores ``role`` kept busy on average."""
        return self.seconds.get(role, 0.0) / self.wall_s if self.wall_s > 0 else math.nan

    def tokens_per_core_s(self, role: str) -> float:
        """Tokens one core of ``role`` streams per second: 10^6 / (µs per token)."""
        per_token = self.us_per_token(role)
        return 1e6 / per_token if per_token > 0 else math.nan
