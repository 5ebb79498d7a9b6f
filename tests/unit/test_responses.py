"""Response and chunk shapes, checked against OpenAI's chat and text completion objects."""

from __future__ import annotations

import json
from typing import Any

import pytest

from gateway.openai.logprob_rows import Echo
from gateway.openai.responses import ChatWriter, ChoiceState, CompletionWriter, Usage
from shared.protocol import FinishEvent, PromptLogprob, TokenEvent, TokenLogprob, TopLogprob

ENVELOPE_KEYS = {"id", "object", "created", "model", "choices"}


def lp(token: str, logprob: float, *top: tuple[str, float]) -> TokenLogprob:
    return TokenLogprob(
        token_id=len(token),
        token=token,
        logprob=logprob,
        top=[TopLogprob(i, t, p) for i, (t, p) in enumerate(top)],
    )


def tok(text: str, index: int = 0, seq: int = 0, logprobs: list[TokenLogprob] | None = None) -> Any:
    return TokenEvent("r", index, seq, 0, [len(text)], text, logprobs)


def fin(index: int, prompt: int, completion: int) -> FinishEvent:
    return FinishEvent("r", index, 9, 0, "stop", prompt, completion)


def assert_json_serializable(body: Any) -> None:
    assert json.loads(json.dumps(body)) == body


# --------------------------------------------------------------------------- chat


def test_chat_stream_chunks() -> None:
    fmt = ChatWriter("chatcmpl-1", "tiny", with_logprobs=False)
    start = fmt.start_chunk(0)
    assert set(start) == ENVELOPE_KEYS
    assert start["object"] == "chat.completion.chunk"
    assert start["id"] == "chatcmpl-1"
    assert start["model"] == "tiny"
    assert isinstance(start["created"], int)
    assert start["choices"] == [
        {
            "index": 0,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
    ]

    delta = fmt.delta_chunk(tok("Hel", index=2))
    assert delta["choices"] == [
        {"index": 2, "delta": {"content": "Hel"}, "logprobs": None, "finish_reason": None}
    ]
    assert "role" not in delta["choices"][0]["delta"]

    finish = fmt.finish_chunk(2, "length")
    assert finish["choices"] == [
        {"index": 2, "delta": {}, "logprobs": None, "finish_reason": "length"}
    ]
    for body in (start, delta, finish):
        assert body["id"] == "chatcmpl-1"
        assert body["created"] == start["created"]
        assert_json_serializable(body)


def test_chat_usage_chunk_has_empty_choices() -> None:
    fmt = ChatWriter("chatcmpl-1", "tiny", with_logprobs=False)
    usage = Usage(1)
    usage.add(fin(0, prompt=5, completion=3))
    body = fmt.usage_chunk(usage)
    assert body["object"] == "chat.completion.chunk"
    assert body["choices"] == []
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def test_chat_final_response() -> None:
    fmt = ChatWriter("chatcmpl-1", "tiny", with_logprobs=False)
    first = ChoiceState(0, text=["Hel", "lo"], finish_reason="stop")
    second = ChoiceState(1, text=[], finish_reason="length")
    usage = Usage(2)
    usage.add(fin(0, 4, 2))
    usage.add(fin(1, 4, 0))
    body = fmt.response([first, second], usage)
    assert set(body) == ENVELOPE_KEYS | {"usage"}
    assert body["object"] == "chat.completion"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello"},
            "logprobs": None,
            "finish_reason": "stop",
        },
        {
            "index": 1,
            "message": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": "length",
        },
    ]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    assert_json_serializable(body)


