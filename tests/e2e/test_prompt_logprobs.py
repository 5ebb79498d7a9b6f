"""Prompt scoring through the gateway, as lm-evaluation-harness's ``local-completions``
asks for it (``echo``, ``logprobs``, ``max_tokens: 0``), against vLLM's offline
``prompt_logprobs`` on the same model; and the other prompt-logprob shapes."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import Running
from tests.e2e.reference import OfflineReference

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.redis]

PROMPTS = [[1, 300, 301, 302, 303], [1, *range(1000, 1030)]]


@pytest.fixture
def client(running: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0)


@pytest.mark.slow
def test_lm_eval_loglikelihood_request_equals_offline_prompt_logprobs(
    client: openai.OpenAI, running: Running, offline: OfflineReference
) -> None:
    """The body lm-eval 0.4.13's ``local-completions`` sends for log-likelihood requests
    (``lm_eval/models/openai_completions.py``: a batch of token-id prompts, ``echo``,
    ``max_tokens: 1``, ``logprobs: 1``, ``temperature: 0``, a seed), read as it reads it
    (``token_logprobs[ctxlen:-1]``, greedy when each equals its ``top_logprobs`` maximum);
    and the ``max_tokens: 0`` form of the same request."""
    reference = offline.ask("prompt_logprobs", prompts=PROMPTS)
    batch = client.completions.create(
        model=running.model, prompt=PROMPTS, echo=True, max_tokens=1, logprobs=1,
        temperature=0, seed=1234,
    )  # fmt: skip
    for choice, prompt, theirs in zip(batch.choices, PROMPTS, reference, strict=True):
        logprobs = choice.logprobs
        assert logprobs is not None and logprobs.token_logprobs is not None
        assert logprobs.top_logprobs is not None
        assert len(logprobs.token_logprobs) == len(prompt) + 1  # the prompt, one generated
        ctxlen = 1
        scored = logprobs.token_logprobs[ctxlen:-1]
        assert scored == pytest.approx(theirs[ctxlen:], abs=1e-4)
        for token, top in zip(scored, logprobs.top_logprobs[ctxlen:-1], strict=True):
            assert token is not None and token <= max(top.values()) + 1e-6
    for prompt, theirs in zip(PROMPTS, reference, strict=True):
        alone = client.completions.create(
            model=running.model, prompt=prompt, echo=True, max_tokens=0, logprobs=1,
            temperature=0,
        )  # fmt: skip
        logprobs = alone.choices[0].logprobs
        assert logprobs is not None and logprobs.token_logprobs is not None
        assert logprobs.top_logprobs is not None and logprobs.top_logprobs[0] is None
        assert logprobs.token_logprobs[0] is None and theirs[0] is None
        assert logprobs.token_logprobs[1:] == pytest.approx(theirs[1:], abs=1e-4)
        assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs[1:])


def test_echo_text_and_logprobs_0(client: openai.OpenAI, running: Running) -> None:
    answer = client.completions.create(
        model=running.model, prompt="The river", echo=True, max_tokens=3, logprobs=0,
        temperature=0,
    )  # fmt: skip
    choice = answer.choices[0]
    assert choice.text.startswith("The river")
    logprobs = choice.logprobs
    assert logprobs is not None and logprobs.tokens and logprobs.top_logprobs
    assert logprobs.token_logprobs is not None and logprobs.token_logprobs[0] is None
    generated = logprobs.top_logprobs[-3:]
    assert all(len(top) == 1 for top in generated)  # the sampled token alone
    assert [next(iter(top)) for top in generated] == logprobs.tokens[-3:]


def test_prompt_logprobs_field(client: openai.OpenAI, running: Running) -> None:
    text = client.completions.create(
        model=running.model, prompt=PROMPTS[0], max_tokens=2, temperature=0,
        extra_body={"prompt_logprobs": 2},
    )  # fmt: skip
    scored = text.choices[0].model_extra["prompt_logprobs"]  # type: ignore[index]
    assert len(scored) == len(PROMPTS[0]) and scored[0] is None
    for token, position in zip(PROMPTS[0][1:], scored[1:], strict=True):
        assert str(token) in position and 2 <= len(position) <= 3
    chat = client.chat.completions.create(
        model=running.model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        extra_body={"prompt_logprobs": 0},
    )  # fmt: skip
    assert chat.model_extra is not None and chat.model_extra["prompt_logprobs"][0] is None


def test_tokens_as_token_ids(client: openai.OpenAI, running: Running) -> None:
    text = client.completions.create(
        model=running.model, prompt="The river", max_tokens=2, temperature=0, logprobs=1,
        extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
    )  # fmt: skip
    logprobs = text.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None
    ids = text.choices[0].model_extra["token_ids"]  # type: ignore[index]
    assert logprobs.tokens == [f"token_id:{token}" for token in ids]
