"""Greedy tokens through the gateway equal vLLM's offline LLM.generate on the same model."""

from __future__ import annotations

import httpx
import pytest

from tests.e2e.conftest import Running
from tests.e2e.reference import OfflineReference

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.redis, pytest.mark.slow]

PROMPTS = [[1, 300, 301, 302], [1, *range(1000, 1040)], [1, *range(50, 250)]]
MAX_TOKENS = 24


def test_gateway_tokens_equal_offline_generate(offline: OfflineReference, running: Running) -> None:
    ours = []
    for prompt in PROMPTS:
        response = httpx.post(
            f"{running.base_url}/v1/completions",
            json={
                "model": running.model,
                "prompt": prompt,
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "return_token_ids": True,
            },
            timeout=120,
        )
        response.raise_for_status()
        ours.append(response.json()["choices"][0]["token_ids"])
    reference = offline.ask("generate", prompts=PROMPTS, max_tokens=MAX_TOKENS)
    assert ours == reference