def test_chat_logprobs_format() -> None:
    fmt = ChatWriter("c", "tiny", with_logprobs=True)
    tokens = [lp("Hé", -0.1, ("Hé", -0.1), ("Ha", -2.5)), lp("!", -0.7)]
    delta = fmt.delta_chunk(tok("Hé!", logprobs=tokens))
    logprobs = delta["choices"][0]["logprobs"]
    assert logprobs == {
        "content": [
            {
                "token": "Hé",
                "logprob": -0.1,
                "bytes": [72, 195, 169],
                "top_logprobs": [
                    {"token": "Hé", "logprob": -0.1, "bytes": [72, 195, 169]},
                    {"token": "Ha", "logprob": -2.5, "bytes": [72, 97]},
                ],
            },
            {"token": "!", "logprob": -0.7, "bytes": [33], "top_logprobs": []},
        ],
        "refusal": None,
    }
    final = fmt.response([ChoiceState(0, ["Hé!"], tokens, finish_reason="stop")], Usage(1))
    assert final["choices"][0]["logprobs"] == logprobs
    # Asked for logprobs but an event carried none: an empty content list, not null.
    assert fmt.delta_chunk(tok("x"))["choices"][0]["logprobs"] == {
        "content": [],
        "refusal": None,
    }


def test_chat_without_logprobs_ignores_event_logprobs() -> None:
    fmt = ChatWriter("c", "tiny", with_logprobs=False)
    delta = fmt.delta_chunk(tok("x", logprobs=[lp("x", -1.0)]))
    assert delta["choices"][0]["logprobs"] is None


# ----------------------------------------------------------------------- completion


def test_completion_stream_chunks() -> None:
    fmt = CompletionWriter("cmpl-1", "tiny", with_logprobs=False)
    assert fmt.start_chunk(0) is None  # text completions have no role chunk
    delta = fmt.delta_chunk(tok("abc", index=1))
    assert set(delta) == ENVELOPE_KEYS
    assert delta["object"] == "text_completion"
    assert delta["choices"] == [
        {"index": 1, "text": "abc", "logprobs": None, "finish_reason": None}
    ]
    finish = fmt.finish_chunk(1, "stop")
    assert finish["choices"] == [
        {"index": 1, "text": "", "logprobs": None, "finish_reason": "stop"}
    ]
    usage_chunk = fmt.usage_chunk(Usage(1))
    assert usage_chunk["choices"] == []
    assert usage_chunk["object"] == "text_completion"
    assert usage_chunk["usage"] == {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}


def test_completion_final_response_and_logprobs() -> None:
    fmt = CompletionWriter("cmpl-1", "tiny", with_logprobs=True)
    tokens = [lp("Hi", -0.2, ("Hi", -0.2), ("Ho", -1.9)), lp(" there", -0.4, (" there", -0.4))]
    choice = ChoiceState(0, ["Hi", " there"], tokens, finish_reason="length")
    body = fmt.response([choice], Usage(1))
    assert body["object"] == "text_completion"
    [out] = body["choices"]
    assert set(out) == {"index", "text", "logprobs", "finish_reason"}
    assert out["text"] == "Hi there"
    assert out["finish_reason"] == "length"
    assert out["logprobs"] == {
        "tokens": ["Hi", " there"],
        "token_logprobs": [-0.2, -0.4],
        "top_logprobs": [{"Hi": -0.2, "Ho": -1.9}, {" there": -0.4}],
        "text_offset": [0, 2],
    }
    assert_json_serializable(body)


def test_completion_logprobs_off() -> None:
    fmt = CompletionWriter("cmpl-1", "tiny", with_logprobs=False)
    body = fmt.response([ChoiceState(0, ["x"], [lp("x", -1.0)], finish_reason="stop")], Usage(1))
    assert body["choices"][0]["logprobs"] is None


# ------------------------------------------------------------------------------ usage


