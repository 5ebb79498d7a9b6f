"""Workers' KV cache events in Redis: the wire format, the worker's writes, the reads of a
gateway's prefix index.

Every worker appends to one stream, :data:`~shared.queue.names.KV_EVENTS_STREAM`, trimmed to
about :data:`STREAM_MAXLEN` entries (events are a hint that snapshots can rebuild; jobs
never travel here):

* :class:`KvBatch`: the events of one engine step (vLLM's ``BlockStored`` /
  ``BlockRemoved`` / ``AllBlocksCleared``, with the stored blocks' token ids), numbered
  per worker from 0. A reader that sees a number skipped has lost a batch.
* :class:`SnapshotWritten`: the worker has just written its snapshot
  (:func:`~shared.queue.names.kv_snapshot`: every block it caches, as ``(engine hash,
  Conveyor's name)`` pairs, at most :data:`SNAPSHOT_MAX_BLOCKS`) as of batch ``seq``. A
  reader that lost a batch reads it and goes on from there.
* :class:`WorkerLeft`: the worker stopped; its blocks are gone.
* :class:`PendingBlocks`: a job that will prefill these blocks has just started on the
  worker (unnumbered: a hint, which a gateway counts as held until its engine's own
  events confirm it or it expires; one lost costs a placement, never a batch).

A snapshot key lives :data:`SNAPSHOT_TTL_INTERVALS` snapshot intervals, rewritten or
renewed every interval, so a dead worker's snapshot soon expires.
"""

from __future__ import annotations

from typing import Any

import msgspec
import redis.asyncio as aioredis

from shared.connections.connect import as_text
from shared.queue import names

STREAM_MAXLEN = 10_000
"""Entries the stream keeps (approximately). A batch is ~2.5 bytes per stored token, so a
full stream of 4k-token prompts' batches holds ~100 MB at worst: bound before all."""
SNAPSHOT_MAX_BLOCKS = 262_144
"""Blocks one snapshot holds at most (16 bytes each: 4 MiB), the newest kept."""
SNAPSHOT_TTL_INTERVALS = 3


class StoredBlocks(msgspec.Struct, frozen=True, array_like=True, tag="s"):
    """Full blocks now cached, in chain order (vLLM's ``BlockStored``)."""

    engine_hashes: list[int]
    parent: int | None
    """The engine hash of the block before the first one (None: they start a sequence)."""
    token_ids: list[int]
    """Every token of the blocks (block size x blocks)."""
    lora: str | None = None
    """The LoRA adapter whose blocks these are (None: the base model)."""


class RemovedBlocks(msgspec.Struct, frozen=True, array_like=True, tag="r"):
    engine_hashes: list[int]


class ClearedBlocks(msgspec.Struct, frozen=True, array_like=True, tag="c"):
    pass


KvEvent = StoredBlocks | RemovedBlocks | ClearedBlocks


class KvBatch(msgspec.Struct, frozen=True, array_like=True, tag="b"):
    worker_id: str
    model: str
    block_size: int
    seq: int
    """0 for the worker's first batch, then one more per batch."""
    events: list[KvEvent]


class SnapshotWritten(msgspec.Struct, frozen=True, array_like=True, tag="n"):
    worker_id: str
    seq: int


class WorkerLeft(msgspec.Struct, frozen=True, array_like=True, tag="l"):
    worker_id: str


class PendingBlocks(msgspec.Struct, frozen=True, array_like=True, tag="p"):
    worker_id: str
    names: list[int]
    """Conveyor's names (shared/block_hashes.py) of the prompt blocks the job will compute
    there, in chain order (those the gateway already found cached there left out)."""


Entry = KvBatch | SnapshotWritten | WorkerLeft | PendingBlocks


class KvSnapshot(msgspec.Struct, frozen=True, array_like=True):
    worker_id: str
    model: str
    block_size: int
    seq: int
    """The last batch whose events it includes (-1: none yet)."""
    blocks: list[tuple[int, int]]
    """``(engine hash, Conveyor's block name)`` of every cached block."""


