"""Feeds a gateway's :class:`~gateway.placement.prefix_index.PrefixIndex` from Redis.

One task per Redis: loads every worker's snapshot, then reads the KV event stream from
its oldest entry on with ``XREAD BLOCK`` (costs nothing at idle) and applies each entry.
A worker whose batch cannot be applied (one was lost, or the gateway started after the
stream's oldest entries were trimmed) is rebuilt from its snapshot: at once if the
snapshot is recent enough, else at its next one. Dead workers (liveness key expired)
are dropped every ``dead_check_s``; a worker that leaves says so on the stream.
Blocks workers announce as coming count as theirs until the index expires them, checked
after every read (a read waits at most ``block_ms``).
Reads come at most once per ``read_interval_s``: every worker adds an entry per engine
step, and reading each on its own would cost the gateway a Redis command per worker
step (16 workers at 12 ms steps: 1,300 a second); a read takes all that came since.
After a Redis error it starts over (snapshots, then the stream from its start):
batches already applied are recognized by their numbers.
"""

from __future__ import annotations

import asyncio
import logging
import time

from redis.exceptions import RedisError

from gateway.placement.prefix_index import PrefixIndex
from shared.connections.connect import MAX_BLOCK_MS
from shared.queue.kv_events import (
    KvBatch,
    KvEventReader,
    PendingBlocks,
    SnapshotWritten,
    WorkerLeft,
)
from shared.queue.liveness import WorkerRegistry

log = logging.getLogger(__name__)

START = b"0-0"
RETRY_S = 1.0
READ_COUNT = 512
"""Entries a read takes at most; a full read is followed by the next at once (a backlog)."""


class IndexFeeder:
    def __init__(
        self,
        reader: KvEventReader,
        index: PrefixIndex,
        registry: WorkerRegistry,
        *,
        block_ms: int = MAX_BLOCK_MS,
        dead_check_s: float = 5.0,
        read_interval_s: float = 0.0,
    ) -> None:
        self._reader = reader
        self.index = index
        self._registry = registry
        self._block_ms = min(block_ms, MAX_BLOCK_MS)
        self._dead_check_s = dead_check_s
        self._read_interval_s = read_interval_s
        self._awaiting_notice: set[str] = set()
        self._last_dead_check = 0.0
        self.entries = 0
        """Stream entries read since the start (tests wait on it)."""

    async def run(self) -> None:
        while True:
            try:
                await self._follow()
            except RedisError as exc:
                log.warning("KV event feed: %s; starting over in %.0fs", exc, RETRY_S)
                await asyncio.sleep(RETRY_S)

    async def _follow(self) -> None:
        for snapshot in await self._reader.snapshots():
            self.index.load(snapshot)
        last = START
        while True:
            began = time.monotonic()
            entries = await self._reader.read(last, block_ms=self._block_ms, count=READ_COUNT)
            for entry_id, entry in entries:
                last = entry_id
                self.entries += 1
                await self.apply(entry)
            self.index.expire(time.monotonic())
            await self._drop_dead()
            if 0 < len(entries) < READ_COUNT:
                await self._pace(began)

    async def _pace(self, began: float) -> None:
        """Wait out the rest of the read interval that began at ``began``."""
        rest = began + self._read_interval_s - time.monotonic()
        if rest > 0:
            await asyncio.sleep(rest)

    async def apply(
        self, entry: KvBatch | SnapshotWritten | WorkerLeft | PendingBlocks | None
    ) -> None:
        if isinstance(entry, PendingBlocks):
            self.index.pending(entry, time.monotonic())
        elif isinstance(entry, KvBatch):
            if not self.index.apply(entry) and entry.worker_id not in self._awaiting_notice:
                await self._rebuild(entry.worker_id, entry)
        elif isinstance(entry, SnapshotWritten):
            if self.index.lost(entry.worker_id):
                await self._rebuild(entry.worker_id, None)
        elif isinstance(entry, WorkerLeft):
            self.index.drop(entry.worker_id)
            self._awaiting_notice.discard(entry.worker_id)

    async def _rebuild(self, worker_id: str, batch: KvBatch | None) -> None:
        """Load the worker's snapshot if it covers up to ``batch`` (then apply ``batch``);
        else wait for the worker's next snapshot."""
        snapshot = await self._reader.snapshot(worker_id)
        if snapshot is None or (batch is not None and snapshot.seq < batch.seq - 1):
            self._awaiting_notice.add(worker_id)
            return
        self.index.load(snapshot)
        self._awaiting_notice.discard(worker_id)
        if batch is not None:
            self.index.apply(batch)
        log.info(
            "prefix index: worker %s rebuilt from its snapshot (batch %d)", worker_id, snapshot.seq
        )

    async def _drop_dead(self) -> None:
        now = time.monotonic()
        if now - self._last_dead_check < self._dead_check_s:
            return
        self._last_dead_check = now
        for worker_id in await self._registry.dead(self.index.worker_ids()):
            log.info("prefix index: worker %s is dead, its blocks are dropped", worker_id)
            self.index.drop(worker_id)
            self._awaiting_notice.discard(worker_id)
