"""The load-only placer: the least loaded worker that is not busy, or the shared stream.

A worker's load is the work it has to do before a new job's first token: the prompt
tokens it still has to prefill plus one per sequence it runs or holds (each costs about
a token of compute per engine step). A worker with no free slot, or with its KV cache
nearly full, is busy and skipped; when every candidate is busy the job waits on the
shared stream, where the first worker to free a slot takes it (pull).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from gateway.placement.placer import Candidate, Placement, PlacementReason, PlacementRequest

BUSY_KV_USAGE = 0.95
"""A worker whose KV cache is this full would preempt: busy."""


def busy(candidate: Candidate, *, max_kv_usage: float = BUSY_KV_USAGE) -> bool:
    return candidate.free_slots <= 0 or candidate.kv_usage >= max_kv_usage


def load(candidate: Candidate) -> int:
    """Work ahead of a new job on ``candidate``, in tokens."""
    return candidate.queued_prefill_tokens + candidate.running + candidate.waiting


@dataclass(slots=True)
class LoadPlacer:
    max_kv_usage: float = BUSY_KV_USAGE
    rng: random.Random = field(default_factory=random.Random)
    """Breaks ties (so gateways that see the same loads do not all pick one worker)."""

    def place(self, request: PlacementRequest, candidates: Sequence[Candidate]) -> Placement:
        open_ = [c for c in candidates if not busy(c, max_kv_usage=self.max_kv_usage)]
        if not open_:
            return Placement(None, PlacementReason.FULL if candidates else PlacementReason.SHARED)
        best = min(open_, key=lambda c: (load(c), -c.free_slots, self.rng.random()))
        return Placement(best.worker_id, PlacementReason.LOAD)
