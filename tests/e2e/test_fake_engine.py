"""The fake engine through the real serving path: a gateway and two `--engine fake`
workers, driven by the official ``openai`` client. No vLLM starts: this takes seconds."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import redis
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.stack import Stack, wait_until

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


def scrape(base_url: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = httpx.get(f"{base_url}/metrics", timeout=5).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: dict[tuple[str, frozenset[tuple[str, str]]], float], name: str) -> float:
    return sum(value for (sample, _), value in samples.items() if sample == name)


def test_metrics_under_a_burst(fake_stack: tuple[Stack, str], client: openai.OpenAI) -> None:
    """During a burst the workers' heartbeats show running sequences, and afterwards the
    gateway's generation-token counter grew by exactly what the clients counted."""
    _, base_url = fake_stack
    before = total(scrape(base_url), "vllm:generation_tokens_total")

    def one(_: int) -> int:
        stream = client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=400, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = list(stream)
        usage = chunks[-1].usage
        assert usage is not None
        return usage.completion_tokens

    with ThreadPoolExecutor(8) as pool:
        burst = [pool.submit(one, i) for i in range(8)]
        running = 0.0
        while not all(f.done() for f in burst) and running == 0:
            running = total(scrape(base_url), "vllm:num_requests_running")
            time.sleep(0.05)
        counted = sum(f.result() for f in burst)
    assert running > 0
    after = total(scrape(base_url), "vllm:generation_tokens_total")
    assert after - before == counted > 0
