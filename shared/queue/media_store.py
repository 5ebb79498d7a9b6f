"""Where image bytes and image embeddings wait between stages, named by content hash.

* :class:`ImageStore`: the gateway stores each validated image's bytes in Redis
  (a key with a TTL, bounded by ``CONVEYOR_IMAGE_STORE_TTL_S``) once its request is
  past its cheap checks, and deletes them when the last request holding them ends or
  is refused; encode and language workers read them from there, so no worker fetches
  a URL again. The bytes stored are counted: over ``CONVEYOR_IMAGE_STORE_MAX_BYTES``
  a new image is refused (503) rather than stored.
* embedding transports: an encode worker hands embeddings to the language stage
  through Redis (:class:`RedisEmbeddingStore`, a key with a TTL; the default) or
  a folder every worker can read (:class:`FileEmbeddingStore`, shared storage for
  embeddings too big for Redis). Both store opaque bytes; the encoder defines them.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import redis.asyncio as aioredis

from shared.errors import ImageStoreFull, MediaMissing
from shared.images import DecodedImageCache, decode_rgb
from shared.queue import names

if TYPE_CHECKING:
    from PIL.Image import Image


# KEYS: the byte counter, the sizes hash, the holds hash, the expiry set (shared by both
# scripts), then one image key per digest. ARGV: the image key prefix, then the script's own.
# `forget` un-counts an image whose key is gone (expired or deleted); `sweep` does that for
# up to 64 images whose expiry has passed, so the counter follows TTLs at a bounded cost.
_IMAGE_BOOKS = """
local total_key, sizes, holds, expiry = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local prefix = ARGV[1]
local clock = redis.call('TIME')
local now_ms = tonumber(clock[1]) * 1000 + math.floor(tonumber(clock[2]) / 1000)
local function forget(digest)
  local size = tonumber(redis.call('HGET', sizes, digest) or '0')
  if size > 0 and redis.call('DECRBY', total_key, size) <= 0 then redis.call('DEL', total_key) end
  redis.call('HDEL', sizes, digest)
  redis.call('HDEL', holds, digest)
  redis.call('ZREM', expiry, digest)
end
local function sweep()
  for _, digest in ipairs(redis.call('ZRANGEBYSCORE', expiry, '-inf', now_ms, 'LIMIT', 0, 64)) do
    local left_ms = redis.call('PTTL', prefix .. digest)
    if left_ms < 0 then forget(digest) else redis.call('ZADD', expiry, now_ms + left_ms, digest) end
  end
end
"""

# ARGV[2]: ttl s, ARGV[3]: the budget (bytes), then n digests, then their n byte strings.
# Returns {1, bytes stored now} or, over the budget, {0, bytes stored now} and stores nothing.
_PUT = (
    _IMAGE_BOOKS
    + """
sweep()
local ttl, budget, n = tonumber(ARGV[2]), tonumber(ARGV[3]), #KEYS - 4
local adding = 0
for i = 1, n do
  if redis.call('EXISTS', KEYS[4 + i]) == 0 then
    forget(ARGV[3 + i])
    adding = adding + #ARGV[3 + n + i]
  end
