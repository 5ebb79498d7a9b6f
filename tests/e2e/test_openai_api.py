"""The official `openai` client against a real gateway and a real vLLM worker."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import openai
import pytest

from tests.e2e.conftest import Running

pytestmark = [pytest.mark.e2e, pytest.mark.vllm, pytest.mark.redis]

MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture
def client(running: Running) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{running.base_url}/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model(client: openai.OpenAI, running: Running) -> None:
    assert [m.id for m in client.models.list()] == [running.model]
    assert client.models.retrieve(running.model).id == running.model


def test_chat_non_stream(client: openai.OpenAI, running: Running) -> None:
    result = client.chat.completions.create(
        model=running.model,
        messages=MESSAGES,
        max_tokens=8,
        temperature=0,  # type: ignore[arg-type]
    )
    choice = result.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content
    assert choice.finish_reason == "length"
    assert result.usage is not None
    assert result.usage.completion_tokens == 8
    assert result.usage.total_tokens == result.usage.prompt_tokens + 8


def test_chat_stream_matches_non_stream(client: openai.OpenAI, running: Running) -> None:
    full = client.chat.completions.create(
        model=running.model,
        messages=MESSAGES,
        max_tokens=16,
        temperature=0,  # type: ignore[arg-type]
    )
    chunks = list(
        client.chat.completions.create(
            model=running.model,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=16,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length"
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == 16


def test_completions_prompt_shapes(client: openai.OpenAI, running: Running) -> None:
    by_text = client.completions.create(
        model=running.model, prompt="Once upon a time", max_tokens=6, temperature=0
    )
    ids = client.completions.create(
        model=running.model, prompt=[1, 400, 500, 600], max_tokens=6, temperature=0
    )
    many = client.completions.create(
        model=running.model,
        prompt=["Once upon a time", "In a galaxy"],
        max_tokens=6,
        temperature=0,
    )
    assert by_text.choices[0].text
    assert ids.choices[0].text
    assert [c.index for c in many.choices] == [0, 1]
    assert many.choices[0].text == by_text.choices[0].text


def test_completions_stream(client: openai.OpenAI, running: Running) -> None:
    full = client.completions.create(
        model=running.model, prompt="The river", max_tokens=10, temperature=0
    )
    stream = client.completions.create(
        model=running.model, prompt="The river", max_tokens=10, temperature=0, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == full.choices[0].text


def test_n_gives_n_distinct_choices(client: openai.OpenAI, running: Running) -> None:
    result = client.chat.completions.create(
        model=running.model,
        messages=MESSAGES,
        max_tokens=12,
        temperature=1.0,
        n=2,
        seed=7,  # type: ignore[arg-type]
    )
    assert sorted(c.index for c in result.choices) == [0, 1]
    assert result.choices[0].message.content != result.choices[1].message.content
    assert result.usage is not None
    assert result.usage.completion_tokens == 24


def test_stop_string_ends_the_text_before_it(client: openai.OpenAI, running: Running) -> None:
    full = client.completions.create(
        model=running.model, prompt="The river", max_tokens=24, temperature=0
    )
    text = full.choices[0].text
    stop = text[len(text) // 2 :][:3]
    stopped = client.completions.create(
        model=running.model, prompt="The river", max_tokens=24, temperature=0, stop=[stop]
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stop not in stopped.choices[0].text
    assert text.startswith(stopped.choices[0].text)


def test_logprobs(client: openai.OpenAI, running: Running) -> None:
    chat = client.chat.completions.create(
        model=running.model,
        messages=MESSAGES,
        max_tokens=4,
        temperature=0,  # type: ignore[arg-type]
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 4
    for token in content:
        assert len(token.top_logprobs) == 3
        assert token.logprob == pytest.approx(token.top_logprobs[0].logprob)  # greedy = top-1
    text = client.completions.create(
        model=running.model, prompt="The river", max_tokens=4, temperature=0, logprobs=2
    )
    logprobs = text.choices[0].logprobs
    assert logprobs is not None and logprobs.top_logprobs is not None
    assert len(logprobs.token_logprobs or []) == 4
    assert all(len(top) == 2 for top in logprobs.top_logprobs)


def test_json_schema_output_parses(client: openai.OpenAI, running: Running) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "ok": {"type": "boolean"},
            "size": {"enum": ["small", "large"]},
        },
        "required": ["name", "ok", "size"],
        "additionalProperties": False,
    }
    result = client.chat.completions.create(
        model=running.model,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=100,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": schema}},
    )
    data = json.loads(result.choices[0].message.content or "")
    assert set(data) == {"name", "ok", "size"}
    assert isinstance(data["ok"], bool)
    assert data["size"] in ("small", "large")


def test_unknown_fields_are_ignored(running: Running) -> None:
    response = httpx.post(
        f"{running.base_url}/v1/chat/completions",
        json={
            "model": running.model,
            "messages": MESSAGES,
            "max_tokens": 2,
            "langchain_extra": {"x": 1},
            "parallel_tool_calls": False,
        },
        timeout=60,
    )
    assert response.status_code == 200


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="nope", messages=MESSAGES, max_tokens=2)  # type: ignore[arg-type]
    assert caught.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_context_overflow_is_400_naming_max_tokens(client: openai.OpenAI, running: Running) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=running.model, prompt="hi", max_tokens=100_000)
    assert caught.value.body["param"] == "max_tokens"  # type: ignore[index]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"n": 0}, "n"),
        ({"temperature": 3}, "temperature"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"stop": ["x"] * 33}, None),
        ({"stream_options": {"include_usage": True}}, None),
        # tool_choice defaults to "auto", which the demo model (no tool-call format) refuses
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
        ({"logit_bias": {"99999999": 5}}, "logit_bias"),
        ({"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
    ],
)
def test_validation_errors_are_openai_shaped(
    running: Running, body: dict[str, object], param: str | None
) -> None:
    response = httpx.post(
        f"{running.base_url}/v1/chat/completions",
        json={"model": running.model, "messages": MESSAGES, **body},
        timeout=30,
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param


def test_stream_has_sse_ids(running: Running) -> None:
    with httpx.stream(
        "POST",
        f"{running.base_url}/v1/completions",
        json={"model": running.model, "prompt": "a", "max_tokens": 3, "stream": True},
        timeout=60,
    ) as response:
        lines = [line for line in response.iter_lines() if line]
    ids = [int(line[4:]) for line in lines if line.startswith("id: ")]
    assert ids == sorted(ids) and ids[0] == 0
    assert lines[-1] == "data: [DONE]"


def _greedy_ids(running: Running, **extra: object) -> list[int]:
    response = httpx.post(
        f"{running.base_url}/v1/completions",
        json={
            "model": running.model,
            "prompt": "The river",
            "max_tokens": 8,
            "temperature": 0,
            "return_token_ids": True,
            **extra,
        },
        timeout=120,
    )
    response.raise_for_status()
    ids: list[int] = response.json()["choices"][0]["token_ids"]
    return ids


def test_logit_bias_reaches_the_sampler(running: Running) -> None:
    """+100 on one token makes greedy decoding pick only it; -100 bans the greedy choice."""
    plain = _greedy_ids(running)
    forced = next(token for token in range(300, 400) if token not in plain)
    assert _greedy_ids(running, logit_bias={str(forced): 100}) == [forced] * 8
    banned = _greedy_ids(running, logit_bias={str(plain[0]): -100})
    assert banned[0] != plain[0]
    assert plain[0] not in banned


@pytest.mark.parametrize(
    ("structured", "conforms"),
    [
        ({"choice": ["alpha", "beta"]}, lambda text: text in ("alpha", "beta")),
        ({"regex": r"[a-z]{3}-\d{2}"}, lambda text: re.fullmatch(r"[a-z]{3}-\d{2}", text)),
        ({"grammar": 'root ::= "yes" | "no"'}, lambda text: text in ("yes", "no")),
        ({"grammar": 'start: "up" | "down"'}, lambda text: text in ("up", "down")),
    ],
)
def test_structured_outputs_conform(
    client: openai.OpenAI, running: Running, structured: dict[str, object], conforms: Any
) -> None:
    result = client.chat.completions.create(
        model=running.model,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=20,
        temperature=1.0,
        n=2,
        extra_body={"structured_outputs": structured},
    )
    for choice in result.choices:
        assert conforms(choice.message.content or ""), choice.message.content
        assert choice.finish_reason == "stop"


def test_structured_regex_streams_conforming_text(client: openai.OpenAI, running: Running) -> None:
    chunks = client.completions.create(
        model=running.model,
        prompt="The code is",
        max_tokens=20,
        stream=True,
        extra_body={"structured_outputs": {"regex": r"\d{4}"}},
    )
    assert re.fullmatch(r"\d{4}", "".join(c.choices[0].text for c in chunks if c.choices))


@pytest.mark.parametrize(
    ("structured", "param"),
    [
        ({"regex": "(unclosed"}, "structured_outputs.regex"),
        ({"grammar": "root ::= "}, "structured_outputs.grammar"),
        ({"grammar": "not a grammar at all"}, "structured_outputs.grammar"),
    ],
)
def test_invalid_structured_outputs_are_400s(
    client: openai.OpenAI, running: Running, structured: dict[str, object], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=running.model,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=4,
            extra_body={"structured_outputs": structured},
        )
    assert caught.value.body["param"] == param  # type: ignore[index]


def test_an_invalid_grammar_in_a_stream_is_a_400_before_the_stream(
    client: openai.OpenAI, running: Running
) -> None:
    """The worker checks the grammar before the engine runs; a constrained stream sends
    its 200 only after that first event, so the refusal is the request's 400 (as vLLM)."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=running.model,
            messages=MESSAGES,  # type: ignore[arg-type]
            max_tokens=4,
            stream=True,
            extra_body={"structured_outputs": {"regex": "(unclosed"}},
        )
    assert caught.value.body["param"] == "structured_outputs.regex"  # type: ignore[index]
    assert caught.value.body["type"] == "invalid_request_error"  # type: ignore[index]


