"""Limits a request meets before it costs anything, through the real app in process:
headers and numbers that are not numbers, body size, text length, counts."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.catalog.served_models import ServedModel
from gateway.catalog.tokenizer import ModelTokenizer
from gateway.openai.schemas import MAX_LOGIT_BIAS, MAX_STOP_CHARS, MAX_STOP_SEQUENCES
from shared.protocol import GenerateJob, decode
from tests.gateway.asgi_call import SlowBodyCall
from tests.gateway.harness import (
    BODIES,
    CHAT,
    COMPLETIONS,
    EMBEDDINGS,
    USER,
    InProcessGateway,
    build_gateway,
    error_of,
    live_gateway,
    passed_every_check,
)
from tests.support.tiny_model import MAX_MODEL_LEN, SENTENCES


@pytest.fixture(scope="module")
def gateway(served_model: ServedModel) -> InProcessGateway:
    # Valid requests are queued and time out at once: a 504 means "got past every check".
    return build_gateway(
        served_model,
        workers=True,
        request_timeout_s=0.05,
        max_request_timeout_s=0.05,
        max_request_body_bytes=64 * 1024,
        max_messages=4,
        queue_max_depth=16,
    )


@pytest.fixture(scope="module")
def client(gateway: InProcessGateway) -> Iterator[TestClient]:
    with TestClient(gateway.app, raise_server_exceptions=False) as test_client:
        yield test_client


def post_raw(client: TestClient, path: str, raw: str, **headers: str) -> Any:
    return client.post(path, content=raw, headers={"content-type": "application/json", **headers})


# ------------------------------------------------------------- numbers that are not numbers


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, EMBEDDINGS])
@pytest.mark.parametrize(
    "value", ["nan", "NaN", "inf", "-inf", "Infinity", "1e400", "0", "-1", "abc", ""]
)
def test_bad_request_timeout_is_a_400_naming_the_header(
    client: TestClient, path: str, value: str
) -> None:
    response = client.post(path, json=BODIES[path], headers={"X-Request-Timeout": value})
    error = error_of(response)
    assert error["param"] == "X-Request-Timeout"
    assert error["type"] == "invalid_request_error"


def test_huge_request_timeout_is_cut_to_the_maximum(
    client: TestClient, gateway: InProcessGateway
) -> None:
    before = len(gateway.queued())
    response = client.post(CHAT, json=BODIES[CHAT], headers={"X-Request-Timeout": "1e308"})
    passed_every_check(response)
    job = decode(gateway.queued()[before])
    assert isinstance(job, GenerateJob)
    assert job.deadline_unix - job.created_unix == pytest.approx(0.05)


FLOAT_FIELDS = [
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
]
INT_FIELDS = ["max_tokens", "top_k", "seed", "n", "min_tokens"]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
@pytest.mark.parametrize("field", FLOAT_FIELDS + INT_FIELDS)
@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_non_finite_numbers_in_the_body_are_a_400_naming_the_field(
    client: TestClient, path: str, field: str, literal: str
) -> None:
    """Python's JSON parser accepts NaN and Infinity literals: the schema must not."""
    raw = json.dumps(BODIES[path])[:-1] + f', "{field}": {literal}}}'
    error = error_of(post_raw(client, path, raw))
    assert error["param"] == field
    if field in FLOAT_FIELDS:
        assert "finite" in error["message"]


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "1e400", "101", "-100.5"])
def test_non_finite_or_out_of_range_logit_bias_is_a_400(client: TestClient, literal: str) -> None:
    raw = json.dumps(BODIES[CHAT])[:-1] + f', "logit_bias": {{"5": {literal}}}}}'
    assert error_of(post_raw(client, CHAT, raw))["param"].startswith("logit_bias")


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "1e400", str(2**64)])
def test_non_finite_or_huge_dimensions_is_a_400(client: TestClient, literal: str) -> None:
    raw = json.dumps(BODIES[EMBEDDINGS])[:-1] + f', "dimensions": {literal}}}'
    assert error_of(post_raw(client, EMBEDDINGS, raw))["param"] == "dimensions"


# ------------------------------------------------------------------------------- body size


