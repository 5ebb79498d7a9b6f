"""Where image bytes and image embeddings wait between stages, named by content hash.

* :class:`ImageStore`: the gateway stores each validated image's bytes in Redis
  (a key with a TTL that outlives the request); encode and language workers read
  them from there, so no worker fetches a URL again.
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
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import redis.asyncio as aioredis

from shared.errors import MediaMissing
from shared.images import DecodedImageCache, decode_rgb
from shared.queue import names

if TYPE_CHECKING:
    from PIL.Image import Image


class ImageStore:
    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis

    async def put_many(self, images: Sequence[tuple[str, bytes]], ttl_s: int) -> None:
        """Store each (digest, bytes) unless present; either way it lives ``ttl_s`` more."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for digest, data in images:
                pipe.set(names.image(digest), data, ex=ttl_s, nx=True)
                pipe.expire(names.image(digest), ttl_s, gt=True)
            await pipe.execute()

    async def get(self, digest: str) -> bytes:
        data = await self._redis.get(names.image(digest))
        if not isinstance(data, bytes):
            raise MediaMissing(f"image {digest[:12]} expired before it was used; retry")
        return data


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
