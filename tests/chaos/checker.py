"""Reads the recorded history of a scenario and reports what clients experienced."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from tests.chaos.load import Record


@dataclass(frozen=True)
class Report:
    scenario: str
    sent: int
    completed: int
    failed_clean: int
    rejected: int
    hung: int
    tokens_lost: int
    tokens_duplicated: int
    seq_gaps: int
    identical: int
    compared: int
    longest_pause_s: float | None
    outage_s: float = 0.0
    """How long the fault itself kept the service down on purpose (a 3 s Redis stall)."""
    hung_detail: str = ""
    """What each hung request's client saw (empty when none hung)."""

    @property
    def recovery_s(self) -> float | None:
        """From the end of the fault to the stream's next token (the longest such wait)."""
        if self.longest_pause_s is None:
            return None
        return max(0.0, self.longest_pause_s - self.outage_s)

    @property
    def identical_pct(self) -> float:
        return 100.0 * self.identical / self.compared if self.compared else 100.0

    def row(self) -> str:
        pause = "-" if self.longest_pause_s is None else f"{self.longest_pause_s:.2f}"
        recovery = "-" if self.recovery_s is None else f"{self.recovery_s:.2f}"
        return (
            f"| {self.scenario} | {self.sent} | {self.completed} | {self.failed_clean} | "
            f"{self.rejected} | {self.hung} | {self.tokens_lost} | {self.tokens_duplicated} | "
            f"{self.seq_gaps} | {self.identical_pct:.0f}% | {pause} | {recovery} |"
        )


HEADER = (
    "| scenario | sent | completed | failed (clean error) | rejected (429/503) | hung | "
    "tokens lost | tokens duplicated | seq gaps | identical to fault-free | "
    "longest pause s | recovery s |\n|---|---|---|---|---|---|---|---|---|---|---|---|"
)


def check(
    scenario: str,
    records: list[Record],
    baseline: dict[int, list[int]],
    fault_at: float | None,
    outage_s: float = 0.0,
) -> Report:
    completed = [r for r in records if r.status == "completed"]
    lost = dup = gaps = identical = 0
    for record in completed:
        expected = baseline.get(record.prompt_index)
        if expected is None:
            continue
        lost += max(0, len(expected) - len(record.tokens))
        dup += max(0, len(record.tokens) - len(expected))
        identical += record.tokens == expected
    for record in records:
        dup += len(record.seq_ids) - len(set(record.seq_ids))
        ids = sorted(set(record.seq_ids))
        gaps += sum(1 for a, b in itertools.pairwise(ids) if b != a + 1)
    return Report(
        scenario=scenario,
        sent=len(records),
        completed=len(completed),
        failed_clean=sum(r.status == "failed" for r in records),
        rejected=sum(r.status == "rejected" for r in records),
        hung=sum(r.status == "hung" for r in records),
        tokens_lost=lost,
        tokens_duplicated=dup,
        seq_gaps=gaps,
        identical=identical,
        compared=sum(1 for r in completed if r.prompt_index in baseline),
        longest_pause_s=_longest_pause(records, fault_at),
        outage_s=outage_s,
        hung_detail="\n".join(r.describe() for r in records if r.status == "hung"),
    )


def _longest_pause(records: list[Record], fault_at: float | None) -> float | None:
    """Longest stall, across requests streaming when the fault hit, after the fault.

    For each such request: the longest gap between consecutive tokens from the last
    token before the fault on (a client reads tokens sent before the fault a little
    after it, so "the first token after the fault" alone would hide the stall).
    """
    if fault_at is None:
        return None
    stalls = []
    for record in records:
        times = record.token_times
        if record.sent_at >= fault_at or not times or times[-1] <= fault_at:
            continue
        first_after = next(i for i, t in enumerate(times) if t > fault_at)
        start = times[first_after - 1] if first_after else fault_at
        marks = [start, *times[first_after:]]
        stalls.append(max(b - a for a, b in itertools.pairwise(marks)))
    return max(stalls) if stalls else None
