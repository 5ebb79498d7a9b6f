"""The fake engine through the real serving path: a gateway and two `--engine fake`
workers, driven by the official ``openai`` client. No vLLM starts: this takes seconds."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
import redis
from openai.types.chat import ChatCompletionMessageParam

from tests.e2e.stack import Stack, wait_until
from tests.waiting import eventually_sync

pytestmark = [pytest.mark.e2e, pytest.mark.redis]

FAKE_REDIS_URL = os.environ.get("CONVEYOR_TEST_FAKE_REDIS_URL", "redis://127.0.0.1:6379/5")
MESSAGES: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "hello from the fake engine"}
]


@pytest.fixture(scope="module")
def fake_stack(
    demo_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Stack, str]]:
    client = redis.Redis.from_url(FAKE_REDIS_URL)
    client.flushdb()
    client.close()
    stack = Stack(
        demo_model,
        "tiny",
        FAKE_REDIS_URL,
        tmp_path_factory.mktemp("fake-logs"),
        data_dir=tmp_path_factory.mktemp("fake-data"),
    )
    fake = {"CONVEYOR_ENGINE": "fake", "CONVEYOR_FAKE_STEP_BASE_MS": "1"}
    try:
        workers = [stack.start_worker(f"fake-{i}", **fake) for i in range(2)]
        _, base_url = stack.start_gateway()
        wait_until(f"{base_url}/ready", status=200, process=workers[0], timeout_s=60)
        yield stack, base_url
    finally:
        stack.stop_all()
    stack.assert_no_safety_net()


@pytest.fixture
def client(fake_stack: tuple[Stack, str]) -> openai.OpenAI:
    _, base_url = fake_stack
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)


def test_workers_say_they_are_fake(fake_stack: tuple[Stack, str]) -> None:
    stack, _ = fake_stack
    for name in ("fake-0", "fake-1"):
        log = (stack.log_dir / f"{name}.log").read_text()
        assert "fake engine (no model)" in log and "its output is not a model's" in log


def test_chat_streams_with_usage(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    usage = chunks[-1].usage
    assert text and finish == ["length"]
    assert usage is not None and usage.completion_tokens == 12 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + 12


def test_greedy_twice_gives_the_same_text(client: openai.OpenAI) -> None:
    answers = [
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=16,
            temperature=0,
        )
        for _ in range(2)
    ]
    texts = [a.choices[0].message.content for a in answers]
    assert texts[0] and texts[0] == texts[1]
    assert answers[1].usage is not None and answers[1].usage.completion_tokens == 16


def test_n_choices_and_logprobs(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=5,
        n=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    assert len(answer.choices) == 3
    assert len({c.message.content for c in answer.choices}) == 1  # greedy: all the same
    for choice in answer.choices:
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert len(choice.logprobs.content) == 5
        assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)


def test_the_prefix_index_fills_from_the_workers_kv_events(
    fake_stack: tuple[Stack, str], client: openai.OpenAI
) -> None:
    _, base_url = fake_stack
    words = " ".join(f"word{i}" for i in range(100))  # several 16-token KV blocks
    client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": words}], max_tokens=2
    )

    def indexed() -> bool:
        index = httpx.get(f"{base_url}/admin/state", timeout=5).json()["placement_index"]
        return any(blocks > 0 for blocks in index["workers"].values())

    eventually_sync(indexed, timeout_s=10, what="a worker's blocks in the gateway's index")
