"""OpenAI request schema: the ranges and rules the gateway enforces before anything is queued."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from gateway.openai.schemas import (
    MAX_N,
    ChatCompletionRequest,
    CompletionRequest,
    JsonSchemaSpec,
    known_fields,
)

USER = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **fields})


def completion(**fields: Any) -> CompletionRequest:
    return CompletionRequest.model_validate({"model": "m", "prompt": "hi", **fields})


BUILDERS = {"chat": chat, "completion": completion}


def refused(build: Any, **fields: Any) -> ValidationError:
    with pytest.raises(ValidationError) as info:
        build(**fields)
    return info.value


def test_minimal_requests_and_defaults() -> None:
    request = chat()
    assert request.n == 1
    assert request.stream is False
    assert request.logprobs is False
    assert request.token_budget() is None
    assert request.stop_list() == ()
    assert request.include_usage() is False
    assert completion().prompts() == ["hi"]


@pytest.mark.parametrize("kind", BUILDERS)
@pytest.mark.parametrize("n", [1, 2, 128])
def test_n_in_range(kind: str, n: int) -> None:
    assert BUILDERS[kind](n=n).n == n


@pytest.mark.parametrize("kind", BUILDERS)
@pytest.mark.parametrize("n", [0, -1, 129, 10_000])
def test_n_out_of_range(kind: str, n: int) -> None:
    error = refused(BUILDERS[kind], n=n)
    assert error.errors()[0]["loc"] == ("n",)


@given(st.integers(-1000, 1000))
def test_n_range_property(n: int) -> None:
    if 1 <= n <= MAX_N:
        assert chat(n=n).n == n
    else:
        with pytest.raises(ValidationError):
            chat(n=n)


@pytest.mark.parametrize("top", [0, 1, 20])
def test_top_logprobs_in_range(top: int) -> None:
    assert chat(logprobs=True, top_logprobs=top).top_logprobs == top


@pytest.mark.parametrize("top", [-1, 21])
def test_top_logprobs_out_of_range(top: int) -> None:
    refused(chat, logprobs=True, top_logprobs=top)


def test_top_logprobs_needs_logprobs() -> None:
    error = refused(chat, top_logprobs=2)
    assert "top_logprobs requires logprobs" in str(error)


@pytest.mark.parametrize("logprobs", [0, 5])
def test_completion_logprobs_in_range(logprobs: int) -> None:
    assert completion(logprobs=logprobs).logprobs == logprobs


@pytest.mark.parametrize("logprobs", [-1, 6, 20])
def test_completion_logprobs_out_of_range(logprobs: int) -> None:
    refused(completion, logprobs=logprobs)


@pytest.mark.parametrize("kind", BUILDERS)
def test_stop_sequences(kind: str) -> None:
    build = BUILDERS[kind]
    assert build(stop="END").stop_list() == ("END",)
    many = [f"s{i}" for i in range(32)]
    assert build(stop=many).stop_list() == tuple(many)
    assert build(stop=None).stop_list() == ()
    error = refused(build, stop=[*many, "one-too-many"])
    assert "at most 32" in str(error)


@pytest.mark.parametrize("kind", BUILDERS)
def test_stream_options_need_stream(kind: str) -> None:
    build = BUILDERS[kind]
    error = refused(build, stream_options={"include_usage": True})
    assert "stream_options is only allowed when stream is true" in str(error)
    refused(build, stream=False, stream_options={"include_usage": False})
    ok = build(stream=True, stream_options={"include_usage": True})
    assert ok.include_usage() is True
    assert build(stream=True).include_usage() is False
    assert build(stream=True, stream_options={}).include_usage() is False


@pytest.mark.parametrize("kind", BUILDERS)
def test_unknown_fields_are_accepted_and_kept_aside(kind: str) -> None:
    request = BUILDERS[kind](
        service_tier="auto",
        metadata={"a": 1},
        some_langchain_extra=[1, 2],
    )
    assert set(request.model_extra or {}) == {
        "service_tier",
        "metadata",
        "some_langchain_extra",
    }
    # Nested objects are lenient too.
    lenient = BUILDERS[kind](stream=True, stream_options={"include_usage": True, "x": 1})
    assert lenient.include_usage()


@pytest.mark.parametrize(
    ("field", "good", "bad"),
    [
        ("temperature", [0, 0.7, 2], [-0.1, 2.01]),
        ("top_p", [0.01, 1], [0, 1.1]),
        ("top_k", [-1, 0, 50, 2**31 - 1], [-2, 2**31, 2**64]),
        ("min_p", [0, 1], [-0.1, 1.1]),
        ("presence_penalty", [-2, 0, 2], [-2.1, 2.1]),
        ("frequency_penalty", [-2, 2], [-3, 3]),
        ("repetition_penalty", [0.5, 2], [0, 2.5]),
        ("max_tokens", [1, 100, 2**31 - 1], [0, -5, 2**31, 2**64]),
        ("min_tokens", [0, 3, 2**31 - 1], [-1, 2**31, 2**64]),
        ("seed", [-(2**63), 0, 2**63 - 1 - 128], [-(2**63) - 1, 2**63 - 128, 2**64]),
    ],
)
@pytest.mark.parametrize("kind", BUILDERS)
def test_numeric_ranges(kind: str, field: str, good: list[float], bad: list[float]) -> None:
    build = BUILDERS[kind]
    if kind == "completion" and field == "max_tokens":  # 0: the echo of a scored prompt
        good, bad = [0, *good], [v for v in bad if v != 0]
    for value in good:
        assert getattr(build(**{field: value}), field) == value
    for value in bad:
        error = refused(build, **{field: value})
        assert error.errors()[0]["loc"] == (field,)


def test_chat_specific_rules() -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"model": "m", "messages": []})
    assert chat(messages=[{"role": "wizard", "content": "x"}]).messages[0].role == "wizard"
    refused(chat, messages=[{"role": "wizard"}])  # any role but an assistant's needs content
    refused(chat, continue_final_message=True)  # with add_generation_prompt (the default)
    opened = chat(messages=[{"role": "assistant", "content": "Once"}], echo=True)
    assert opened.echoed() == "Once"
    assert chat(echo=True).echoed() is None  # the last message is not the answer's role
    assert chat(echo=True, add_generation_prompt=False).echoed() == USER[0]["content"]
    refused(chat, max_completion_tokens=0)
    assert chat(max_completion_tokens=7, max_tokens=3).token_budget() == 7
    assert chat(max_tokens=3).token_budget() == 3
    for role in ("system", "developer", "user", "tool"):
        for message in ({"role": role, "content": None}, {"role": role}):
            refused(chat, messages=[message])
    call = {"id": "c1", "function": {"name": "f", "arguments": "{}"}}
    assistant = {"role": "assistant", "content": None, "tool_calls": [call]}
    assert chat(messages=[*USER, assistant]).messages[1].content is None
    bare = {"role": "assistant", "content": None}
    assert chat(messages=[*USER, bare]).messages[1].content is None


def test_chat_content_parts() -> None:
    request = chat(
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "a"},
                    {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                ],
            }
        ]
    )
    parts = request.messages[0].content
    assert isinstance(parts, list)
    assert [p.type for p in parts] == ["text", "image_url"]
    with pytest.raises(ValidationError):
        chat(messages=[{"role": "user", "content": [{"type": "audio", "data": "x"}]}])


def test_response_format() -> None:
    assert chat(response_format={"type": "text"}).response_format is not None
    assert chat(response_format={"type": "json_object"}).response_format is not None
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    request = chat(response_format={"type": "json_schema", "json_schema": {"schema": schema}})
    assert request.response_format is not None
    assert request.response_format.json_schema is not None
    assert request.response_format.json_schema.schema_ == schema
    assert "needs json_schema.schema" in str(refused(chat, response_format={"type": "json_schema"}))
    refused(chat, response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    refused(chat, response_format={"type": "yaml"})


def test_completion_unsupported_options() -> None:
    assert completion(echo=True, stream=True).echo  # streamed as vLLM streams it
    assert completion(echo=True, max_tokens=0, logprobs=1).prompt_logprobs_k() == 1
    assert completion(echo=True, max_tokens=0).token_budget() == 1
    assert "not available when stream" in str(refused(completion, prompt_logprobs=1, stream=True))
    assert "suffix is not supported" in str(refused(completion, suffix="tail"))
    assert completion(echo=False, suffix="").prompts() == ["hi"]


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        ("hello", ["hello"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
        ("", [""]),
    ],
)
def test_prompt_shapes(prompt: Any, expected: list[Any]) -> None:
    assert completion(prompt=prompt).prompts() == expected


def test_prompt_shapes_keep_their_types() -> None:
    ints = completion(prompt=[5, 6]).prompts()
    assert ints == [[5, 6]]
    assert all(isinstance(t, int) for t in ints[0])  # type: ignore[union-attr]
    strings = completion(prompt=["5", "6"]).prompts()
    assert strings == ["5", "6"]


def test_empty_prompt_list_is_refused_by_prompts() -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        completion(prompt=[]).prompts()


@pytest.mark.parametrize("prompt", [None, 5, [1, "a"], [[1], ["a"]], {"text": "x"}])
def test_bad_prompt_types(prompt: Any) -> None:
    error = refused(completion, prompt=prompt)
    assert error.errors()[0]["loc"][0] == "prompt"


def test_known_fields_include_aliases() -> None:
    assert "schema" in known_fields(JsonSchemaSpec)
    chat_fields = known_fields(ChatCompletionRequest)
    assert {"model", "messages", "n", "stop", "top_logprobs", "stream_options"} <= chat_fields
    assert "prompt" in known_fields(CompletionRequest)
