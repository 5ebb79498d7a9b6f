"""Cache-aware placement on one Redis, assembled: the prefix index, its feeder, the placer."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import redis.asyncio as aioredis

from gateway.placement.cache_placer import CachePlacer, CostPolicy, OnPlaced, PlacementSettings
from gateway.placement.index_feeder import IndexFeeder
from gateway.placement.prefix_index import PrefixIndex
from shared.block_hashes import COMPILED
from shared.queue.kv_events import KvEventReader
from shared.queue.liveness import WorkerRegistry

log = logging.getLogger(__name__)


class CachePlacementSettings(PlacementSettings, Protocol):
    placement_index_max_blocks: int
    placement_pending_s: float
    placement_feed_interval_ms: int
    heartbeat_ttl_s: float


@dataclass(frozen=True, slots=True)
class CachePlacement:
    index: PrefixIndex
    feeder: IndexFeeder
    """Run :meth:`IndexFeeder.run` as a background task for as long as the gateway serves."""
    placer: CachePlacer


def build_cache_placement(
    settings: CachePlacementSettings, redis: aioredis.Redis, *, on_placed: OnPlaced | None = None
) -> CachePlacement:
    """The index of the workers on ``redis``, fed from its KV event stream, and its placer."""
    if not COMPILED:
        log.warning(
            "block names are computed in Python (shared/_chain.c was not built: no C "
            "compiler at install?); placement costs about 3x more CPU per request. "
            "Reinstall with a C compiler (make install) to fix it"
        )
    index = PrefixIndex(
        max_blocks=settings.placement_index_max_blocks, pending_s=settings.placement_pending_s
    )
    registry = WorkerRegistry(redis, ttl_s=settings.heartbeat_ttl_s)
    feeder = IndexFeeder(
        KvEventReader(redis),
        index,
        registry,
        read_interval_s=settings.placement_feed_interval_ms / 1000,
    )
    placer = CachePlacer(index, CostPolicy.from_settings(settings), on_placed=on_placed)
    return CachePlacement(index=index, feeder=feeder, placer=placer)
