"""Prompt logprobs and ``echo``: the SamplingOptions a worker receives, and the 400s
(real app in process, fake workers)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gateway.catalog.served_models import ServedModel
from shared.protocol import GenerateJob, decode
from tests.gateway.harness import (
    BODIES,
    CHAT,
    COMPLETIONS,
    InProcessGateway,
    build_gateway,
    error_of,
    passed_every_check,
)


@pytest.fixture(scope="module")
def gateway(served_model: ServedModel) -> InProcessGateway:
    return build_gateway(
        served_model, workers=True, request_timeout_s=0.05, max_request_timeout_s=0.05
    )


@pytest.fixture(scope="module")
def client(gateway: InProcessGateway) -> Iterator[TestClient]:
    with TestClient(gateway.app, raise_server_exceptions=False) as test_client:
        yield test_client


def queued(client: TestClient, gateway: InProcessGateway, path: str, **fields: Any) -> GenerateJob:
    passed_every_check(client.post(path, json={**BODIES[path], **fields}))
    job = decode(gateway.queued()[-1])
    assert isinstance(job, GenerateJob)
    return job


def test_lm_eval_scoring_asks_one_token_and_the_prompts_logprobs(
    client: TestClient, gateway: InProcessGateway
) -> None:
    """lm-eval's log-likelihood body: echo, max_tokens 0, logprobs 1, temperature 0."""
    job = queued(client, gateway, COMPLETIONS, echo=True, max_tokens=0, logprobs=1, temperature=0)
    assert (job.sampling.max_tokens, job.sampling.prompt_logprobs) == (1, 1)
    assert job.sampling.logprobs == 1


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"echo": True}, None),  # echo alone: the prompt text, no scoring
        ({"echo": True, "logprobs": 0}, 0),
        ({"echo": True, "logprobs": 3, "prompt_logprobs": 1}, 1),
        ({"prompt_logprobs": 2}, 2),
    ],
)
def test_completion_prompt_logprobs(
    client: TestClient, gateway: InProcessGateway, fields: dict[str, Any], expected: int | None
) -> None:
    assert queued(client, gateway, COMPLETIONS, **fields).sampling.prompt_logprobs == expected


def test_chat_prompt_logprobs(client: TestClient, gateway: InProcessGateway) -> None:
    assert queued(client, gateway, CHAT, prompt_logprobs=0).sampling.prompt_logprobs == 0


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (COMPLETIONS, {"max_tokens": 0}, "max_tokens"),
        (COMPLETIONS, {"prompt_logprobs": 1, "stream": True}, None),
        (CHAT, {"prompt_logprobs": 1, "stream": True}, None),
        (CHAT, {"prompt_logprobs": 21}, "prompt_logprobs"),
        (CHAT, {"max_tokens": 0}, "max_tokens"),
    ],
)
def test_refusals(client: TestClient, path: str, fields: dict[str, Any], param: str | None) -> None:
    error = error_of(client.post(path, json={**BODIES[path], **fields}))
    assert error["param"] == param
