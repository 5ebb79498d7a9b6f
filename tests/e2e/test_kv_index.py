"""The gateway's prefix index fills from a real vLLM worker's KV events (ZeroMQ from the
engine core, then Redis), and placement finds there what vLLM then serves from its cache;
on the shared session stack."""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.conftest import Running
from tests.waiting import eventually_sync

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.redis]

VLLM_CPU_BLOCK_TOKENS = 128


def _client(running: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0)


def _indexed_blocks(running: Running) -> int:
    state = httpx.get(f"{running.base_url}/admin/state", timeout=5).json()
    return sum(max(0, blocks) for blocks in state["placement_index"]["workers"].values())


def _pending_blocks(running: Running) -> int:
    state = httpx.get(f"{running.base_url}/admin/state", timeout=5).json()
    return int(state["placement_index"]["pending"])


def _placement_figures(running: Running) -> dict[str, float]:
    """Cache placements and the prompt blocks found where jobs were placed, so far."""
    text = httpx.get(f"{running.base_url}/metrics", timeout=5).text
    figures = {"cache": 0.0, "matched": 0.0}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.labels.get("model_name") != running.model:
                continue
            if sample.name == "conveyor_placements_total" and sample.labels["reason"] == "cache":
                figures["cache"] += sample.value
            elif sample.name == "conveyor_placement_matched_blocks_sum":
                figures["matched"] += sample.value
    return figures


def test_vllm_blocks_reach_the_gateways_index(running: Running) -> None:
    words = " ".join(f"item{i}" for i in range(300))  # more than two 128-token CPU blocks
    _client(running).completions.create(model=running.model, prompt=words, max_tokens=1)
    eventually_sync(
        lambda: _indexed_blocks(running) >= 2,
        timeout_s=20,
        what="the vLLM worker's blocks in the index",
    )


def test_a_repeated_prompt_is_placed_by_cache_and_vllm_serves_what_was_predicted(
    running: Running,
) -> None:
    """The index hashes blocks at vLLM's block size and from the same token ids: a prompt
    seen before is placed by cache, and the cached tokens the gateway predicted are the
    ones vLLM reports in usage."""
    client = _client(running)
    prompt = " ".join(f"repeat{i}" for i in range(400))  # at least three whole blocks
    before_blocks = _indexed_blocks(running)
    client.completions.create(model=running.model, prompt=prompt, max_tokens=1)
    eventually_sync(
        lambda: _indexed_blocks(running) >= before_blocks + 3 and _pending_blocks(running) == 0,
        timeout_s=5,  # well within the 10 s an announced block counts before it expires
        what="the first answer's blocks in the index, every block the worker announced "
        "as coming stored under the same name by vLLM",
    )
    before = _placement_figures(running)
    again = client.completions.create(model=running.model, prompt=prompt, max_tokens=1)
    after = _placement_figures(running)

    assert after["cache"] - before["cache"] == 1
    predicted_blocks = after["matched"] - before["matched"]
    assert predicted_blocks >= 3
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens == int(
        predicted_blocks * VLLM_CPU_BLOCK_TOKENS
    )
