"""The gateway's prefix index fills from a real vLLM worker's KV events (ZeroMQ from the
engine core, then Redis), on the shared session stack."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.conftest import Running
from tests.waiting import eventually_sync

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.redis]


def test_vllm_blocks_reach_the_gateways_index(running: Running) -> None:
    client = openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0)
    words = " ".join(f"item{i}" for i in range(300))  # more than two 128-token CPU blocks
    client.completions.create(model=running.model, prompt=words, max_tokens=1)

    def indexed() -> bool:
        state = httpx.get(f"{running.base_url}/admin/state", timeout=5).json()
        return any(blocks >= 2 for blocks in state["placement_index"]["workers"].values())

    eventually_sync(indexed, timeout_s=20, what="the vLLM worker's blocks in the index")
