"""Where images and embeddings wait between stages: Redis keys with TTLs, or a shared folder."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import fakeredis.aioredis
import pytest

from shared.errors import ImageStoreFull, MediaMissing
from shared.queue import names
from shared.queue.media_store import (
    FileEmbeddingStore,
    ImageStore,
    RedisEmbeddingStore,
    embedding_store,
)


async def test_image_store_keeps_one_copy_and_extends_its_life() -> None:
    redis = fakeredis.aioredis.FakeRedis()
    store = ImageStore(redis)
    await store.put_many([("abc", b"png-bytes")], ttl_s=60)
    await store.put_many([("abc", b"png-bytes")], ttl_s=600)  # a later request needs it longer
    assert await store.get("abc") == b"png-bytes"
    assert 60 < await redis.ttl(names.image("abc")) <= 600
    await store.put_many([("abc", b"png-bytes")], ttl_s=10)  # never shortened
    assert await redis.ttl(names.image("abc")) > 60
    with pytest.raises(MediaMissing, match="expired"):
        await store.get("missing")


async def test_redis_embedding_transport() -> None:
    redis = fakeredis.aioredis.FakeRedis()
    store = embedding_store("redis", redis)
    assert isinstance(store, RedisEmbeddingStore)
    await store.put("m", "abc", b"\x00\x01", ttl_s=30)
    assert await store.get("m", "abc") == b"\x00\x01"
    assert 0 < await redis.ttl(names.image_embedding("m", "abc")) <= 30
    with pytest.raises(MediaMissing):
        await store.get("other-model", "abc")


async def test_folder_embedding_transport_writes_atomically_and_sweeps(tmp_path: Path) -> None:
    store = embedding_store(str(tmp_path), fakeredis.aioredis.FakeRedis())
    assert isinstance(store, FileEmbeddingStore)
    await store.put("org/model", "old", b"stale", ttl_s=30)
    old = tmp_path / "org--model" / "old.emb"
    os.utime(old, (time.time() - 1, time.time() - 1))  # its deadline has passed
    await store.put("org/model", "new", b"fresh", ttl_s=30)
    assert await store.get("org/model", "new") == b"fresh"
    assert not old.exists()
    assert os.listdir(tmp_path / "org--model") == ["new.emb"]
    with pytest.raises(MediaMissing):
        await store.get("org/model", "old")


async def test_image_store_counts_bytes_under_a_budget_and_the_last_holder_deletes() -> None:
    redis = fakeredis.aioredis.FakeRedis()
    store = ImageStore(redis, max_stored_bytes=10)
    await store.put_many([("a", b"12345"), ("a", b"12345")], ttl_s=60)  # one request, once
    await store.put_many([("a", b"12345")], ttl_s=60)  # a second request shares it
    assert await store.stored_bytes() == 5
    results = await asyncio.gather(
        store.put_many([("b", b"123456")], ttl_s=60),
        store.put_many([("c", b"1234")], ttl_s=60),
        return_exceptions=True,
    )
    assert sum(isinstance(r, ImageStoreFull) for r in results) <= 1
    assert await store.stored_bytes() <= 10
    with pytest.raises(ImageStoreFull) as caught:
        await store.put_many([("d", b"123456789")], ttl_s=60)
    assert caught.value.status == 503 and caught.value.retry_after_s >= 1
    assert not await redis.exists(names.image("d"))
    await store.release(["a"])
    assert await store.get("a") == b"12345"  # the other request still holds it
    await store.release(["a", "b", "c"])
    assert await store.stored_bytes() == 0
    assert [key async for key in redis.scan_iter("conveyor:image*")] == []


async def test_expired_images_leave_the_count() -> None:
    redis = fakeredis.aioredis.FakeRedis()
    store = ImageStore(redis, max_stored_bytes=10)
    await store.put_many([("a", b"123456789")], ttl_s=60)
    await redis.delete(names.image("a"))  # as its TTL would
    await redis.zadd(names.IMAGE_EXPIRY, {"a": 0})
    await store.put_many([("b", b"12345")], ttl_s=60)  # fits once "a" is swept
    assert await store.stored_bytes() == 5