end
local used = tonumber(redis.call('GET', total_key) or '0')
if adding > 0 and used + adding > budget then return {0, used} end
for i = 1, n do
  local key, digest, data = KEYS[4 + i], ARGV[3 + i], ARGV[3 + n + i]
  if redis.call('EXISTS', key) == 0 then
    redis.call('SET', key, data, 'EX', ttl)
    redis.call('HSET', sizes, digest, #data)
    redis.call('INCRBY', total_key, #data)
  else
    redis.call('EXPIRE', key, ttl, 'GT')
  end
  redis.call('HINCRBY', holds, digest, 1)
  redis.call('ZADD', expiry, 'GT', now_ms + ttl * 1000, digest)
end
return {1, used + adding}
"""
)

# ARGV[2..]: digests. Each loses one hold; one left with none is deleted and un-counted.
_RELEASE = (
    _IMAGE_BOOKS
    + """
for i = 1, #KEYS - 4 do
  local digest = ARGV[1 + i]
  if redis.call('HINCRBY', holds, digest, -1) <= 0 then
    redis.call('DEL', KEYS[4 + i])
    forget(digest)
  end
end
sweep()
return 1
"""
)

UNLIMITED_BYTES = 2**62


class ImageStore:
    """Image bytes by content hash, with their books: the bytes stored (kept under a
    budget), and how many open requests hold each image (the last one out deletes it)."""

    def __init__(self, redis: aioredis.Redis, *, max_stored_bytes: int = UNLIMITED_BYTES) -> None:
        self._redis = redis
        self._max_stored_bytes = max_stored_bytes
        self._put = redis.register_script(_PUT)
        self._release = redis.register_script(_RELEASE)

    async def put_many(self, images: Sequence[tuple[str, bytes]], ttl_s: int) -> None:
        """Store each (digest, bytes) unless present (either way it lives ``ttl_s`` more)
        and hold it for one request: all or none. Raises ImageStoreFull (503) when the new
        bytes would pass the budget."""
        unique = dict(images)
        if not unique:
            return
        keys = [names.image(digest) for digest in unique]
        args: list[str | int | bytes] = [names.image(""), ttl_s, self._max_stored_bytes]
        args += [*unique, *unique.values()]
        stored, used = await self._put(keys=[*_BOOKS, *keys], args=args)
        if not int(stored):
            raise ImageStoreFull(
                f"the image store is full ({int(used)} of {self._max_stored_bytes} bytes, "
                "CONVEYOR_IMAGE_STORE_MAX_BYTES); retry shortly",
                retry_after_s=5,
            )

    async def release(self, digests: Iterable[str]) -> None:
        """One request no longer holds these images: those no one holds are deleted."""
        unique = list(dict.fromkeys(digests))
        if unique:
            keys = [names.image(digest) for digest in unique]
            await self._release(keys=[*_BOOKS, *keys], args=[names.image(""), *unique])

    async def stored_bytes(self) -> int:
        return int(await self._redis.get(names.IMAGE_BYTES) or 0)

    async def get(self, digest: str) -> bytes:
        data = await self._redis.get(names.image(digest))
        if not isinstance(data, bytes):
            raise MediaMissing(f"image {digest[:12]} expired before it was used; retry")
        return data


_BOOKS = [names.IMAGE_BYTES, names.IMAGE_SIZES, names.IMAGE_HOLDS, names.IMAGE_EXPIRY]


class DecodedImages:
    """Stored images by content hash, decoded to RGB once: an LRU in front of the store."""

    def __init__(self, store: ImageStore, cache_bytes: int) -> None:
        self._store = store
        self._decoded = DecodedImageCache(cache_bytes)

    async def get(self, digest: str) -> Image:
        image = self._decoded.get(digest)
        if image is None:
            image = await asyncio.to_thread(decode_rgb, await self._store.get(digest))
            self._decoded.put(digest, image)
        return image


class EmbeddingStore(Protocol):
    async def put(self, model: str, digest: str, blob: bytes, ttl_s: int) -> None: ...

    async def get(self, model: str, digest: str) -> bytes: ...


class RedisEmbeddingStore:
    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis

    async def put(self, model: str, digest: str, blob: bytes, ttl_s: int) -> None:
        await self._redis.set(names.image_embedding(model, digest), blob, ex=ttl_s)

    async def get(self, model: str, digest: str) -> bytes:
        blob = await self._redis.get(names.image_embedding(model, digest))
        if not isinstance(blob, bytes):
            raise MediaMissing(f"the embedding of image {digest[:12]} is gone; retry")
        return blob


class FileEmbeddingStore:
    """Files ``<folder>/<model>/<digest>.emb``, written atomically; expired ones are swept."""

    def __init__(self, folder: Path) -> None:
        self._folder = folder

    def _path(self, model: str, digest: str) -> Path:
        return self._folder / model.replace("/", "--") / f"{digest}.emb"

    async def put(self, model: str, digest: str, blob: bytes, ttl_s: int) -> None:
        await asyncio.to_thread(self._write, self._path(model, digest), blob, ttl_s)

    async def get(self, model: str, digest: str) -> bytes:
        try:
            return await asyncio.to_thread(self._path(model, digest).read_bytes)
        except FileNotFoundError as exc:
            raise MediaMissing(f"the embedding of image {digest[:12]} is gone; retry") from exc

    def _write(self, path: Path, blob: bytes, ttl_s: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
        with os.fdopen(handle, "wb") as out:
            out.write(blob)
        expires = time.time() + ttl_s
        os.utime(tmp, (expires, expires))  # mtime = expiry, for the sweep
        os.replace(tmp, path)
        self._sweep(path.parent)

    @staticmethod
    def _sweep(folder: Path) -> None:
        now = time.time()
        for stale in folder.glob("*.emb"):
            try:
                if stale.stat().st_mtime < now:
                    stale.unlink()
            except FileNotFoundError:
                continue


def embedding_store(transport: str, redis: aioredis.Redis) -> EmbeddingStore:
    """The store ``CONVEYOR_EMBEDDING_TRANSPORT`` names: ``redis`` or a folder path."""
    if transport == "redis":
        return RedisEmbeddingStore(redis)
    return FileEmbeddingStore(Path(transport))
