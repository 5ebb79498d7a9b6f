"""The encode worker's cache of image embeddings: keyed by image content, bounded by bytes.

Keyed by the SHA-256 of the image bytes (never by URL), so one picture under two
URLs is encoded once. Least recently used entries go first; an entry bigger than
the whole bound is not kept. Counters feed the worker's registry entry.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(slots=True)
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    entries: int = 0
    bytes: int = 0
    max_bytes: int = 0


class EmbeddingCache:
    def __init__(self, max_bytes: int) -> None:
        self._entries: OrderedDict[str, bytes] = OrderedDict()
        self.stats = CacheStats(max_bytes=max_bytes)

    def get(self, digest: str) -> bytes | None:
        blob = self._entries.get(digest)
        if blob is None:
            self.stats.misses += 1
            return None
        self._entries.move_to_end(digest)
        self.stats.hits += 1
        return blob

    def put(self, digest: str, blob: bytes) -> None:
        if len(blob) > self.stats.max_bytes or digest in self._entries:
            return
        self._entries[digest] = blob
        self.stats.bytes += len(blob)
        while self.stats.bytes > self.stats.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.stats.bytes -= len(evicted)
            self.stats.evictions += 1
        self.stats.entries = len(self._entries)
