"""One gateway over two Redis, end to end (docs/operations/several-hosts.md, "More than one Redis").

The demo chat model's vLLM worker runs on a second Redis (a private redis-server on a
free port, CONVEYOR_REDIS_URL of that worker only); the embedding worker and the
control plane on the home Redis. The gateway is told with CONVEYOR_MODEL_REDIS_URLS.
Driven by the official ``openai`` client: chat (streamed and not) and embeddings are
served; with the second Redis killed the embedding model still serves while chat answers
a clean 503, and once it is back (same port, AOF replayed) chat serves again.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import redis

from tests.e2e.stack import Stack, wait_until
from tests.support.second_redis import PrivateRedis

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.vllm,
    pytest.mark.redis,
    pytest.mark.slow,
    pytest.mark.timeout(600),
]

HOME_URL = "redis://127.0.0.1:6379/12"
CHAT_MODEL = "tiny"
EMBED_MODEL = "all-MiniLM-L6-v2"
MESSAGES = [{"role": "user", "content": "hello"}]


@dataclass(frozen=True)
class TwoRedisStack:
    url: str
    client: openai.OpenAI
    shard: PrivateRedis


@pytest.fixture(scope="module")
def two_redis(
    demo_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[TwoRedisStack]:
    home = redis.Redis.from_url(HOME_URL)
    home.flushdb()
    home.close()
    shard = PrivateRedis.start_in(tmp_path_factory.mktemp("redis-2"))
    stack = Stack(
        demo_model,
        CHAT_MODEL,
        HOME_URL,
        tmp_path_factory.mktemp("logs-cells"),
        data_dir=tmp_path_factory.mktemp("data-cells"),
    )
    embed = {"CONVEYOR_EMBED_MODEL": "default"}
    try:
        chat_worker = stack.start_worker("chat-on-redis-2", CONVEYOR_REDIS_URL=shard.url)
        stack.start_worker("embed-on-home", role="embed", **embed)
        _, url = stack.start_gateway(
            "gateway-cells",
            CONVEYOR_MODEL_REDIS_URLS=f"{CHAT_MODEL}={shard.url}",
            CONVEYOR_ADMISSION_RETRY_S="1",
            **embed,
        )
        wait_until(f"{url}/ready", status=200, process=chat_worker, timeout_s=300)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        yield TwoRedisStack(url, client, shard)
    finally:
        stack.stop_all()
        shard.kill()
    stack.assert_no_safety_net()


def _chat(client: openai.OpenAI) -> str:
    answer = client.chat.completions.create(
        model=CHAT_MODEL,
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
    )
    assert answer.choices[0].finish_reason in ("length", "stop")
    return answer.choices[0].message.content or ""


def test_both_models_serve_each_from_its_own_redis(two_redis: TwoRedisStack) -> None:
    text = _chat(two_redis.client)
    chunks = list(
        two_redis.client.chat.completions.create(
            model=CHAT_MODEL,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=8,
            temperature=0,
            stream=True,
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == text
    vectors = two_redis.client.embeddings.create(model=EMBED_MODEL, input=["a", "b"])
    assert len(vectors.data) == 2 and len(vectors.data[0].embedding) == 384

    ready = httpx.get(f"{two_redis.url}/ready", timeout=5).json()
    assert ready["models"][CHAT_MODEL]["redis"] == two_redis.shard.url
    assert ready["models"][EMBED_MODEL]["redis"] == "home"
    shard = redis.Redis.from_url(two_redis.shard.url)
    home = redis.Redis.from_url(HOME_URL)
    try:  # the chat jobs were queued on the second Redis, the embeddings on the home one
        assert shard.exists(f"conveyor:jobs:{CHAT_MODEL}:aggregated")
        assert not home.exists(f"conveyor:jobs:{CHAT_MODEL}:aggregated")
        assert home.exists(f"conveyor:jobs:{EMBED_MODEL}:embed")
    finally:
        shard.close()
        home.close()


def test_a_dead_redis_fails_only_its_model_until_it_is_back(two_redis: TwoRedisStack) -> None:
    two_redis.shard.kill()
    with pytest.raises(openai.APIStatusError) as refused:
        _chat(two_redis.client)
    assert refused.value.status_code == 503
    assert refused.value.body is not None
    vectors = two_redis.client.embeddings.create(model=EMBED_MODEL, input="still served")
    assert len(vectors.data[0].embedding) == 384
    assert httpx.get(f"{two_redis.url}/ready", timeout=5).status_code == 503

    two_redis.shard.start()  # same port and folder: the AOF is replayed
    _wait_ready(f"{two_redis.url}/ready")
    # The replayed AOF holds the worker's last liveness key until its TTL runs out, so
    # /ready can pass before the worker beats again, and a chat then get the 503 (with
    # Retry-After) that a client retries; one that honours it is served.
    assert _chat(two_redis.client.with_options(max_retries=5))


def _wait_ready(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not ready within {timeout_s}s")
