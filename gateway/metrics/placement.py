"""Where jobs were placed and why (cache-aware placement, gateway/placement/)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from gateway.placement.placer import Placement, PlacementRequest

MATCHED_BLOCKS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)


class PlacementMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.placements = Counter(
            "conveyor_placements",
            "Jobs placed, by reason: cache (on the worker holding most of the prompt), "
            "cache_key (prompt_cache_key affinity), load, shared (not placed).",
            ["model_name", "reason"],
            registry=registry,
        )
        self.matched_blocks = Histogram(
            "conveyor_placement_matched_blocks",
            "Prompt KV blocks already cached on the worker a job was placed on.",
            ["model_name"],
            buckets=MATCHED_BLOCKS_BUCKETS,
            registry=registry,
        )

        # labelled series already looked up: ``labels()`` validates and locks on every
        # call, and this runs for every placed job
        self._placed: dict[tuple[str, str], Counter] = {}
        self._matched: dict[str, Histogram] = {}

    def observe(self, request: PlacementRequest, placement: Placement) -> None:
        key = (request.model, placement.reason.value)
        placed = self._placed.get(key)
        if placed is None:
            placed = self._placed[key] = self.placements.labels(*key)
        placed.inc()
        if placement.worker_id is not None:
            matched = self._matched.get(request.model)
            if matched is None:
                matched = self._matched[request.model] = self.matched_blocks.labels(request.model)
            matched.observe(placement.matched_blocks)
