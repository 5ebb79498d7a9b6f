"""Bursts of jobs in one request start at once: many choices (`n`) and many prompts.

Before the fix, a read of ~56+ jobs opened more Redis connections than the pool
allowed; the jobs already read sat pending until the 30 s stale-entry reclaim.
"""

from __future__ import annotations

import time

import pytest
from openai import OpenAI

from tests.e2e.conftest import Running

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.redis]

WELL_UNDER_THE_STALE_RECLAIM_S = 10.0


def _client(running: Running) -> OpenAI:
    return OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0)


def test_n_128_answers_at_once(running: Running) -> None:
    client = _client(running)
    client.completions.create(model=running.model, prompt="hi", max_tokens=1)  # warm
    started = time.monotonic()
    completion = client.completions.create(
        model=running.model, prompt="hi", n=128, max_tokens=1, temperature=1, timeout=20
    )
    elapsed = time.monotonic() - started
    assert sorted(choice.index for choice in completion.choices) == list(range(128))
    assert elapsed < WELL_UNDER_THE_STALE_RECLAIM_S, f"n=128 took {elapsed:.2f}s"


def test_64_prompts_in_one_completion_request_answer_at_once(running: Running) -> None:
    client = _client(running)
    prompts = [f"prompt number {i}" for i in range(64)]
    started = time.monotonic()
    completion = client.completions.create(
        model=running.model, prompt=prompts, max_tokens=1, timeout=20
    )
    elapsed = time.monotonic() - started
    assert sorted(choice.index for choice in completion.choices) == list(range(64))
    assert elapsed < WELL_UNDER_THE_STALE_RECLAIM_S, f"64 prompts took {elapsed:.2f}s"
