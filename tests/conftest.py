"""Fixtures shared by every test layer.

``redis_backend`` runs a test twice: against fakeredis (with Lua, in process) and
against the real Redis at ``CONVEYOR_TEST_REDIS_URL`` (default db 9, flushed
before and after each test). The real run carries the ``redis`` marker. When the
real server does not answer, the test is skipped locally and FAILS under CI
(``CI=true``), so a CI job cannot silently lose its real-Redis coverage.

``served_model`` is a tiny real tokenizer served as model ``tiny``
(tests/support/tiny_model.py), for the gateway's unit and in-process tests.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import fakeredis
import pytest
import redis
import redis.asyncio as aioredis
from fakeredis.aioredis import FakeRedis
from redis.exceptions import RedisError

from gateway.catalog.served_models import ServedModel
from gateway.catalog.tokenizer import ModelTokenizer
from tests.support.tiny_model import build_tokenizer_folder, tiny_served_model

REAL_REDIS_URL = os.environ.get("CONVEYOR_TEST_REDIS_URL", "redis://127.0.0.1:6379/9")


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in {"1", "true", "yes"}


@dataclass
class RedisTarget:
    """One backend; ``connect()`` opens another client on the same data."""

    kind: str
    url: str = REAL_REDIS_URL
    server: fakeredis.FakeServer = field(default_factory=fakeredis.FakeServer)

    def connect(self) -> aioredis.Redis:
        if self.kind == "fake":
            return FakeRedis(server=self.server)
        return aioredis.Redis.from_url(self.url)

    async def flush(self) -> None:
        client = self.connect()
        try:
            await client.flushdb()
        finally:
            await client.aclose()


def _require_real_redis(url: str) -> None:
    client = redis.Redis.from_url(url, socket_connect_timeout=1.0, socket_timeout=2.0)
    try:
        client.ping()
    except (RedisError, OSError) as exc:
        reason = (
            f"real Redis at {url} is unreachable ({exc}); start one or set CONVEYOR_TEST_REDIS_URL"
        )
        if in_ci():
            pytest.fail(f"CI=true: {reason}", pytrace=False)
        pytest.skip(reason)
    finally:
        client.close()


@pytest.fixture(params=["fake", pytest.param("real", marks=pytest.mark.redis)])
def redis_target(request: pytest.FixtureRequest) -> RedisTarget:
    """The backend of this run (``fake`` or ``real``), for tests that open several clients."""
    target = RedisTarget(kind=request.param)
    if target.kind == "real":
        _require_real_redis(target.url)
    return target


@pytest.fixture
async def redis_backend(redis_target: RedisTarget) -> AsyncIterator[aioredis.Redis]:
    """An asyncio Redis client on an empty database: fakeredis or the real server."""
    client = redis_target.connect()
    await client.flushdb()
    try:
        yield client
    finally:
        try:
            await client.flushdb()
        finally:
            await client.aclose()


@pytest.fixture(scope="session")
def tokenizer_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer_folder(tmp_path_factory.mktemp("tiny-tokenizer"))


@pytest.fixture(scope="session")
def tiny_tokenizer(tokenizer_folder: Path) -> ModelTokenizer:
    return ModelTokenizer(tokenizer_folder)


@pytest.fixture(scope="session")
def served_model(tokenizer_folder: Path, tiny_tokenizer: ModelTokenizer) -> ServedModel:
    return tiny_served_model(tokenizer_folder, tiny_tokenizer)
