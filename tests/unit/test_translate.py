"""OpenAI request -> prompts, choices and SamplingOptions, with a small real tokenizer."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from gateway.catalog.served_models import ServedModel
from gateway.catalog.tokenizer import ModelTokenizer
from gateway.openai.schemas import ChatCompletionRequest, CompletionRequest
from gateway.openai.unknown_fields import (
    MAX_LOGGED_NAME_CHARS,
    MAX_UNKNOWN_FIELDS,
    UnknownFieldLog,
)
from gateway.serving import translate
from shared.errors import ChatTemplateError, ContextLengthExceeded, InvalidRequest
from shared.protocol import GenerateJob, SamplingOptions, decode, encode
from tests.support.tiny_model import MAX_MODEL_LEN, build_tokenizer_folder


def chat(**fields: Any) -> ChatCompletionRequest:
    fields.setdefault("messages", [{"role": "user", "content": "hello"}])
    return ChatCompletionRequest.model_validate({"model": "tiny", **fields})


def completion(**fields: Any) -> CompletionRequest:
    fields.setdefault("prompt", "hello")
    return CompletionRequest.model_validate({"model": "tiny", **fields})


# ------------------------------------------------------------------------ chat prompts


def test_chat_prompt_uses_the_chat_template(served_model: ServedModel) -> None:
    request = chat(
        messages=[
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "hello", "name": "bob"},
        ]
    )
    ids = translate.chat_prompt(request, served_model)
    text = served_model.tokenizer.decode(ids)
    assert text == "<s><|system|>be brief</s>\n<|user|>hello</s>\n<|assistant|>"
    # The template holds BOS already: it is not added twice.
    bos = served_model.tokenizer.encode("", add_special_tokens=True)
    assert ids[:1] == bos and ids[1:2] != bos


def test_chat_text_parts_are_joined_and_none_is_empty(served_model: ServedModel) -> None:
    parts = chat(
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}],
            },
            {"role": "assistant", "content": None},
        ]
    )
    text = served_model.tokenizer.decode(translate.chat_prompt(parts, served_model))
    assert text == "<s><|user|>hello</s>\n<|assistant|></s>\n<|assistant|>"


def test_chat_image_part_is_refused_with_its_position(served_model: ServedModel) -> None:
    request = chat(
        messages=[
            {"role": "user", "content": "a"},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "look"},
                    {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                ],
            },
        ]
    )
    with pytest.raises(InvalidRequest) as info:
        translate.chat_prompt(request, served_model)
    assert info.value.param == "messages[1].content[1]"
    assert info.value.status == 400


def test_template_raise_exception_is_an_invalid_request(served_model: ServedModel) -> None:
    request = chat(messages=[{"role": "tool", "content": "result"}])
    with pytest.raises(ChatTemplateError) as info:
        translate.chat_prompt(request, served_model)
    assert isinstance(info.value, InvalidRequest)
    assert info.value.param == "messages"
    assert "cannot start with a tool message" in info.value.message


def test_model_without_chat_template(tmp_path: Path) -> None:
    folder = build_tokenizer_folder(tmp_path / "plain", chat_template=None)
    tokenizer = ModelTokenizer(folder)
    assert tokenizer.has_chat_template is False
    model = ServedModel("plain", str(folder), tokenizer, MAX_MODEL_LEN, 0)
    with pytest.raises(InvalidRequest) as info:
        translate.chat_prompt(chat(), model)
    assert info.value.param == "messages"
    assert "/v1/completions" in info.value.message


def test_chat_template_file_overrides_config(tmp_path: Path) -> None:
    folder = build_tokenizer_folder(tmp_path / "file")
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    )
    tokenizer = ModelTokenizer(folder)
    assert tokenizer.render_chat([{"role": "user", "content": "x"}]) == "[x]"


# ------------------------------------------------------------------ completion prompts


def test_completion_prompt_shapes(served_model: ServedModel) -> None:
    tok = served_model.tokenizer
    hello = tok.encode("hello", add_special_tokens=True)
    world = tok.encode("world", add_special_tokens=True)
    assert translate.completion_prompts(completion(prompt="hello"), served_model) == [hello]
    assert translate.completion_prompts(completion(prompt=["hello", "world"]), served_model) == [
        hello,
        world,
    ]
    assert translate.completion_prompts(completion(prompt=[5, 6, 7]), served_model) == [[5, 6, 7]]
    assert translate.completion_prompts(completion(prompt=[[5], [6, 7]]), served_model) == [
        [5],
        [6, 7],
    ]


@pytest.mark.parametrize("prompt", [[], [[]], [[1], []]])
def test_empty_prompts_are_refused(served_model: ServedModel, prompt: Any) -> None:
    with pytest.raises(InvalidRequest) as info:
        translate.completion_prompts(completion(prompt=prompt), served_model)
    assert info.value.param == "prompt"
    assert "empty" in info.value.message


@pytest.mark.parametrize("bad", [-1, 320, 10**9])
def test_token_ids_outside_the_vocabulary_are_refused(served_model: ServedModel, bad: int) -> None:
    vocab = served_model.tokenizer.vocab_size()
    assert vocab == 320
    for prompt in ([1, bad], [[1], [bad]]):
        with pytest.raises(InvalidRequest) as info:
            translate.completion_prompts(completion(prompt=prompt), served_model)
        assert info.value.param == "prompt"
        assert f"outside the vocabulary of `tiny` (0..{vocab - 1})" in info.value.message
    assert translate.completion_prompts(completion(prompt=[0, vocab - 1]), served_model) == [
        [0, vocab - 1]
    ]


# ----------------------------------------------------------------------------- choices


def test_n_choices_get_distinct_indices_and_seeds(served_model: ServedModel) -> None:
    request = completion(n=3, seed=100)
    prompts = [[1, 2], [3, 4, 5]]
    specs = translate.choices(request, prompts, served_model, logprobs=None)
    assert [s.index for s in specs] == list(range(6))
    for spec in specs:
        prompt_index, sample = divmod(spec.index, 3)
        assert spec.prompt_token_ids == prompts[prompt_index]
        assert spec.sampling.seed == 100 + sample


def test_no_seed_means_no_seed(served_model: ServedModel) -> None:
    specs = translate.choices(chat(n=4), [[1, 2]], served_model, logprobs=None)
    assert [s.sampling.seed for s in specs] == [None] * 4
    assert [s.index for s in specs] == [0, 1, 2, 3]


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 6),
    lengths=st.lists(st.integers(1, 10), min_size=1, max_size=4),
    seed=st.none() | st.integers(-(2**31), 2**31),
)
def test_choice_numbering_property(
    served_model: ServedModel, n: int, lengths: list[int], seed: int | None
) -> None:
    prompts = [list(range(1, length + 1)) for length in lengths]
    request = completion(n=n, seed=seed)
    specs = translate.choices(request, prompts, served_model, logprobs=None)
    assert sorted(s.index for s in specs) == list(range(len(prompts) * n))
    for spec in specs:
        prompt_index, sample = divmod(spec.index, n)
        assert spec.prompt_token_ids == prompts[prompt_index]
        assert spec.sampling.seed == (None if seed is None else seed + sample)
        assert spec.sampling.max_tokens == MAX_MODEL_LEN - len(prompts[prompt_index])


def test_default_max_tokens_fills_the_context(served_model: ServedModel) -> None:
    [spec] = translate.choices(completion(), [[1] * 10], served_model, logprobs=None)
    assert spec.sampling.max_tokens == MAX_MODEL_LEN - 10


def test_max_tokens_up_to_the_limit(served_model: ServedModel) -> None:
    [spec] = translate.choices(
        completion(max_tokens=MAX_MODEL_LEN - 10), [[1] * 10], served_model, logprobs=None
    )
    assert spec.sampling.max_tokens == MAX_MODEL_LEN - 10


@pytest.mark.parametrize(
    "request_",
    [
        completion(max_tokens=MAX_MODEL_LEN - 9),
        chat(max_tokens=MAX_MODEL_LEN),
        chat(max_completion_tokens=MAX_MODEL_LEN - 9),
    ],
    ids=["completion", "chat-max_tokens", "chat-max_completion_tokens"],
)
def test_context_length_error_names_max_tokens(served_model: ServedModel, request_: Any) -> None:
    with pytest.raises(ContextLengthExceeded) as info:
        translate.choices(request_, [[1] * 10], served_model, logprobs=None)
    error = info.value
    assert error.param == "max_tokens"
    assert error.status == 400
    assert error.code == "context_length_exceeded"
    assert error.type == "invalid_request_error"
    assert f"maximum context length is {MAX_MODEL_LEN}" in error.message
    assert "10 in the prompt" in error.message


@pytest.mark.parametrize(("request_", "param"), [(completion(), "prompt"), (chat(), "messages")])
def test_prompt_alone_too_long(served_model: ServedModel, request_: Any, param: str) -> None:
    with pytest.raises(ContextLengthExceeded) as info:
        translate.choices(request_, [[1] * MAX_MODEL_LEN], served_model, logprobs=None)
    assert info.value.param == param
    assert f"has {MAX_MODEL_LEN} tokens" in info.value.message


def test_one_long_prompt_refuses_the_whole_request(served_model: ServedModel) -> None:
    with pytest.raises(ContextLengthExceeded):
        translate.choices(
            completion(max_tokens=5), [[1] * 5, [1] * 60], served_model, logprobs=None
        )


# ---------------------------------------------------------------------------- sampling


def test_sampling_defaults(served_model: ServedModel) -> None:
    [spec] = translate.choices(chat(max_tokens=4), [[1]], served_model, logprobs=None)
    assert spec.sampling == SamplingOptions(max_tokens=4)


def test_sampling_fields_are_mapped(served_model: ServedModel) -> None:
    request = completion(
        max_tokens=8,
        temperature=0,
        top_p=0.5,
        top_k=40,
        min_p=0.1,
        presence_penalty=-1,
        frequency_penalty=1.5,
        repetition_penalty=1.2,
        seed=7,
        stop=["\n", "END"],
        ignore_eos=True,
        min_tokens=2,
        logprobs=3,
    )
    [spec] = translate.choices(request, [[1]], served_model, logprobs=request.logprobs)
    s = spec.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.min_p) == (8, 0.0, 0.5, 40, 0.1)
    assert (s.presence_penalty, s.frequency_penalty, s.repetition_penalty) == (-1, 1.5, 1.2)
    assert (s.seed, s.stop, s.ignore_eos, s.min_tokens, s.logprobs) == (
        7,
        ("\n", "END"),
        True,
        2,
        3,
    )


def test_top_k_minus_one_means_off(served_model: ServedModel) -> None:
    [spec] = translate.choices(chat(top_k=-1), [[1]], served_model, logprobs=None)
    assert spec.sampling.top_k == 0


def test_structured_output(served_model: ServedModel) -> None:
    def sampling(**fields: Any) -> SamplingOptions:
        [spec] = translate.choices(chat(**fields), [[1]], served_model, logprobs=None)
        return spec.sampling

    assert sampling(response_format={"type": "text"}).json_schema is None
    assert sampling(response_format={"type": "json_object"}).json_object is True
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    s = sampling(response_format={"type": "json_schema", "json_schema": {"schema": schema}})
    assert s.json_schema is not None
    assert json.loads(s.json_schema) == schema
    assert s.json_object is False


@pytest.mark.parametrize(
    ("fields", "expected"),
    [({}, None), ({"logprobs": True}, 0), ({"logprobs": True, "top_logprobs": 4}, 4)],
)
def test_chat_logprobs(fields: dict[str, Any], expected: int | None) -> None:
    assert translate.chat_logprobs(chat(**fields)) == expected


def test_unknown_fields_are_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    log = UnknownFieldLog()
    with caplog.at_level(logging.INFO, logger="gateway.openai.unknown_fields"):
        log.note(chat(foo=1, bar=2))
        log.note(chat(foo=3))
        log.note(completion(bar=1, baz=2))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2  # one line per request with new names, none for the second
    assert "['bar', 'foo']" in lines[0] and "['baz']" in lines[1]


def test_unknown_fields_per_request_are_capped() -> None:
    log = UnknownFieldLog()
    log.note(chat(**{f"x{i}": i for i in range(MAX_UNKNOWN_FIELDS)}))
    with pytest.raises(InvalidRequest, match=f"at most {MAX_UNKNOWN_FIELDS} unknown"):
        log.note(chat(**{f"y{i}": i for i in range(MAX_UNKNOWN_FIELDS + 1)}))


def test_the_remembered_names_are_bounded(caplog: pytest.LogCaptureFixture) -> None:
    log = UnknownFieldLog(remembered=100)
    long_name = "z" * 100_000
    with caplog.at_level(logging.INFO, logger="gateway.openai.unknown_fields"):
        for batch in range(10):  # 640 distinct names, 64 per request
            log.note(chat(**{f"n{batch}-{i}": i for i in range(63)}, **{long_name + str(batch): 1}))
    assert len(log._seen) == 100
    assert all(len(name) <= MAX_LOGGED_NAME_CHARS for name in log._seen)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2  # 64 names, then 36 more with the line that says it is full
    assert "further ones are ignored" in lines[-1]
    assert max(len(line) for line in lines) < 64 * (MAX_LOGGED_NAME_CHARS + 8) + 200


@pytest.mark.parametrize(
    "fields",
    [
        {"seed": 2**64},
        {"seed": 2**63},
        {"seed": -(2**63) - 1},
        {"seed": 2**63 - 1, "n": 2},
        {"top_k": 2**64},
        {"top_k": 2**31},
        {"min_tokens": 2**64},
        {"max_tokens": 2**64},
        {"max_completion_tokens": 2**64},
    ],
    ids=[
        "seed-2^64",
        "seed-2^63",
        "seed-below-int64",
        "seed-max-plus-choice",
        "top_k-2^64",
        "top_k-2^31",
        "min_tokens",
        "max_tokens",
        "max_completion_tokens",
    ],
)
def test_integers_the_protocol_cannot_carry_are_refused(fields: dict[str, Any]) -> None:
    """Refused by the schema (a 400), never an OverflowError (a 500) at submit."""
    with pytest.raises(ValidationError):
        chat(**fields)


@settings(max_examples=50, deadline=None)
@given(
    seed=st.none() | st.integers(-(2**63), 2**63 - 1 - 128),
    n=st.integers(1, 128),
    top_k=st.integers(-1, 2**31 - 1),
    min_tokens=st.integers(0, 2**31 - 1),
)
def test_every_accepted_request_can_be_queued(
    served_model: ServedModel, seed: int | None, n: int, top_k: int, min_tokens: int
) -> None:
    """Any schema-valid sampling, with every choice's derived seed, encodes as a job."""
    try:
        request = chat(max_tokens=4, seed=seed, n=n, top_k=top_k, min_tokens=min_tokens)
        specs = translate.choices(request, [[1, 2]], served_model, logprobs=None)
    except (ValidationError, InvalidRequest):
        return  # refused at the door with a 400: fine
    for spec in specs:
        job = GenerateJob(
            request_id="r",
            index=spec.index,
            model="tiny",
            prompt_token_ids=spec.prompt_token_ids,
            sampling=spec.sampling,
            reply_to="reply",
            deadline_unix=time.time() + 60,
            created_unix=time.time(),
        )
        assert decode(encode(job)) == job


@pytest.mark.parametrize("n", [1, 128])
def test_extreme_seeds_with_max_choices_are_accepted_and_queued(
    served_model: ServedModel, n: int
) -> None:
    for seed in (-(2**63), 2**63 - 1 - 128):
        request = chat(max_tokens=4, seed=seed, n=n)
        specs = translate.choices(request, [[1, 2]], served_model, logprobs=None)
        assert [s.sampling.seed for s in specs] == [seed + i for i in range(n)]
        for spec in specs:
            encode(
                GenerateJob(
                    request_id="r",
                    index=spec.index,
                    model="tiny",
                    prompt_token_ids=spec.prompt_token_ids,
                    sampling=spec.sampling,
                    reply_to="reply",
                    deadline_unix=0.0,
                    created_unix=0.0,
                )
            )