def test_streamed_echo_equals_the_answer(client: openai.OpenAI, running: Running) -> None:
    """A streamed ``echo`` with ``logprobs`` joins up to the non-streamed answer."""
    fields: dict[str, Any] = {
        "model": running.model, "prompt": "The river", "echo": True, "max_tokens": 3,
        "logprobs": 1, "temperature": 0,
    }  # fmt: skip
    whole = client.completions.create(**fields).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**fields, stream=True) if c.choices]
    assert "".join(c.text for c in chunks) == whole.text
    streamed = [lp for c in chunks if c.logprobs for lp in c.logprobs.token_logprobs or []]
    assert whole.logprobs is not None and whole.logprobs.token_logprobs is not None
    assert streamed[0] is None and whole.logprobs.token_logprobs[0] is None
    assert streamed[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-4)


def test_allowed_and_stop_token_ids_reach_the_sampler(running: Running) -> None:
    allowed = [300, 301, 302]
    ids = _greedy_ids(running, allowed_token_ids=allowed, ignore_eos=True)
    assert ids and set(ids) <= set(allowed)
    plain = _greedy_ids(running, ignore_eos=True)
    stopped = _greedy_ids(running, stop_token_ids=[plain[2]], ignore_eos=True)
    assert stopped[-1] == plain[2] and len(stopped) <= 3


