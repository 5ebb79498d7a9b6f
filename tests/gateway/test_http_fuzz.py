"""Fuzz the OpenAI routes in process: no input may produce a 5xx or a non-OpenAI error.

Bodies start valid and get fields replaced by awkward values (NaN and infinity
literals, huge integers, wrong types, empty and long strings, nested junk), headers
get awkward strings, and raw bodies get broken JSON. Valid requests are really
queued (fake Redis, a registered fake worker) and end at a 10 ms deadline with a
504: the one 5xx allowed. Derandomized, so every run tries the same inputs.

(schemathesis, run against the same app with 600 generated cases per route and mode,
found nothing: it does not send NaN literals, huge integers or header strings. These
strategies do, and found the defects listed in docs/api.md, "Limits".)
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.catalog.served_models import ServedModel
from tests.gateway.harness import BODIES, CHAT, COMPLETIONS, EMBEDDINGS, build_gateway

FUZZ = settings(
    max_examples=300,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

FIELDS = {
    CHAT: ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p",
           "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
           "seed", "stop", "n", "stream", "stream_options", "response_format", "ignore_eos",
           "min_tokens", "return_token_ids", "user", "logprobs", "top_logprobs", "logit_bias",
           "tools", "tool_choice", "functions", "function_call", "audio", "modalities",
           "web_search_options", "parallel_tool_calls", "extra"],
    COMPLETIONS: ["model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "seed",
                  "stop", "n", "stream", "stream_options", "logprobs", "echo", "suffix",
                  "best_of", "logit_bias", "min_tokens", "response_format", "extra"],
    EMBEDDINGS: ["model", "input", "encoding_format", "dimensions", "user", "extra"],
}  # fmt: skip

NASTY_SCALARS: list[Any] = [
    math.nan, math.inf, -math.inf, 1e308, -1e308, 2**64, -(2**64), 2**63, 2**31, -1, 0, 1,
    0.5, -0.0, True, False, None, "", "x" * 300, "\u0000", "NaN", "1e400", "none", "auto",
    "text", "json_schema", "\ud800", "a\udfffb",
]  # fmt: skip

json_leaves = st.one_of(
    st.sampled_from(NASTY_SCALARS),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
)
json_values = st.recursive(
    json_leaves,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner,
                                                                 max_size=4),
    max_leaves=12,
)  # fmt: skip

NESTED: dict[str, st.SearchStrategy[Any]] = {
    "messages": st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]) | json_values},
            optional={
                "content": json_values
                | st.lists(
                    st.fixed_dictionaries(
                        {"type": st.sampled_from(["text", "image_url"]) | json_values},
                        optional={
                            "text": json_values,
                            "image_url": st.fixed_dictionaries({"url": json_values}),
                        },
                    ),
                    max_size=3,
                ),
                "name": json_values,
            },
        ),
        max_size=3,
    ),
    "logit_bias": st.dictionaries(st.sampled_from(["0", "5", "-1", "319", "320", "x", "1e3"]),
                                  json_values, max_size=4),
    "response_format": st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "json_object", "json_schema"]) | json_values},
        optional={"json_schema": st.fixed_dictionaries({}, optional={"schema": json_values,
                                                                     "name": json_values})},
    ),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": json_values}),
}  # fmt: skip

HEADER_VALUES = st.sampled_from(
    ["nan", "inf", "-inf", "1e308", "1e-308", "0", "-0", "0.001", "5", " 5 ", "0x10", "1_0",
     "", "abc", "k" * 300, "ok-key", "\t", "é"]
)  # fmt: skip


@pytest.fixture(scope="module")
def client(served_model: ServedModel) -> Iterator[TestClient]:
    gateway = build_gateway(
        served_model,
        workers=True,
        request_timeout_s=0.01,
        max_request_timeout_s=0.01,
        max_request_body_bytes=64 * 1024,
        queue_max_depth=64,
    )
    with TestClient(gateway.app, raise_server_exceptions=False) as test_client:
        yield test_client


def assert_no_server_error(response: Any) -> None:
    status = response.status_code
    if status == 200:
        return
    assert response.headers["content-type"].startswith("application/json"), response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    if status >= 500:  # a valid request reaching its (10 ms) deadline is the only 5xx
        assert (status, body["error"]["code"]) == (504, "deadline_exceeded"), response.text


@st.composite
def mutated_bodies(draw: st.DrawFn, path: str) -> dict[str, Any]:
    body = dict(BODIES[path])
    for field in draw(st.lists(st.sampled_from(FIELDS[path]), min_size=1, max_size=4)):
        body[field] = draw(NESTED.get(field, json_values) | json_values)
    return body


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, EMBEDDINGS])
def test_mutated_bodies_and_headers_never_give_a_server_error(
    client: TestClient, path: str
) -> None:
    @FUZZ
    @given(
        body=mutated_bodies(path),
        timeout=st.none() | HEADER_VALUES,
        key=st.none() | HEADER_VALUES,
    )
    def check(body: dict[str, Any], timeout: str | None, key: str | None) -> None:
        headers = {"content-type": "application/json"}
        if timeout is not None:
            headers["X-Request-Timeout"] = timeout
        if key is not None:
            headers["Idempotency-Key"] = key
        raw = json.dumps(body, allow_nan=True).encode()  # NaN/Infinity literals included
        encoded = {name: value.encode() for name, value in headers.items()}
        assert_no_server_error(client.post(path, content=raw, headers=encoded))

    check()


RAW_BODIES = [
    b"",
    b"{",
    b"null",
    b"[]",
    b"42",
    b'"text"',
    b"\xff\xfe\x00garbage",
    b"[" * 100_000 + b"]" * 100_000,
    b'{"model": "tiny", "messages": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    b'{"model": "tiny", "prompt": "\\ud800"}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\udc00"}]}',
    b'{"model": "tiny\\ud800", "messages": [{"role": "user", "content": "a"}]}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "a"}], "stop": ["\\ud800"]}',
    b'{"model": "tiny-embed", "input": ["ok", "\\ud800"]}',
    b'{"model": "tiny", "input": [1, 2, NaN]}',
    b'{"model": "tiny", "prompt": [[1, 2], [3, Infinity]]}',
]


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS, EMBEDDINGS])
@pytest.mark.parametrize("raw", RAW_BODIES, ids=range(len(RAW_BODIES)))
@pytest.mark.parametrize("content_type", ["application/json", "text/plain", None])
def test_broken_bodies_are_client_errors(
    client: TestClient, path: str, raw: bytes, content_type: str | None
) -> None:
    headers = {"content-type": content_type} if content_type else {}
    response = client.post(path, content=raw, headers=headers)
    assert 400 <= response.status_code < 500, response.text
    assert_no_server_error(response)


@pytest.mark.parametrize(
    "model_id", ["%ED%A0%80", "x" * 10_000, "..%2F..%2Fetc", "%00", "tiny%0d%0aX: y"]
)
def test_odd_model_ids_are_client_errors(client: TestClient, model_id: str) -> None:
    response = client.get(f"/v1/models/{model_id}")
    assert response.status_code == 404, response.text
    assert_no_server_error(response)
