"""Known OpenAI fields are honoured or refused, never silently ignored (real app in process)."""

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

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


@pytest.fixture(scope="module")
def gateway(served_model: ServedModel) -> InProcessGateway:
    return build_gateway(
        served_model, workers=True, request_timeout_s=0.05, max_request_timeout_s=0.05
    )


@pytest.fixture(scope="module")
def client(gateway: InProcessGateway) -> Iterator[TestClient]:
    with TestClient(gateway.app, raise_server_exceptions=False) as test_client:
        yield test_client


def last_job(gateway: InProcessGateway) -> GenerateJob:
    job = decode(gateway.queued()[-1])
    assert isinstance(job, GenerateJob)
    return job


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_logit_bias_reaches_the_job(
    client: TestClient, gateway: InProcessGateway, path: str
) -> None:
    bias = {"5": 100, "7": -100, "9": 0.5}
    passed_every_check(client.post(path, json={**BODIES[path], "logit_bias": bias, "n": 2}))
    job = last_job(gateway)
    assert job.sampling.logit_bias == {5: 100.0, 7: -100.0, 9: 0.5}


def test_no_logit_bias_leaves_the_job_without_one(
    client: TestClient, gateway: InProcessGateway
) -> None:
    passed_every_check(client.post(CHAT, json={**BODIES[CHAT], "logit_bias": {}}))
    assert last_job(gateway).sampling.logit_bias is None


@pytest.mark.parametrize("token", ["-1", "320", "100000000000000000000000", "x", "1.5"])
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_logit_bias_outside_the_vocabulary_is_a_400(
    client: TestClient, served_model: ServedModel, path: str, token: str
) -> None:
    assert served_model.tokenizer.vocab_size() == 320
    response = client.post(path, json={**BODIES[path], "logit_bias": {token: 1}})
    error = error_of(response)
    assert error["param"].startswith("logit_bias")
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("fields", "param", "code", "says"),
    [
        ({"tools": TOOLS}, "tool_choice", "unsupported_parameter", 'tool_choice "auto" needs'),
        ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "unsupported_parameter", "no"),
        ({"tool_choice": "required"}, "tool_choice", None, "tool_choice needs tools"),
        ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", None,
         "tool_choice needs tools"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "g"}}},
         "tool_choice", None, "`g`, which is not in tools"),
        ({"tools": TOOLS * 2, "tool_choice": "required"}, "tools[1]", None, "two tools"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
         "response_format", None, "cannot be combined"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions", "unsupported_parameter",
         "functions API"),
        ({"function_call": "auto"}, "function_call", "unsupported_parameter", "functions API"),
    ],
)  # fmt: skip
def test_tool_calling_it_cannot_honour_is_a_400_that_says_why(
    client: TestClient, fields: dict[str, Any], param: str, code: str | None, says: str
) -> None:
    error = error_of(client.post(CHAT, json={**BODIES[CHAT], **fields}))
    assert (error["param"], error["code"]) == (param, code)
    assert says in error["message"]


@pytest.mark.parametrize(
    "fields",
    [
        {"tools": []},
        {"tools": [], "tool_choice": "none"},
        {"tool_choice": "none"},
        {"function_call": "none"},
        {"parallel_tool_calls": False},
        {"modalities": ["text"]},
    ],
)
def test_tool_fields_that_ask_for_nothing_are_accepted(
    client: TestClient, fields: dict[str, Any]
) -> None:
    passed_every_check(client.post(CHAT, json={**BODIES[CHAT], **fields}))


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (CHAT, {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        (CHAT, {"modalities": ["text", "audio"]}, "modalities"),
        (CHAT, {"web_search_options": {}}, "web_search_options"),
        (COMPLETIONS, {"best_of": 3}, "best_of"),
        (COMPLETIONS, {"best_of": 3, "n": 2}, "best_of"),
    ],
)
def test_other_unsupported_features_are_refused(
    client: TestClient, path: str, fields: dict[str, Any], param: str
) -> None:
    error = error_of(client.post(path, json={**BODIES[path], **fields}))
    assert (error["param"], error["code"]) == (param, "unsupported_parameter")


def test_best_of_equal_to_n_is_accepted(client: TestClient) -> None:
    passed_every_check(client.post(COMPLETIONS, json={**BODIES[COMPLETIONS], "best_of": 2, "n": 2}))


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_min_tokens_over_max_tokens_is_a_400_not_an_engine_error(
    client: TestClient, path: str
) -> None:
    response = client.post(path, json={**BODIES[path], "max_tokens": 2, "min_tokens": 3})
    assert error_of(response)["param"] == "min_tokens"