def test_body_over_the_limit_is_a_413_before_it_is_read(client: TestClient) -> None:
    big = {**BODIES[CHAT], "user": "x" * (64 * 1024)}
    error = error_of(client.post(CHAT, json=big), status=413)
    assert error["code"] == "request_too_large"
    assert "CONVEYOR_MAX_REQUEST_BODY_BYTES" in error["message"]


def test_chunked_body_over_the_limit_is_a_413(client: TestClient) -> None:
    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        yield json.dumps(BODIES[CHAT])[:-1].encode() + b', "user": "'
        for _ in range(100):
            yield b"x" * 1024
        yield b'"}'

    response = client.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
    assert error_of(response, status=413)["code"] == "request_too_large"


async def test_a_body_that_trickles_in_is_a_408(served_model: ServedModel) -> None:
    async with live_gateway(served_model, request_body_timeout_s=0.2) as live:
        async with SlowBodyCall(live.app, CHAT, BODIES[CHAT], {}) as call:
            assert await call.start() == 408
            body = json.loads(await call.read_all())
        assert body["error"]["code"] == "request_timeout"
        assert "CONVEYOR_REQUEST_BODY_TIMEOUT_S" in body["error"]["message"]


def test_body_under_the_limit_is_read_whole(client: TestClient) -> None:
    def chunks() -> Iterator[bytes]:
        text = json.dumps(BODIES[CHAT]).encode()
        yield text[:10]
        yield text[10:]

    passed_every_check(
        client.post(CHAT, content=chunks(), headers={"content-type": "application/json"})
    )


# --------------------------------------------------------- text too long for the context


@pytest.fixture
def no_tokenizing(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*_: Any, **__: Any) -> list[int]:
        raise AssertionError("over-long text must be refused before it is tokenized")

    monkeypatch.setattr(ModelTokenizer, "encode", refuse)


def too_long(model: ServedModel) -> str:
    return "a" * (MAX_MODEL_LEN * model.tokenizer.max_token_chars + 1)


@pytest.mark.usefixtures("no_tokenizing")
@pytest.mark.parametrize(
    ("path", "field", "param"),
    [
        (CHAT, "messages", "messages"),
        (COMPLETIONS, "prompt", "prompt"),
        (COMPLETIONS, "prompt_list", "prompt"),
        (EMBEDDINGS, "input", "input[1]"),
    ],
)
def test_text_longer_than_the_context_window_is_refused_without_tokenizing(
    client: TestClient, served_model: ServedModel, path: str, field: str, param: str
) -> None:
    text = too_long(served_model)
    body = dict(BODIES[path])
    if field == "messages":
        body["messages"] = [*USER, {"role": "user", "content": [{"type": "text", "text": text}]}]
    elif field == "prompt":
        body["prompt"] = text
    elif field == "prompt_list":
        body["prompt"] = ["hi", text]
    else:
        body["input"] = ["hi", text]
    gateway_limit = 64 * 1024  # the body cap of this test gateway
    assert len(text) < gateway_limit
    error = error_of(client.post(path, json=body))
    assert (error["param"], error["code"]) == (param, "context_length_exceeded")


@settings(max_examples=200, deadline=None)
@given(text=st.text(max_size=200) | st.lists(st.sampled_from(SENTENCES)).map(" ".join))
def test_the_character_bound_never_refuses_text_that_fits(
    tiny_tokenizer: ModelTokenizer, text: str
) -> None:
    """No token covers more characters than the longest vocabulary entry, so a text refused
    by the bound (more than n * max_token_chars characters) really has more than n tokens."""
    tokens = len(tiny_tokenizer.encode(text, add_special_tokens=False))
    assert len(text) <= tokens * tiny_tokenizer.max_token_chars


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (COMPLETIONS, {"prompt": [1] * (MAX_MODEL_LEN + 1)}, "prompt"),
        (EMBEDDINGS, {"input": [[1], [1] * (MAX_MODEL_LEN + 1)]}, "input[1]"),
    ],
)
def test_token_id_prompts_longer_than_the_window_are_a_400(
    client: TestClient, path: str, body: dict[str, Any], param: str
) -> None:
    error = error_of(client.post(path, json={**BODIES[path], **body}))
    assert (error["param"], error["code"]) == (param, "context_length_exceeded")


# ---------------------------------------------------------------------------------- counts