def test_continuous_usage_counts_every_chunk(client: openai.OpenAI, running: Running) -> None:
    chunks = list(
        client.completions.create(
            model=running.model,
            prompt="The river",
            max_tokens=5,
            stream=True,
            extra_body={"ignore_eos": True},
            stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
        )
    )
    counts = [c.usage.completion_tokens for c in chunks if c.choices and c.usage]
    assert counts == sorted(counts) and counts[-1] == 5
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 5


def test_return_token_ids_and_cache_salt(running: Running) -> None:
    prompt = [20, 21, 22, 23]
    response = httpx.post(
        f"{running.base_url}/v1/completions",
        json={
            "model": running.model,
            "prompt": prompt,
            "max_tokens": 4,
            "temperature": 0,
            "return_token_ids": True,
            "cache_salt": "tenant-a",
        },
        timeout=120,
    )
    response.raise_for_status()
    [choice] = response.json()["choices"]
    assert choice["prompt_token_ids"] == prompt
    assert len(choice["token_ids"]) == 4


def test_continue_final_message_with_echo(client: openai.OpenAI, running: Running) -> None:
    """vLLM's chat extensions: the last message left open, and echoed before the answer."""
    turns = [*MESSAGES, {"role": "assistant", "content": "The sea is"}]
    chat = client.chat.completions.create(
        model=running.model, messages=turns, max_tokens=4, temperature=0,  # type: ignore[arg-type]
        extra_body={"add_generation_prompt": False, "continue_final_message": True, "echo": True},
    )  # fmt: skip
    content = chat.choices[0].message.content or ""
    assert content.startswith("The sea is") and len(content) > len("The sea is")


def test_a_custom_role_and_template_kwargs(client: openai.OpenAI, running: Running) -> None:
    chat = client.chat.completions.create(
        model=running.model, max_tokens=2,
        messages=[{"role": "narrator", "content": "Once"}, *MESSAGES],  # type: ignore[list-item]
        extra_body={"chat_template_kwargs": {"enable_thinking": False}, "return_token_ids": True},
    )  # fmt: skip
    assert chat.choices[0].finish_reason == "length"
    ids = (chat.model_extra or {})["prompt_token_ids"]
    rendered = httpx.post(
        f"{running.base_url}/detokenize", json={"model": running.model, "tokens": ids}
    ).json()["prompt"]
    assert "narrator" in rendered


def test_chat_batch_answers_each_conversation_as_a_chat_completion(
    client: openai.OpenAI, running: Running
) -> None:
    """vLLM's ``/v1/chat/completions/batch``: choice ``i`` is what a greedy chat
    completion of conversation ``i`` answers, and the usage adds up."""
    conversations = [MESSAGES, [{"role": "user", "content": "Name a river."}]]
    fields: dict[str, Any] = {"model": running.model, "max_tokens": 6, "temperature": 0}
    singles = [
        client.chat.completions.create(messages=messages, **fields)  # type: ignore[arg-type]
        for messages in conversations
    ]
    response = httpx.post(
        f"{running.base_url}/v1/chat/completions/batch",
        json={**fields, "messages": conversations},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    batch = response.json()
    assert [c["index"] for c in batch["choices"]] == [0, 1]
    for choice, single in zip(batch["choices"], singles, strict=True):
        assert choice["message"]["content"] == single.choices[0].message.content
    assert batch["usage"]["prompt_tokens"] == sum(s.usage.prompt_tokens for s in singles if s.usage)
