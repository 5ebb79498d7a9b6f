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

    def observe(self, request: PlacementRequest, placement: Placement) -> None:
        self.placements.labels(request.model, placement.reason.value).inc()
        if placement.worker_id is not None:
            self.matched_blocks.labels(request.model).observe(placement.matched_blocks)