def test_message_count_is_capped(client: TestClient, gateway: InProcessGateway) -> None:
    many = [{"role": "user", "content": "a"}] * (gateway.settings.max_messages + 1)
    error = error_of(client.post(CHAT, json={**BODIES[CHAT], "messages": many}))
    assert error["param"] == "messages"
    assert "CONVEYOR_MAX_MESSAGES" in error["message"]
    passed_every_check(client.post(CHAT, json={**BODIES[CHAT], "messages": many[:-1]}))


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (CHAT, {"n": 17}, "n"),
        (COMPLETIONS, {"prompt": ["a", "b", "c"], "n": 6}, "n"),
        (EMBEDDINGS, {"input": ["a"] * 17}, "input"),
    ],
)
def test_more_sequences_than_a_queue_holds_is_a_400_not_an_endless_429(
    client: TestClient, path: str, body: dict[str, Any], param: str
) -> None:
    error = error_of(client.post(path, json={**BODIES[path], **body}))
    assert error["param"] == param
    assert "CONVEYOR_QUEUE_MAX_DEPTH" in error["message"]


@pytest.mark.parametrize(
    ("stop", "param"),
    [
        (["x"] * (MAX_STOP_SEQUENCES + 1), "stop"),
        ("x" * (MAX_STOP_CHARS + 1), "stop"),
        (["ok", "x" * (MAX_STOP_CHARS + 1)], "stop[1]"),
        ("", "stop"),
        (["ok", ""], "stop[1]"),
    ],
)
def test_stop_count_and_length_are_capped(client: TestClient, stop: Any, param: str) -> None:
    assert error_of(client.post(CHAT, json={**BODIES[CHAT], "stop": stop}))["param"] == param


def test_stop_at_the_limits_is_accepted(client: TestClient) -> None:
    stop = ["x" * MAX_STOP_CHARS] * MAX_STOP_SEQUENCES
    passed_every_check(client.post(CHAT, json={**BODIES[CHAT], "stop": stop}))


def test_logit_bias_size_is_capped(client: TestClient) -> None:
    bias = {str(token): 1 for token in range(MAX_LOGIT_BIAS + 1)}
    error = error_of(client.post(CHAT, json={**BODIES[CHAT], "logit_bias": bias}))
    assert error["param"] == "logit_bias"


@pytest.mark.parametrize("key", ["k" * 256, "k" * 10_000, "caf\u00e9", "tab\there", "bell\x07"])
def test_idempotency_key_must_be_short_printable_ascii(client: TestClient, key: str) -> None:
    headers = {"Idempotency-Key": key.encode()}
    for path in (CHAT, COMPLETIONS):
        error = error_of(client.post(path, json=BODIES[path], headers=headers))
        assert error["param"] == "Idempotency-Key"


def test_idempotency_key_of_255_printable_characters_is_accepted(client: TestClient) -> None:
    headers = {"Idempotency-Key": "k-" + "x" * 249 + " :/="}
    passed_every_check(client.post(CHAT, json=BODIES[CHAT], headers=headers))


def test_embedding_input_count_is_capped(client: TestClient) -> None:
    error = error_of(client.post(EMBEDDINGS, json={**BODIES[EMBEDDINGS], "input": ["a"] * 2049}))
    assert error["param"] == "input"


@pytest.mark.parametrize(
    ("path", "field", "value", "param"),
    [
        (CHAT, "messages", [{"role": "user", "content": "a\\ud800"}], "messages[0].content"),
        (CHAT, "stop", ["ok", "\\udfff"], "stop[1]"),
        (CHAT, "model", "tiny\\ud800", "model"),
        (COMPLETIONS, "prompt", ["ok", "\\ud800"], "prompt[1]"),
        (EMBEDDINGS, "input", "\\ud800", "input"),
    ],
)
def test_lone_surrogates_are_a_400_naming_the_field(
    client: TestClient, path: str, field: str, value: Any, param: str
) -> None:
    """JSON escapes like \\ud800 decode to text no tokenizer or response encoder can take."""
    raw = json.dumps({**BODIES[path], field: value}).replace("\\\\u", "\\u")
    error = error_of(post_raw(client, path, raw))
    assert error["param"] == param
    assert "surrogate" in error["message"]