def test_usage_counts_each_prompt_once() -> None:
    """n=3 choices over 2 prompts: prompt tokens are the two prompts' lengths, once each."""
    usage = Usage(choices_per_prompt=3)
    prompt_lengths = {0: 10, 1: 7}
    for index in range(6):
        usage.add(fin(index, prompt=prompt_lengths[index // 3], completion=index + 1))
    assert usage.as_json() == {
        "prompt_tokens": 17,
        "completion_tokens": 21,
        "total_tokens": 38,
    }


def test_usage_of_a_partly_finished_request() -> None:
    usage = Usage(choices_per_prompt=2)
    usage.add(fin(1, prompt=5, completion=4))
    assert usage.as_json() == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}


@pytest.mark.parametrize("fmt_class", [ChatWriter, CompletionWriter])
def test_token_ids_extension(fmt_class: Any) -> None:
    fmt = fmt_class("x", "tiny", with_logprobs=False, with_token_ids=True)
    event = TokenEvent("r", 0, 0, 0, [5, 6], "ab")
    assert fmt.delta(event)["choices"][0]["token_ids"] == [5, 6]
    body = fmt.response([ChoiceState(0, ["ab"], token_ids=[5, 6], finish_reason="stop")], Usage(1))
    assert body["choices"][0]["token_ids"] == [5, 6]
    plain = fmt_class("x", "tiny", with_logprobs=False)
    assert "token_ids" not in plain.delta(event)["choices"][0]


def test_streamed_text_offset_is_cumulative() -> None:
    """Streamed text_offset counts from the start of the choice, like the final response."""
    fmt = CompletionWriter("cmpl-1", "tiny", with_logprobs=True)
    first = fmt.delta_chunk(tok("Hi", seq=0, logprobs=[lp("Hi", -0.2)]))
    second = fmt.delta_chunk(tok(" there", seq=1, logprobs=[lp(" there", -0.4)]))
    offsets = [
        first["choices"][0]["logprobs"]["text_offset"],
        second["choices"][0]["logprobs"]["text_offset"],
    ]
    final = fmt.response(
        [ChoiceState(0, ["Hi", " there"], [lp("Hi", -0.2), lp(" there", -0.4)])], Usage(1)
    )
    assert [o for chunk in offsets for o in chunk] == final["choices"][0]["logprobs"]["text_offset"]


def test_streamed_text_offset_is_per_choice_and_spans_multi_token_chunks() -> None:
    fmt = CompletionWriter("cmpl-1", "tiny", with_logprobs=True)

    def offsets(event: TokenEvent) -> list[int]:
        return fmt.delta_chunk(event)["choices"][0]["logprobs"]["text_offset"]  # type: ignore[no-any-return]

    assert offsets(tok("ab", index=0, logprobs=[lp("a", -1), lp("b", -1)])) == [0, 1]
    assert offsets(tok("xyz", index=1, logprobs=[lp("xyz", -1)])) == [0]
    assert offsets(tok("cde", index=0, seq=1, logprobs=[lp("cd", -1), lp("e", -1)])) == [2, 4]
    assert offsets(tok("!", index=1, seq=1, logprobs=[lp("!", -1)])) == [3]
    # A chunk without logprobs still advances the offset of its choice.
    fmt.delta_chunk(tok("fg", index=0, seq=2, logprobs=[]))
    assert offsets(tok("h", index=0, seq=3, logprobs=[lp("h", -1)])) == [7]
    # A new format (a new request) starts from 0 again.
    fresh = CompletionWriter("cmpl-2", "tiny", with_logprobs=True)
    chunk = fresh.delta_chunk(tok("q", logprobs=[lp("q", -1)]))
    assert chunk["choices"][0]["logprobs"]["text_offset"] == [0]


SCORED = [
    None,
    [
        PromptLogprob(7, " b", -2.0, 3),
        PromptLogprob(8, " z", -0.5, 1),
        PromptLogprob(9, "y", -1, 2),
    ],
    [PromptLogprob(6, "c", -0.25, 1)],
]


def test_echo_with_max_tokens_0_is_the_scored_prompt_alone() -> None:
    """lm-evaluation-harness's log-likelihood request: echo, logprobs, max_tokens 0."""
    echo = {0: Echo("a b c", "a", 5, only=True)}
    fmt = CompletionWriter("cmpl-1", "tiny", with_logprobs=True, top_logprobs=1, echo=echo)
    choice = ChoiceState(0, ["!"], [lp("!", -0.3)], finish_reason="length", prompt_logprobs=SCORED)
    [out] = fmt.response([choice], Usage(1))["choices"]
    assert out["text"] == "a b c"
    assert out["logprobs"] == {
        "tokens": ["a", " b", "c"],
        "token_logprobs": [None, -2.0, -0.25],
        "top_logprobs": [None, {" b": -2.0, " z": -0.5}, {"c": -0.25}],
        "text_offset": [0, 1, 3],
    }
    assert out["prompt_logprobs"][0] is None
    assert out["prompt_logprobs"][1]["8"] == {"logprob": -0.5, "rank": 1, "decoded_token": " z"}


def test_echo_puts_the_prompt_before_the_generated_text() -> None:
    echo = {0: Echo("a b c", "a", 5)}
    fmt = CompletionWriter("cmpl-1", "tiny", with_logprobs=True, top_logprobs=0, echo=echo)
    choice = ChoiceState(
        0, ["!"], [lp("!", -0.3, ("?", -0.1))], finish_reason="length", prompt_logprobs=SCORED
    )
    [out] = fmt.response([choice], Usage(1))["choices"]
    assert out["text"] == "a b c!"
    assert out["logprobs"]["tokens"] == ["a", " b", "c", "!"]
    assert out["logprobs"]["top_logprobs"][1:] == [{" b": -2.0}, {"c": -0.25}, {"!": -0.3}]


def stopped(tokens: list[TokenLogprob]) -> ChoiceState:
    return ChoiceState(0, ["Hi"], tokens, finish_reason="stop")


def test_logprobs_0_is_the_sampled_token_alone_and_k_adds_alternatives() -> None:
    """vLLM's shape: the sampled token first, then up to k alternatives."""
    tokens = [lp("Hi", -0.7, ("Ho", -0.2), ("Ha", -0.9))]
    for k, top in [(0, {"Hi": -0.7}), (1, {"Hi": -0.7, "Ho": -0.2})]:
        fmt = CompletionWriter("cmpl-1", "tiny", with_logprobs=True, top_logprobs=k)
        [out] = fmt.response([stopped(tokens)], Usage(1))["choices"]
        assert out["logprobs"]["top_logprobs"] == [top]


def test_tokens_as_token_ids() -> None:
    tokens = [lp("Hi", -0.7, ("Ho", -0.2))]
    fmt = CompletionWriter("c", "tiny", with_logprobs=True, top_logprobs=1, tokens_as_ids=True)
    [out] = fmt.response([stopped(tokens)], Usage(1))["choices"]
    assert out["logprobs"]["tokens"] == ["token_id:2"]
    assert out["logprobs"]["top_logprobs"] == [{"token_id:2": -0.7, "token_id:0": -0.2}]
    chat = ChatWriter("c", "tiny", with_logprobs=True, tokens_as_ids=True)
    [out] = chat.response([stopped(tokens)], Usage(1))["choices"]
    [entry] = out["logprobs"]["content"]
    assert entry["token"] == "token_id:2"
    assert entry["bytes"] == list(b"token_id:2")
    assert entry["top_logprobs"][0]["token"] == "token_id:0"


def test_chat_prompt_logprobs_are_on_the_response() -> None:
    fmt = ChatWriter("c", "tiny", with_logprobs=False)
    body = fmt.response(
        [ChoiceState(0, ["Hi"], [], finish_reason="stop", prompt_logprobs=SCORED)], Usage(1)
    )
    assert body["prompt_logprobs"][2] == {"6": {"logprob": -0.25, "rank": 1, "decoded_token": "c"}}
    assert "prompt_logprobs" not in body["choices"][0]


def test_chat_echo_starts_the_content_and_the_stream() -> None:
    """vLLM's chat ``echo``: the last message's text before each choice's content."""
    fmt = ChatWriter("c", "tiny", with_logprobs=False, echo="Once upon")
    body = fmt.response([ChoiceState(0, [" a time"], finish_reason="stop")], Usage(1))
    assert body["choices"][0]["message"]["content"] == "Once upon a time"
    assert fmt.start_chunk(0)["choices"][0]["delta"]["content"] == "Once upon"
