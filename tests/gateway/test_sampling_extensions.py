"""vLLM's sampling extensions: ``structured_outputs`` beyond JSON, ``stop_token_ids``,
``allowed_token_ids``, ``truncate_prompt_tokens``, beam search: the SamplingOptions a worker
receives, and the 400s (real app in process, fake workers)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from gateway.catalog.served_models import ServedModel
from shared.protocol import GenerateJob, decode, is_guided
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
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


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


@pytest.mark.parametrize(
    ("structured", "field", "expected"),
    [
        ({"regex": r"\d+"}, "regex", r"\d+"),
        ({"choice": ["yes", "no"]}, "choice", ("yes", "no")),
        ({"grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
        ({"structural_tag": '{"type": "x"}'}, "structural_tag", '{"type": "x"}'),
        ({"json_object": True}, "json_object", True),
    ],
)
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_structured_outputs_reach_the_job(
    client: TestClient,
    gateway: InProcessGateway,
    path: str,
    structured: dict[str, Any],
    field: str,
    expected: Any,
) -> None:
    job = queued(client, gateway, path, structured_outputs=structured, n=2)
    assert getattr(job.sampling, field) == expected
    assert is_guided(job.sampling)  # a guided job replays on migration


@pytest.mark.parametrize("schema", [SCHEMA, json.dumps(SCHEMA)])
def test_a_structured_json_schema_is_stored_like_response_formats(
    client: TestClient, gateway: InProcessGateway, schema: Any
) -> None:
    job = queued(client, gateway, CHAT, structured_outputs={"json": schema})
    assert job.sampling.json_schema_stored
    assert is_guided(job.sampling)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {}}, "structured_outputs"),
        ({"structured_outputs": {"json_object": False}}, "structured_outputs"),
        ({"structured_outputs": {"regex": ""}}, "structured_outputs.regex"),
        ({"structured_outputs": {"regex": 5}}, "structured_outputs.regex"),
        ({"structured_outputs": {"regex": "a\u0000"}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": ""}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"choice": "yes"}}, "structured_outputs.choice"),
        ({"structured_outputs": {"grammar": "x" * 20000}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs.json"),
        ({"structured_outputs": {"json": "[1]"}}, "structured_outputs.json"),
        ({"structured_outputs": "regex"}, "structured_outputs"),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "structured_outputs",
        ),
        (
            {"structured_outputs": {"regex": "a"}, "tools": TOOLS, "tool_choice": "required"},
            "structured_outputs",
        ),
        ({"stop_token_ids": [-1]}, "stop_token_ids[0]"),
        ({"stop_token_ids": [320]}, "stop_token_ids"),
        ({"allowed_token_ids": [1, 100000]}, "allowed_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"cache_salt": ""}, "cache_salt"),
        ({"cache_salt": "a/b"}, "cache_salt"),
        ({"cache_salt": "user@host"}, "cache_salt"),
        ({"cache_salt": "x" * 129}, "cache_salt"),
        ({"cache_salt": 5}, "cache_salt"),
        ({"truncate_prompt_tokens": 4096}, "truncate_prompt_tokens"),
    ],
)
def test_bad_values_are_400s_naming_the_field(
    client: TestClient, fields: dict[str, Any], param: str
) -> None:
    error = error_of(client.post(CHAT, json={**BODIES[CHAT], **fields}))
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"use_beam_search": True}, "use_beam_search"),
        ({"guided_json": SCHEMA}, "guided_json"),
        ({"guided_choice": ["a"]}, "guided_choice"),
        ({"guided_regex": "a"}, "guided_regex"),
        ({"guided_grammar": "a"}, "guided_grammar"),
        ({"structured_outputs": {"json": SCHEMA, "disable_additional_properties": True}},
         "structured_outputs.disable_additional_properties"),
    ],
)  # fmt: skip
@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_what_cannot_be_honoured_is_refused(
    client: TestClient, path: str, fields: dict[str, Any], param: str
) -> None:
    error = error_of(client.post(path, json={**BODIES[path], **fields}))
    assert (error["param"], error["code"]) == (param, "unsupported_parameter")


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_token_id_lists_reach_the_job(
    client: TestClient, gateway: InProcessGateway, path: str
) -> None:
    job = queued(client, gateway, path, stop_token_ids=[3, 5], allowed_token_ids=[7, 8, 9])
    assert job.sampling.stop_token_ids == (3, 5)
    assert job.sampling.allowed_token_ids == (7, 8, 9)
    plain = queued(client, gateway, path, stop_token_ids=[], use_beam_search=False)
    assert (plain.sampling.stop_token_ids, plain.sampling.allowed_token_ids) == ((), None)


PROMPT = list(range(10, 30))


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"truncate_prompt_tokens": 5}, PROMPT[-5:]),
        ({"truncate_prompt_tokens": 5, "truncation_side": "left"}, PROMPT[-5:]),
        ({"truncate_prompt_tokens": 5, "truncation_side": "right"}, PROMPT[:5]),
        ({"truncate_prompt_tokens": 50}, PROMPT),
        ({"truncate_prompt_tokens": -1}, PROMPT),
    ],
)
def test_truncate_prompt_tokens_keeps_n_tokens(
    client: TestClient, gateway: InProcessGateway, fields: dict[str, Any], expected: list[int]
) -> None:
    job = queued(client, gateway, COMPLETIONS, prompt=PROMPT, **fields)
    assert job.prompt_token_ids == expected


def test_truncate_minus_one_leaves_room_for_max_tokens(
    client: TestClient, gateway: InProcessGateway, served_model: ServedModel
) -> None:
    window = served_model.max_model_len
    prompt = [11] * (window - 1)
    job = queued(
        client, gateway, COMPLETIONS, prompt=prompt, max_tokens=8, truncate_prompt_tokens=-1
    )
    assert len(job.prompt_token_ids) == window - 8
    assert job.sampling.max_tokens == 8


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_cache_salt_reaches_the_job(
    client: TestClient, gateway: InProcessGateway, path: str
) -> None:
    assert queued(client, gateway, path, cache_salt="tenant-42").sampling.cache_salt == "tenant-42"
    assert queued(client, gateway, path).sampling.cache_salt is None


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_skip_special_tokens_reaches_the_worker(
    client: TestClient, gateway: InProcessGateway, path: str
) -> None:
    assert queued(client, gateway, path).sampling.skip_special_tokens
    assert not queued(client, gateway, path, skip_special_tokens=False).sampling.skip_special_tokens


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        (CHAT, {"chat_template": "{{ messages }}"}, "chat_template"),
        (CHAT, {"include_reasoning": False}, "include_reasoning"),
        (CHAT, {"add_special_tokens": True}, "add_special_tokens"),
        (COMPLETIONS, {"add_special_tokens": False}, "add_special_tokens"),
        (COMPLETIONS, {"include_stop_str_in_output": True}, "include_stop_str_in_output"),
        (CHAT, {"bad_words": ["x"]}, "bad_words"),
        (COMPLETIONS, {"priority": 3}, "priority"),
        (COMPLETIONS, {"kv_transfer_params": {"do_remote_decode": True}}, "kv_transfer_params"),
        (COMPLETIONS, {"prompt_embeds": "AAAA"}, "prompt_embeds"),
    ],
)
def test_vllm_fields_that_change_the_answer_are_refused(
    client: TestClient, path: str, fields: dict[str, Any], param: str
) -> None:
    error = error_of(client.post(path, json={**BODIES[path], **fields}))
    assert (error["param"], error["code"]) == (param, "unsupported_parameter")


@pytest.mark.parametrize(
    "fields",
    [
        {"priority": 0, "bad_words": [], "include_reasoning": True, "add_special_tokens": False},
        {"request_id": "mine", "session_id": "s", "stream_interval": 4, "length_penalty": 2.0},
    ],
)
def test_vllm_defaults_and_ignored_fields_are_accepted(
    client: TestClient, fields: dict[str, Any]
) -> None:
    passed_every_check(client.post(CHAT, json={**BODIES[CHAT], **fields}))
