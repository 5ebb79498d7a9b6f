"""Where images and embeddings wait between stages: Redis keys with TTLs, or a shared folder."""

from __future__ import annotations

import os
import time
from pathlib import Path

import fakeredis.aioredis
import pytest

from shared.errors import MediaMissing
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
