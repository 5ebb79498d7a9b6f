"""The KV cache events the fake engine publishes: vLLM's ``BlockStored``, ``BlockRemoved``
and ``AllBlocksCleared``, in batches numbered per engine (a gap shows a lost batch).

Listeners are in-process callbacks (or an asyncio queue each); :func:`to_wire` turns them
into what the worker forwards to Redis (shared/queue/kv_events.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.queue import kv_events as wire


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Full blocks whose KV is now cached, in chain order."""

    block_hashes: list[int]
    parent_block_hash: int | None
    """The hash of the block before the first one (None: they start the sequence)."""
    token_ids: list[int]
    """Every token of the blocks, in order (len = block_size * len(block_hashes))."""
    block_size: int
    lora_id: int | None = None
    lora_name: str | None = None
    """The LoRA adapter whose blocks these are (vLLM's ``lora_name``)."""


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    block_hashes: list[int]


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    pass


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    """The events of one engine step."""

    seq: int
    """Increases by one per batch, per engine."""
    ts: float
    events: list[KvEvent]


Listener = Callable[[KvEventBatch], None]


@dataclass
class KvEventPublisher:
    """Collects a step's events, then hands them to every listener as one batch."""

    _pending: list[KvEvent] = field(default_factory=list)
    _listeners: list[Listener] = field(default_factory=list)
    _next_seq: int = 0

    def add(self, event: KvEvent) -> None:
        if self._listeners:
            self._pending.append(event)

    def subscribe(self, listener: Listener) -> None:
        self._listeners.append(listener)

    def unsubscribe(self, listener: Listener) -> None:
        self._listeners.remove(listener)

    def queue(self) -> asyncio.Queue[KvEventBatch]:
        """A queue that receives every batch from now on."""
        batches: asyncio.Queue[KvEventBatch] = asyncio.Queue()
        self.subscribe(batches.put_nowait)
        return batches

    def flush(self) -> KvEventBatch | None:
        """Publish the pending events as one batch (nothing pending: no batch)."""
        if not self._pending:
            return None
        batch = KvEventBatch(self._next_seq, time.time(), self._pending)
        self._next_seq += 1
        self._pending = []
        for listener in self._listeners:
            listener(batch)
        return batch


def to_wire(event: KvEvent) -> wire.KvEvent:
    if isinstance(event, BlockStored):
        return wire.StoredBlocks(
            event.block_hashes, event.parent_block_hash, event.token_ids, event.lora_name
        )
    if isinstance(event, BlockRemoved):
        return wire.RemovedBlocks(event.block_hashes)
    return wire.ClearedBlocks()
