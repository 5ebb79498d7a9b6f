"""Token events that wait together leave together: joined in a worker's journal (one
event) and in a gateway stream (one SSE chunk), never waiting for more, and reading
exactly as the events would one by one (text, token ids, logprobs, usage, tool calls
and reasoning, resumed streams)."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.dispatch.plan import Deadline
from gateway.dispatch.reply_inbox import ReplyInbox
from gateway.dispatch.reply_router import StreamInterrupted
from gateway.dispatch.request_handle import RequestHandle
from gateway.openai.output_parsing import OutputParser
from gateway.openai.responses import ChatWriter, CompletionWriter, ResponseWriter
from gateway.openai.tool_parsers import hermes
from gateway.serving.delivery import stream_events
from shared.protocol import Event, FinishEvent, TokenEvent, TokenLogprob, TopLogprob
from shared.token_runs import can_join, joined

RID = "chatcmpl-runs"


def tok(seq: int, text: str, *, index: int = 0, attempt: int = 0) -> TokenEvent:
    logprob = TokenLogprob(100 + seq, text, -0.5 * seq, [TopLogprob(1, "x", -9.0)])
    return TokenEvent(RID, index, seq, attempt, [100 + seq], text, [logprob])


def fin(seq: int, completion_tokens: int, *, index: int = 0) -> FinishEvent:
    return FinishEvent(RID, index, seq, 0, "stop", 5, completion_tokens)


# ------------------------------------------------------------------ the joined event


def test_joined_reads_as_its_parts_in_a_row() -> None:
    parts = [tok(3, "a"), tok(4, "bc"), tok(5, "")]
    event = joined(parts, seq=5)
    assert (event.seq, event.text, event.token_ids) == (5, "abc", [103, 104, 105])
    assert event.logprobs == [p.logprobs[0] for p in parts if p.logprobs]
    assert joined([parts[0]], seq=3) is parts[0]
    assert joined(parts[:2], seq=3).seq == 3


def test_only_the_same_run_of_the_same_choice_joins() -> None:
    first = tok(0, "a")
    assert can_join(first, tok(1, "b"))
    assert not can_join(first, tok(1, "b", index=1))
    assert not can_join(first, tok(1, "b", attempt=1))
    assert not can_join(first, fin(1, 1))
    assert not can_join(first, StreamInterrupted("gone"))
    with_prompt = TokenEvent(RID, 0, 1, 0, [1], "b", None, [None])
    assert not can_join(first, with_prompt)


# ---------------------------------------------------------------- the gateway stream


def handle_of(events: list[Event], sequences: int = 1) -> RequestHandle:
    queue: ReplyInbox[Event | StreamInterrupted] = ReplyInbox(64)
    for event in events:
        queue.put_nowait(event)
    return RequestHandle(RID, sequences, queue, Deadline.after(30), lambda _: None)


async def sse(
    events: list[Event],
    fmt: ResponseWriter,
    *,
    join: bool,
    after: tuple[int, int] | None = None,
    usage: bool = False,
    indices: list[int] | None = None,
) -> list[tuple[str | None, Any]]:
    """The (id, data) of each chunk the stream writes for ``events`` (all queued)."""
    indices = indices or [0]
    writes = stream_events(
        handle_of(events, len(indices)),
        fmt,
        indices=indices,
        choices_per_prompt=1,
        include_usage=False,
        keepalive_s=5.0,
        prompt_tokens=dict.fromkeys(indices, 5) if usage else None,
        after=after,
        join_waiting=join,
    )
    chunks: list[tuple[str | None, Any]] = []
    async for write in writes:
        for block in text(write).split("\n\n"):
            if not block.startswith(("id:", "data:")):
                continue
            lines = dict(line.split(": ", 1) for line in block.split("\n"))
            data = lines["data"]
            chunks.append((lines.get("id"), data if data == "[DONE]" else orjson.loads(data)))
    return chunks


def text(write: str | bytes) -> str:
    return write.decode() if isinstance(write, bytes) else write


def chat(**fields: Any) -> ChatWriter:
    return ChatWriter(RID, "m", **{"with_logprobs": True, **fields})


def deltas(chunks: list[tuple[str | None, Any]]) -> list[dict[str, Any]]:
    return [data["choices"][0] for _, data in chunks if data != "[DONE]" and data["choices"]]


async def test_waiting_tokens_leave_as_one_chunk_named_by_the_last() -> None:
    events: list[Event] = [tok(0, "a"), tok(1, "b"), tok(2, "c"), fin(3, 3)]
    joined_chunks = await sse(events, chat(), join=True, usage=True)
    single = await sse(events, chat(), join=False, usage=True)
    assert [i for i, _ in joined_chunks] == [None, "2", "3", None]
    assert [i for i, _ in single] == [None, "0", "1", "2", "3", None]
    [role, run, finish] = deltas(joined_chunks)
    assert run["delta"] == {"content": "abc"}
    one_by_one = deltas(single)[1:4]
    assert run["logprobs"]["content"] == [
        entry for d in one_by_one for entry in d["logprobs"]["content"]
    ]
    assert joined_chunks[1][1]["usage"]["completion_tokens"] == 3  # continuous usage
    assert finish == deltas(single)[-1]
    assert role == deltas(single)[0]


async def test_a_stream_that_keeps_up_sends_one_chunk_per_event() -> None:
    handle = handle_of([tok(0, "a")])
    writes = stream_events(
        handle,
        chat(),
        indices=[0],
        choices_per_prompt=1,
        include_usage=False,
        keepalive_s=5.0,
        join_waiting=True,
    )
    first = text(await anext(writes))
    assert '"content":"a"' in first and first.startswith("data:")
    handle._queue.put_nowait(tok(1, "b"))  # arrives after the first was written
    assert '"content":"b"' in text(await anext(writes))


async def test_choices_join_only_with_themselves_and_in_order() -> None:
    events: list[Event] = [
        tok(0, "a"),
        tok(1, "b"),
        tok(0, "x", index=1),
        tok(2, "c"),
        fin(3, 3),
        fin(1, 1, index=1),
    ]
    chunks = await sse(events, chat(), join=True, indices=[0, 1])
    ids = [i for i, _ in chunks if i is not None]
    assert ids == ["0-1", "1-0", "0-2", "0-3", "1-1"]


async def test_completion_text_offsets_and_token_ids_of_a_joined_chunk() -> None:
    events: list[Event] = [tok(0, "ab"), tok(1, "c"), tok(2, "de"), fin(3, 3)]

    def writer() -> CompletionWriter:
        return CompletionWriter(RID, "m", with_logprobs=True, with_token_ids=True)

    [run, _] = deltas(await sse(events, writer(), join=True))
    one_by_one = deltas(await sse(events, writer(), join=False))[:3]
    assert run["text"] == "abcde"
    assert run["token_ids"] == [100, 101, 102]
    assert run["logprobs"]["text_offset"] == [0, 2, 3]
    assert run["logprobs"]["tokens"] == [t for d in one_by_one for t in d["logprobs"]["tokens"]]


async def test_tool_calls_and_reasoning_add_up_the_same_however_joined() -> None:
    pieces = ["<think>", "hm", "</think>", "<tool", '_call>{"name": "f", ', '"arguments": {"a"']
    pieces += [": 1}}", "</tool_call>"]
    events: list[Event] = [tok(i, p) for i, p in enumerate(pieces)]
    events.append(fin(len(pieces), len(pieces)))

    def writer() -> ChatWriter:
        return chat(with_logprobs=False, output=OutputParser(hermes, reasoning=True))

    def added_up(chunks: list[tuple[str | None, Any]]) -> dict[str, str]:
        total = {"reasoning": "", "content": "", "name": "", "arguments": ""}
        for choice in deltas(chunks):
            delta = choice["delta"]
            total["reasoning"] += delta.get("reasoning_content", "")
            total["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls", []):
                total["name"] += call["function"].get("name", "")
                total["arguments"] += call["function"]["arguments"]
        return total

    joined_chunks = await sse(events, writer(), join=True)
    single = await sse(events, writer(), join=False)
    assert added_up(joined_chunks) == added_up(single)
    assert added_up(single) == {
        "reasoning": "hm",
        "content": "",
        "name": "f",
        "arguments": '{"a": 1}',
    }
    assert deltas(joined_chunks)[-1]["finish_reason"] == "tool_calls"


async def test_a_resumed_stream_continues_after_any_event_of_a_joined_chunk() -> None:
    events: list[Event] = [tok(0, "a"), tok(1, "b"), tok(2, "c"), tok(3, "d"), fin(4, 4)]
    whole = "".join(
        d["delta"].get("content", "") for d in deltas(await sse(events, chat(), join=True))
    )
    for seen in range(4):
        sent_before = "".join(e.text for e in events[: seen + 1] if isinstance(e, TokenEvent))
        rest = await sse(events, chat(), join=True, after=(0, seen))
        assert rest[0][0] is not None  # the role chunk is not sent again
        text = "".join(d["delta"].get("content", "") for d in deltas(rest))
        assert sent_before + text == whole == "abcd"
        assert [i for i, _ in rest][-2] == "4"