_FIELD = b"e"
_entry_encoder = msgspec.msgpack.Encoder()
_entry_decoder = msgspec.msgpack.Decoder(Entry)
_snapshot_decoder = msgspec.msgpack.Decoder(KvSnapshot)


class KvEventWriter:
    """A worker's side: its batches, snapshots and leaving."""

    def __init__(self, redis: aioredis.Redis, worker_id: str, *, maxlen: int = STREAM_MAXLEN):
        self._redis = redis
        self.worker_id = worker_id
        self._maxlen = maxlen

    async def publish(self, batch: KvBatch) -> None:
        await self._add(batch)

    async def announce(self, pending: list[PendingBlocks]) -> None:
        """Jobs' blocks to come, in one round trip."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for entry in pending:
                self._xadd(pipe, entry)
            await pipe.execute()

    async def write_snapshot(self, snapshot: KvSnapshot, ttl_s: float) -> None:
        """Store the snapshot, then announce it, in one step."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(
                names.kv_snapshot(self.worker_id),
                _entry_encoder.encode(snapshot),
                px=int(ttl_s * 1000),
            )
            self._xadd(pipe, SnapshotWritten(self.worker_id, snapshot.seq))
            await pipe.execute()

    async def keep_snapshot(self, ttl_s: float) -> bool:
        """Renew the snapshot's expiry; False when it is gone (write it again)."""
        return bool(await self._redis.pexpire(names.kv_snapshot(self.worker_id), int(ttl_s * 1000)))

    async def leave(self) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.delete(names.kv_snapshot(self.worker_id))
            self._xadd(pipe, WorkerLeft(self.worker_id))
            await pipe.execute()

    async def _add(self, entry: Entry) -> None:
        await self._redis.xadd(
            names.KV_EVENTS_STREAM,
            {_FIELD: _entry_encoder.encode(entry)},
            maxlen=self._maxlen,
            approximate=True,
        )

    def _xadd(self, pipe: aioredis.client.Pipeline, entry: Entry) -> None:
        pipe.xadd(
            names.KV_EVENTS_STREAM,
            {_FIELD: _entry_encoder.encode(entry)},
            maxlen=self._maxlen,
            approximate=True,
        )


class KvEventReader:
    """A gateway's side: the stream from a position on, and the snapshots."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis

    async def read(
        self, after: bytes | str, *, block_ms: int, count: int = 512
    ) -> list[tuple[bytes, Entry | None]]:
        """Entries after stream id ``after`` (waiting up to ``block_ms`` for the first);
        an entry that cannot be decoded comes back as None (skip it, keep its id)."""
        reply: Any = await self._redis.xread(
            {names.KV_EVENTS_STREAM: after}, count=count, block=block_ms
        )
        found: list[tuple[bytes, Entry | None]] = []
        for _, entries in reply or []:
            for entry_id, fields in entries:
                found.append((entry_id, _decode_entry(fields.get(_FIELD))))
        return found

    async def snapshot(self, worker_id: str) -> KvSnapshot | None:
        raw = await self._redis.get(names.kv_snapshot(worker_id))
        return _decode_snapshot(raw)

    async def snapshots(self) -> list[KvSnapshot]:
        """Every listed worker's snapshot (a gateway starting up): a snapshot expires soon
        after its worker, and a worker leaves ``names.WORKER_SET`` a while after that."""
        listed: Any = await self._redis.zrange(names.WORKER_SET, 0, -1)
        if not listed:
            return []
        values = await self._redis.mget([names.kv_snapshot(as_text(w)) for w in listed])
        snapshots = (_decode_snapshot(value) for value in values)
        return [snapshot for snapshot in snapshots if snapshot is not None]


def _decode_entry(raw: bytes | None) -> Entry | None:
    if raw is None:
        return None
    try:
        entry: Entry = _entry_decoder.decode(raw)
    except msgspec.DecodeError:
        return None
    return entry


def _decode_snapshot(raw: bytes | str | None) -> KvSnapshot | None:
    if not isinstance(raw, bytes):
        return None  # missing (a client decoding replies to str is not one of ours)
    try:
        return _snapshot_decoder.decode(raw)
    except msgspec.DecodeError:
        return None
