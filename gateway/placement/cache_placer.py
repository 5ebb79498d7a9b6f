"""The cache-aware placer: the worker whose cache and load make the job cheapest.

For each candidate, Dynamo's default cost form::

    cost = prefill_weight x (prompt blocks it does not hold + its queued prefill, in blocks)
         + decode_weight x (sequences it runs)

lowest wins (ties: the least loaded, then at random). A busy worker (no free slot, too
many jobs waiting to start, or its KV cache nearly full) is never chosen, so affinity
always yields to load; with every candidate busy the job goes to the shared stream, where whichever
worker frees up first takes it. A request's ``prompt_cache_key`` (OpenAI's field) is an
affinity hint: when the index knows none of the prompt, the job goes to the worker that
last took that key, if it is not busy. An adapter's job only goes to workers that have
the adapter.
"""

from __future__ import annotations

import logging
import random
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from gateway.placement.placer import Candidate, Placement, PlacementReason, PlacementRequest
from gateway.placement.prefix_index import PrefixIndex
from shared.block_hashes import prompt_blocks

log = logging.getLogger(__name__)

DEFAULT_BLOCK_TOKENS = 16
"""The block size costs are counted in before any worker of the model is indexed."""
CACHE_KEYS_MAX = 65_536
"""``prompt_cache_key`` values remembered (least recently used forgotten first)."""


class PlacementSettings(Protocol):
    placement_prefill_weight: float
    placement_decode_weight: float
    placement_busy_waiting: int
    placement_busy_kv_usage: float


@dataclass(frozen=True, slots=True)
class CostPolicy:
    prefill_weight: float = 1.0
    decode_weight: float = 1.0
    busy_waiting: int = 2
    """A worker holding this many jobs not started yet is busy."""
    busy_kv_usage: float = 0.95
    """A worker whose KV cache is this full is busy."""

    def busy(self, candidate: Candidate) -> bool:
        """A job placed here would wait behind others (or preempt): skip the worker. With no
        free slot the job could only wait in the worker's stream until stolen."""
        return (
            candidate.free_slots <= 0
            or candidate.waiting >= self.busy_waiting
            or candidate.kv_usage >= self.busy_kv_usage
        )

    @classmethod
    def from_settings(cls, settings: PlacementSettings) -> CostPolicy:
        return cls(
            prefill_weight=settings.placement_prefill_weight,
            decode_weight=settings.placement_decode_weight,
            busy_waiting=settings.placement_busy_waiting,
            busy_kv_usage=settings.placement_busy_kv_usage,
        )


OnPlaced = Callable[[PlacementRequest, Placement], None]


class CachePlacer:
    """A :class:`~gateway.placement.placer.Placer` over a :class:`PrefixIndex`."""

    def __init__(
        self,
        index: PrefixIndex,
        policy: CostPolicy = CostPolicy(),
        *,
        on_placed: OnPlaced | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.index = index
        self.policy = policy
        self._on_placed = on_placed
        self._rng = rng or random.Random()
        self._keys: OrderedDict[tuple[str, str], str] = OrderedDict()

    def place(self, request: PlacementRequest, candidates: Sequence[Candidate]) -> Placement:
        placement = self._decide(request, candidates)
        if request.cache_key is not None and placement.worker_id is not None:
            self._remember(request.model, request.cache_key, placement.worker_id)
        log.debug(
            "placed a %s job of %s%s on %s: %s, %d blocks cached there",
            request.role,
            request.model,
            "" if request.lora is None else f" ({request.lora})",
            placement.worker_id or "the shared stream",
            placement.reason,
            placement.matched_blocks,
        )
        if self._on_placed is not None:
            self._on_placed(request, placement)
        return placement

    def _decide(self, request: PlacementRequest, candidates: Sequence[Candidate]) -> Placement:
        lora = request.lora
        free = [  # may run it, and not busy
            c
            for c in candidates
            if (lora is None or lora in c.adapters) and not self.policy.busy(c)
        ]
        if not free:
            return Placement(None, PlacementReason.SHARED)
        tokens = request.prompt_token_ids or ()
        matched = (
            self.index.match(request.model, request.lora, tokens, [c.worker_id for c in free])
            if tokens
            else {}
        )
        if not matched and request.cache_key is not None:
            keyed = self._keys.get((request.model, request.cache_key))
            for candidate in free:
                if candidate.worker_id == keyed:
                    return Placement(keyed, PlacementReason.CACHE_KEY)
        size = self.index.block_size(request.model) or DEFAULT_BLOCK_TOKENS
        blocks = prompt_blocks(len(tokens), size)
        best = min(free, key=lambda c: self._rank(c, blocks - matched.get(c.worker_id, 0), size))
        hits = matched.get(best.worker_id, 0)
        if hits:
            return Placement(best.worker_id, PlacementReason.CACHE, hits)
        return Placement(best.worker_id, PlacementReason.LOAD)

    def _rank(self, candidate: Candidate, uncached: int, size: int) -> tuple[float, int, float]:
        queued = -(-candidate.queued_prefill_tokens // size)
        cost = (
            self.policy.prefill_weight * (uncached + queued)
            + self.policy.decode_weight * candidate.running
        )
        return cost, candidate.running + candidate.waiting, self._rng.random()

    def _remember(self, model: str, key: str, worker_id: str) -> None:
        self._keys[(model, key)] = worker_id
        self._keys.move_to_end((model, key))
        while len(self._keys) > CACHE_KEYS_MAX:
            self._keys.popitem(last=False)
