"""Forwards an engine's KV cache events to Redis (shared/queue/kv_events.py).

Each engine step's events become one numbered batch on the KV event stream. The worker
keeps its own copy of what its engine caches (:class:`~shared.block_hashes.EngineBlockMap`)
and, every ``snapshot_s`` when it changed, writes it as the snapshot a gateway that lost
a batch rebuilds from (unchanged: the snapshot's expiry is only renewed). A batch that
cannot be written (Redis down) is not retried: readers see the gap and wait for the next
snapshot. When the worker stops (or its engine's events fail), it says so and deletes its
snapshot.

A job that starts here is announced too (:meth:`KvEventForwarder.announce`): the names of
the prompt blocks its engine is about to compute, so that a gateway places the next
request with that prefix (a tenant's next conversation, sent while the first is still
prefilling) here rather than where nothing of it is coming. Named and written from the
forwarder's own task, never on the job's path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Sequence

from redis.exceptions import RedisError

from shared.block_hashes import EngineBlockMap, block_names, chain_seed, prompt_blocks
from shared.queue.kv_events import (
    SNAPSHOT_MAX_BLOCKS,
    SNAPSHOT_TTL_INTERVALS,
    KvBatch,
    KvEvent,
    KvEventWriter,
    KvSnapshot,
    PendingBlocks,
)
from workers.engines.base import KvEventFeed

log = logging.getLogger(__name__)

LEAVE_TIMEOUT_S = 1.0
ANNOUNCE_MAX_JOBS = 1024
"""Started jobs waiting to be announced (past it the oldest are left out: a hint)."""


class KvEventForwarder:
    def __init__(
        self, writer: KvEventWriter, feed: KvEventFeed, model: str, *, snapshot_s: float
    ) -> None:
        self._writer = writer
        self._feed = feed
        self._model = model
        self._snapshot_s = snapshot_s
        self.blocks = EngineBlockMap(model, feed.block_size)
        self._next_seq = 0
        self._changed = False
        self._failing = False
        self._lock = asyncio.Lock()
        self._to_announce: deque[tuple[Sequence[int], str | None, int]] = deque(
            maxlen=ANNOUNCE_MAX_JOBS
        )
        self._announced = asyncio.Event()
        self.batches = 0
        """Batches written to Redis (tests wait on it)."""

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(self._forward())
                group.create_task(self._snapshots())
                group.create_task(self._announcements())
        except Exception:  # the gateways then drop this worker's blocks: placement by load
            log.exception("KV events stopped; this worker's cache is no longer indexed")
        finally:
            with contextlib.suppress(RedisError, TimeoutError):
                async with asyncio.timeout(LEAVE_TIMEOUT_S):
                    await self._writer.leave()

    async def _forward(self) -> None:
        async for events in self._feed.batches():
            async with self._lock:
                await self._publish(events)

    async def _publish(self, events: list[KvEvent]) -> None:
        for event in events:
            self.blocks.apply(event)
        self._changed = True
        batch = KvBatch(
            self._writer.worker_id, self._model, self._feed.block_size, self._next_seq, events
        )
        self._next_seq += 1
        try:
            await self._writer.publish(batch)
        except RedisError as exc:
            self._failed(exc)
            return
        self.batches += 1
        self._recovered()

    def announce(self, token_ids: Sequence[int], lora: str | None, cached_tokens: int) -> None:
        """A job that will prefill ``token_ids`` (with adapter ``lora``) started here; the
        gateway that placed it found ``cached_tokens`` of them cached here already."""
        self._to_announce.append((token_ids, lora, cached_tokens))
        self._announced.set()

    async def _announcements(self) -> None:
        while True:
            await self._announced.wait()
            self._announced.clear()
            pending = []
            while self._to_announce:
                names = self._coming(*self._to_announce.popleft())
                if names:
                    pending.append(PendingBlocks(self._writer.worker_id, names))
            if not pending:
                continue
            try:
                await self._writer.announce(pending)
            except RedisError as exc:
                self._failed(exc)

    def _coming(self, token_ids: Sequence[int], lora: str | None, cached_tokens: int) -> list[int]:
        """Names of the prompt's blocks the engine will compute (from the first one the
        gateway did not find cached here)."""
        size = self._feed.block_size
        full = prompt_blocks(len(token_ids), size) * size
        names = block_names(token_ids[:full], size, chain_seed(self._model, lora))
        return names[cached_tokens // size :]

    async def _snapshots(self) -> None:
        ttl_s = self._snapshot_s * SNAPSHOT_TTL_INTERVALS
        while True:
            await asyncio.sleep(self._snapshot_s)
            async with self._lock:
                try:
                    if self._changed or not await self._writer.keep_snapshot(ttl_s):
                        await self._writer.write_snapshot(self.snapshot(), ttl_s)
                        self._changed = False
                except RedisError as exc:
                    self._failed(exc)

    def snapshot(self) -> KvSnapshot:
        """Every block cached, as of the last batch numbered."""
        return KvSnapshot(
            self._writer.worker_id,
            self._model,
            self._feed.block_size,
            self._next_seq - 1,
            self.blocks.pairs(SNAPSHOT_MAX_BLOCKS),
        )

    def _failed(self, exc: RedisError) -> None:
        if not self._failing:
            log.warning(
                "KV events not written to Redis (%s): gateways rebuild from a snapshot", exc
            )
        self._failing = True

    def _recovered(self) -> None:
        if self._failing:
            log.info("KV events written to Redis again")
        self._failing = False
