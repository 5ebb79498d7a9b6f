"""A KV cache of fixed size in blocks, with prefix caching as vLLM's block pool does it.

A full block is identified by a hash chained over the token ids: ``hash(parent hash,
block token ids, extra key)`` with a stable hash (blake2b, the same in every process).
A sequence reuses the longest chain of cached blocks of its prompt (never its last
token, which the engine always computes, as vLLM does). Blocks whose sequences ended
stay cached on a free list, least recently used first; a new block takes the first
free one, evicting what it cached (``BlockRemoved``).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from workers.engines.fake.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KvEventPublisher,
)


def block_hash(parent: int | None, token_ids: Sequence[int], extra: str | None = None) -> int:
    """A block's chained hash, as a signed 64-bit int (vLLM's KV events carry int64)."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update(b"\x00" if parent is None else struct.pack("<Bq", 1, parent))
    digest.update(struct.pack(f"<{len(token_ids)}Q", *token_ids))
    digest.update((extra or "").encode())
    return int.from_bytes(digest.digest(), "little", signed=True)


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    """Set while the block's content is in the prefix cache."""


@dataclass(slots=True)
class BlockTable:
    """One sequence's blocks, and the chained hashes of its full blocks so far."""

    extra: str | None = None
    """What else tells blocks apart besides their tokens (a LoRA adapter's name)."""
    blocks: list[Block] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)


class KvCache:
    def __init__(self, num_blocks: int, block_size: int, events: KvEventPublisher) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._events = events
        self._free: OrderedDict[int, Block] = OrderedDict((i, Block(i)) for i in range(num_blocks))
        self._cached: dict[int, Block] = {}

    # ------------------------------------------------------------------ queries

    def free_blocks(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """The fraction of blocks held by sequences (vLLM's kv_cache_usage)."""
        return 1.0 - len(self._free) / self.num_blocks

    def cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def prefix_hits(self, token_ids: Sequence[int], extra: str | None = None) -> list[Block]:
        """The cached blocks that start ``token_ids`` (the last token never counts)."""
        hits: list[Block] = []
        parent: int | None = None
        size = self.block_size
        for start in range(0, (len(token_ids) - 1) // size * size, size):
            parent = block_hash(parent, token_ids[start : start + size], extra)
            block = self._cached.get(parent)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_start(self, token_ids: Sequence[int], extra: str | None = None) -> bool:
        hits = self.prefix_hits(token_ids, extra)
        return self._can_take(self.blocks_for(len(token_ids)) - len(hits), hits)

    # ------------------------------------------------------------------ changes

    def start(self, table: BlockTable, token_ids: Sequence[int]) -> int | None:
        """Give a new sequence its prompt's blocks, cached ones first; returns the cached
        token count, or None (nothing changed) when too few blocks are free."""
        hits = self.prefix_hits(token_ids, table.extra)
        new = self.blocks_for(len(token_ids)) - len(hits)
        if not self._can_take(new, hits):
            return None
        for block in hits:
            self._touch(block)
        table.blocks = [*hits, *(self._take() for _ in range(new))]
        table.hashes = [block.hash for block in hits if block.hash is not None]
        return len(hits) * self.block_size

    def grow(self, table: BlockTable, num_tokens: int) -> bool:
        """Room for ``num_tokens`` in the sequence; False when no block is free."""
        while len(table.blocks) * self.block_size < num_tokens:
            if not self._free:
                return False
            table.blocks.append(self._take())
        return True

    def commit(self, table: BlockTable, token_ids: Sequence[int], computed: int) -> None:
        """Cache the blocks that the first ``computed`` tokens fill (``BlockStored``, one
        event per run of consecutive newly cached blocks)."""
        size = self.block_size
        runs: list[list[int]] = []
        for index in range(len(table.hashes), min(computed // size, len(table.blocks))):
            parent = table.hashes[-1] if table.hashes else None
            digest = block_hash(parent, token_ids[index * size : (index + 1) * size], table.extra)
            table.hashes.append(digest)
            if digest in self._cached:  # another sequence cached the same block meanwhile
                continue
            block = table.blocks[index]
            block.hash = digest
            self._cached[digest] = block
            if runs and runs[-1][-1] == index - 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        for run in runs:
            first, last = run[0], run[-1]
            self._events.add(
                BlockStored(
                    [table.hashes[i] for i in run],
                    table.hashes[first - 1] if first else None,
                    list(token_ids[first * size : (last + 1) * size]),
                    size,
                    lora_name=table.extra,
                )
            )

    def release(self, table: BlockTable) -> None:
        """A sequence ended (or was preempted): its blocks go back, last block first, so
        a chain's tail is evicted before its head."""
        for block in reversed(table.blocks):
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = block
                if block.hash is None:
                    self._free.move_to_end(block.block_id, last=False)
        table.blocks = []
        table.hashes = []

    def clear(self) -> bool:
        """Drop the prefix cache; False (nothing done) while sequences hold blocks."""
        if len(self._free) < self.num_blocks:
            return False
        for block in self._cached.values():
            block.hash = None
        self._cached.clear()
        self._events.add(AllBlocksCleared())
        return True

    # ------------------------------------------------------------------ internals

    def _can_take(self, new: int, hits: list[Block]) -> bool:
        idle_hits = sum(1 for block in hits if block.ref_count == 0)
        return new <= len(self._free) - idle_hits

    def _touch(self, block: Block) -> None:
        if block.ref_count == 0:
            del self._free[block.block_id]
        block.ref_count += 1

    def _take(self) -> Block:
        _, block = self._free.popitem(last=False)
        if block.hash is not None:
            del self._cached[block.hash]
            self._events.add(BlockRemoved([block.hash]))
            block.hash = None
        block.ref_count = 1
        return block
