"""vLLM's KV cache events, from its engine core to the worker.

vLLM publishes them only over ZeroMQ (``kv_events_config``, publisher ``zmq``), from the
engine core's process (or its thread, when the engine runs in process): the worker binds
nothing, it gives the engine a private ``ipc://`` endpoint and subscribes to it. Each
message is one engine step (``KVEventBatch``, msgpack), numbered by vLLM; a skipped
number means ZeroMQ dropped a step (past its high-water mark), which is logged.

Translated for Redis (shared/queue/kv_events.py): block hashes become 64-bit ints
(vLLM's sha256 bytes folded as its own ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` does);
blocks of other media than the engine's KV cache (offloading tiers) and of other KV
cache groups than the first are left out; a stored run stops at the first block whose
hash also covers images or a ``cache_salt`` (the gateway names blocks from tokens alone,
so those blocks could match a prompt they do not hold).
"""

from __future__ import annotations

import logging
import os
import secrets
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from shared.queue.kv_events import ClearedBlocks, KvEvent, RemovedBlocks, StoredBlocks

log = logging.getLogger(__name__)

TOPIC = b"kv"
MEDIA = (None, "GPU")
"""vLLM names its main KV cache medium "GPU" (also on CPU builds)."""
_MASK = (1 << 64) - 1


def private_endpoint() -> str:
    """A fresh ipc:// endpoint, only this worker's."""
    name = f"conveyor-kv-{os.getpid()}-{secrets.token_hex(4)}"
    return f"ipc://{os.path.join(tempfile.gettempdir(), name)}"


def kv_events_config(endpoint: str) -> Any:
    from vllm.config import KVEventsConfig

    return KVEventsConfig(
        enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint, topic=TOPIC.decode()
    )


async def subscribe(endpoint: str) -> AsyncIterator[list[KvEvent]]:
    """Every engine step's events from now on (steps with none that Redis wants skipped)."""
    import zmq
    import zmq.asyncio
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    context = zmq.asyncio.Context.instance()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, TOPIC)
    socket.connect(endpoint)
    last: int | None = None
    try:
        while True:
            _, number, payload = await socket.recv_multipart()
            seq = int.from_bytes(number, "big", signed=True)
            if last is not None and seq != last + 1:
                log.warning("vLLM KV events %d-%d were dropped by ZeroMQ", last + 1, seq - 1)
            last = seq
            events = translate(decoder.decode(payload).events)
            if events:
                yield events
    finally:
        socket.close(linger=0)


def translate(events: list[Any]) -> list[KvEvent]:
    """vLLM's ``BlockStored`` / ``BlockRemoved`` / ``AllBlocksCleared`` as Conveyor's."""
    out: list[KvEvent] = []
    for event in events:
        kind = type(event).__name__
        if kind == "AllBlocksCleared":
            out.append(ClearedBlocks())
        elif event.medium not in MEDIA or getattr(event, "group_idx", None) not in (None, 0):
            continue
        elif kind == "BlockRemoved":
            out.append(RemovedBlocks([engine_hash(h) for h in event.block_hashes]))
        elif kind == "BlockStored":
            stored = _stored(event)
            if stored is not None:
                out.append(stored)
    return out


def _stored(event: Any) -> StoredBlocks | None:
    count = _plain_blocks(event)
    if count == 0:
        return None
    parent = event.parent_block_hash
    return StoredBlocks(
        [engine_hash(h) for h in event.block_hashes[:count]],
        None if parent is None else engine_hash(parent),
        list(event.token_ids[: count * event.block_size]),
        event.lora_name,
    )


def _plain_blocks(event: Any) -> int:
    """How many of the first blocks are named by tokens (and the adapter) alone."""
    extra_keys = event.extra_keys or []
    own = 1 if event.lora_name else 0
    for index, keys in enumerate(extra_keys):
        if keys is not None and len(keys) > own:
            return index
    return len(event.block_hashes)


def engine_hash(value: int | bytes) -> int:
    if isinstance(value, bytes):
        return int.from_bytes(value, "big") & _MASK
    return value
