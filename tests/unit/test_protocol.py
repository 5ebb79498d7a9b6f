"""The internal wire protocol: every message survives both encodings; bad input is refused."""

from __future__ import annotations

import typing
from collections.abc import Callable

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from shared import protocol
from shared.errors import ProtocolError
from shared.protocol import (
    EVENTS_FIELD,
    PAYLOAD_FIELD,
    PROTOCOL_VERSION,
    VERSION,
    VERSION_FIELD,
    CancelCommand,
    ErrorEvent,
    FinishEvent,
    GenerateJob,
    Message,
    SamplingOptions,
    TokenEvent,
    TokenLogprob,
    TopLogprob,
    decode,
    decode_bytes,
    decode_events,
    encode,
    encode_bytes,
    encode_events,
)

i64 = st.integers(-(2**63), 2**63 - 1)
small = st.integers(0, 2**31 - 1)
floats = st.floats(allow_nan=False)
text = st.text(max_size=40)
token_ids = st.lists(small, max_size=20)

sampling_options = st.builds(
    SamplingOptions,
    max_tokens=small,
    temperature=floats,
    top_p=floats,
    top_k=i64,
    min_p=floats,
    presence_penalty=floats,
    frequency_penalty=floats,
    repetition_penalty=floats,
    seed=st.none() | i64,
    stop=st.lists(text, max_size=4).map(tuple),
    stop_token_ids=st.lists(small, max_size=4).map(tuple),
    ignore_eos=st.booleans(),
    min_tokens=small,
    logprobs=st.none() | st.integers(0, 20),
    prompt_logprobs=st.none() | st.integers(0, 20),
    json_schema=st.none() | text,
    json_object=st.booleans(),
    skip_special_tokens=st.booleans(),
    logit_bias=st.none() | st.dictionaries(small, st.floats(-100, 100), max_size=4),
)

generate_jobs = st.builds(
    GenerateJob,
    request_id=text,
    index=small,
    model=text,
    prompt_token_ids=token_ids,
    sampling=sampling_options,
    reply_to=text,
    deadline_unix=floats,
    created_unix=floats,
    handoff=st.none()
    | st.dictionaries(
        text,
        st.none() | st.booleans() | i64 | text | st.lists(small, max_size=3),
        max_size=4,
    ),
    adapter=st.none() | text,
    started_unix=st.none() | floats,
)

top_logprobs = st.builds(TopLogprob, token_id=small, token=text, logprob=floats)
token_logprobs = st.builds(
    TokenLogprob,
    token_id=small,
    token=text,
    logprob=floats,
    top=st.lists(top_logprobs, max_size=5),
)

token_events = st.builds(
    TokenEvent,
    request_id=text,
    index=small,
    seq=small,
    attempt=small,
    token_ids=token_ids,
    text=text,
    logprobs=st.none() | st.lists(token_logprobs, max_size=4),
)
finish_events = st.builds(
    FinishEvent,
    request_id=text,
    index=small,
    seq=small,
    attempt=small,
    finish_reason=st.sampled_from(["stop", "length", "abort"]) | text,
    prompt_tokens=small,
    completion_tokens=small,
    cached_tokens=st.none() | small,
    started_unix=st.none() | floats,
)
error_events = st.builds(
    ErrorEvent,
    request_id=text,
    index=small,
    seq=small,
    attempt=small,
    status=st.integers(100, 599),
    type=text,
    code=st.none() | text,
    message=text,
    param=st.none() | text,
)
cancel_commands = st.builds(CancelCommand, request_id=text)
worker_commands = st.builds(protocol.WorkerCommand, text, text, text, floats)
worker_command_results = st.builds(protocol.WorkerCommandResult, text, text, text, text)
embed_jobs = st.builds(
    protocol.EmbedJob,
    request_id=text,
    index=small,
    model=text,
    prompt_token_ids=token_ids,
    reply_to=text,
    deadline_unix=floats,
    created_unix=floats,
    dimensions=st.none() | small,
)
embedding_events = st.builds(
    protocol.EmbeddingEvent, text, small, small, small, st.binary(max_size=64), small
)

STRATEGIES: dict[type, st.SearchStrategy[typing.Any]] = {
    GenerateJob: generate_jobs,
    TokenEvent: token_events,
    FinishEvent: finish_events,
    ErrorEvent: error_events,
    CancelCommand: cancel_commands,
    protocol.EmbedJob: embed_jobs,
    protocol.EmbeddingEvent: embedding_events,
    protocol.WorkerCommand: worker_commands,
    protocol.WorkerCommandResult: worker_command_results,
}
messages = st.one_of(*STRATEGIES.values())


def test_every_message_type_has_a_strategy() -> None:
    """A new message type must be added to these round-trip tests."""
    assert set(typing.get_args(Message)) == set(STRATEGIES)


@settings(max_examples=100)
@given(messages)
def test_stream_fields_round_trip(message: Message) -> None:
    fields = encode(message)
    assert set(fields) == {VERSION_FIELD, PAYLOAD_FIELD}
    assert fields[VERSION_FIELD] == VERSION
    decoded = decode(fields)
    assert decoded == message
    assert type(decoded) is type(message)


@settings(max_examples=100)
@given(messages)
def test_bytes_round_trip(message: Message) -> None:
    data = encode_bytes(message)
    assert data.startswith(VERSION + b":")
    decoded = decode_bytes(data)
    assert decoded == message
    assert type(decoded) is type(message)


events = st.one_of(token_events, finish_events, error_events, embedding_events)


def lua_batch(payloads: list[bytes]) -> bytes:
    """What workers/journal/scripts.py's WRITE script sends: an array32 header + payloads."""
    return b"\xdd" + len(payloads).to_bytes(4, "big") + b"".join(payloads)


@settings(max_examples=50)
@given(st.lists(events, max_size=8))
def test_a_batch_framed_like_the_journal_script_decodes(batch: list[protocol.Event]) -> None:
    """The journal's Lua frames the step's encoded events itself; the gateway must read
    them back as the very events, in order."""
    fields = {
        VERSION_FIELD: VERSION,
        EVENTS_FIELD: lua_batch([protocol.encode_payload(event) for event in batch]),
    }
    assert decode_events(fields) == batch


def test_sampling_defaults_are_omitted_and_restored() -> None:
    job = GenerateJob(
        request_id="r",
        index=0,
        model="m",
        prompt_token_ids=[1],
        sampling=SamplingOptions(max_tokens=3),
        reply_to="s",
        deadline_unix=1.0,
        created_unix=0.0,
    )
    assert msgspec.msgpack.decode(protocol.encode_payload(job.sampling)) == {"max_tokens": 3}
    decoded = decode(encode(job))
    assert isinstance(decoded, GenerateJob)
    assert decoded.sampling == SamplingOptions(max_tokens=3)
    assert decoded.handoff is None
    assert decoded.job_id == "r/0"


def test_sampling_written_before_logit_bias_existed_still_decodes() -> None:
    """A field added with a default keeps older messages (which lack it) decodable."""
    old = msgspec.msgpack.encode({"max_tokens": 3, "temperature": 0.0, "stop": ["x"]})
    sampling = msgspec.msgpack.decode(old, type=SamplingOptions)
    assert sampling == SamplingOptions(max_tokens=3, temperature=0.0, stop=("x",))
    assert sampling.logit_bias is None
    assert b"logit_bias" not in msgspec.msgpack.encode(sampling)
    biased = SamplingOptions(max_tokens=3, logit_bias={7: -100.0, 2**31 - 1: 2.5})
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(biased), type=SamplingOptions) == biased


class FinishEventBeforeCachedTokens(
    msgspec.Struct, frozen=True, array_like=True, tag_field="kind", tag="fin"
):
    request_id: str
    index: int
    seq: int
    attempt: int
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int


def test_finish_events_and_readers_from_before_cached_tokens_still_agree() -> None:
    """cached_tokens trails with a default: arrays written before it decode (None), and a
    reader from before it ignores the extra item (no protocol version bump)."""
    old = msgspec.msgpack.encode(["fin", "r", 0, 1, 0, "stop", 3, 1])
    assert protocol.decode_bytes(protocol.VERSION + b":" + old) == FinishEvent(
        "r", 0, 1, 0, "stop", 3, 1
    )
    cached = FinishEvent("r", 0, 1, 0, "stop", 300, 1, 256)
    assert protocol.decode_bytes(protocol.encode_bytes(cached)) == cached
    legacy = msgspec.msgpack.decode(
        protocol.encode_payload(cached), type=FinishEventBeforeCachedTokens
    )
    assert (legacy.prompt_tokens, legacy.completion_tokens) == (300, 1)


def test_started_unix_trails_finish_events_and_jobs_compatibly() -> None:
    """started_unix is the last field of both: older arrays decode with None, and a
    reader from before it (cached_tokens the last it knows) ignores it."""
    started = FinishEvent("r", 0, 1, 0, "stop", 3, 1, None, 12.5)
    assert protocol.decode_bytes(protocol.encode_bytes(started)) == started
    legacy = msgspec.msgpack.decode(
        protocol.encode_payload(started), type=FinishEventBeforeCachedTokens
    )
    assert legacy.completion_tokens == 1
    old = msgspec.msgpack.encode(["fin", "r", 0, 1, 0, "stop", 3, 1, 2])
    assert protocol.decode_bytes(protocol.VERSION + b":" + old) == FinishEvent(
        "r", 0, 1, 0, "stop", 3, 1, 2
    )
    job = GenerateJob(
        request_id="r", index=0, model="m", prompt_token_ids=[1], reply_to="g",
        sampling=SamplingOptions(max_tokens=1), deadline_unix=2.0, created_unix=1.0,
    )  # fmt: skip
    stamped = protocol.started_now(job, 5.0)
    assert stamped.started_unix == 5.0
    assert protocol.started_now(stamped, 9.0).started_unix == 5.0
    assert protocol.decode_bytes(protocol.encode_bytes(stamped)) == stamped


@given(message=messages, version=st.integers(0, 10_000).filter(lambda v: v != PROTOCOL_VERSION))
def test_wrong_version_is_refused(message: Message, version: int) -> None:
    fields = encode(message)
    fields[VERSION_FIELD] = str(version).encode()
    with pytest.raises(ProtocolError, match="version"):
        decode(fields)
    payload = encode_bytes(message).partition(b":")[2]
    with pytest.raises(ProtocolError, match="version"):
        decode_bytes(b"%d:" % version + payload)


@pytest.mark.parametrize(
    "fields",
    [
        {},
        {PAYLOAD_FIELD: encode(CancelCommand("r"))[PAYLOAD_FIELD]},  # no version
        {VERSION_FIELD: VERSION},  # no payload
        {VERSION_FIELD: VERSION, PAYLOAD_FIELD: b""},
        {VERSION_FIELD: VERSION, PAYLOAD_FIELD: b"\xc1"},  # never-used msgpack byte
        {VERSION_FIELD: VERSION, PAYLOAD_FIELD: msgspec.msgpack.encode(["nope", "r"])},  # bad tag
        {VERSION_FIELD: VERSION, PAYLOAD_FIELD: msgspec.msgpack.encode(["cancel"])},  # too short
        {VERSION_FIELD: VERSION, PAYLOAD_FIELD: msgspec.msgpack.encode({"a": 1})},
        {VERSION_FIELD: VERSION, PAYLOAD_FIELD: msgspec.msgpack.encode(["tok", "r", "x"])},
        {VERSION_FIELD: b" " + VERSION, PAYLOAD_FIELD: encode(CancelCommand("r"))[PAYLOAD_FIELD]},
    ],
)
def test_malformed_fields_are_refused(fields: dict[bytes, bytes]) -> None:
    with pytest.raises(ProtocolError):
        decode(fields)


@pytest.mark.parametrize(
    "data",
    [
        b"",
        VERSION,
        VERSION + b":",
        b":",
        b"garbage",
        VERSION + b":\xc1",
        b"v" + encode_bytes(CancelCommand("r")),
    ],
)
def test_malformed_bytes_are_refused(data: bytes) -> None:
    with pytest.raises(ProtocolError):
        decode_bytes(data)


def test_non_message_struct_is_refused() -> None:
    payload = msgspec.msgpack.encode(TopLogprob(1, "a", -0.5))
    with pytest.raises(ProtocolError):
        decode({VERSION_FIELD: VERSION, PAYLOAD_FIELD: payload})


# msgpack for ["<10-byte string with an invalid UTF-8 byte>"]
INVALID_UTF8 = b"\x91\xaa" + b"\x00" * 9 + b"\x80"


@pytest.mark.parametrize("where", ["fields", "bytes"])
def test_invalid_utf8_is_a_protocol_error(where: str) -> None:
    """msgspec raises UnicodeDecodeError here; it must not escape ``except ProtocolError``."""
    with pytest.raises(ProtocolError):
        if where == "fields":
            decode({VERSION_FIELD: VERSION, PAYLOAD_FIELD: INVALID_UTF8})
        else:
            decode_bytes(VERSION + b":" + INVALID_UTF8)


@settings(max_examples=100)
@example(garbage=INVALID_UTF8)
@given(st.binary(max_size=64))
def test_garbage_payload_is_a_protocol_error_or_a_message(garbage: bytes) -> None:
    """Whatever arrives on a stream, decoding raises ProtocolError and nothing else."""
    attempts: tuple[Callable[[], Message], ...] = (
        lambda: decode({VERSION_FIELD: VERSION, PAYLOAD_FIELD: garbage}),
        lambda: decode_bytes(VERSION + b":" + garbage),
        lambda: decode_bytes(garbage),
    )
    for attempt in attempts:
        try:
            result = attempt()
        except ProtocolError:
            continue
        assert isinstance(result, typing.get_args(Message))


_SAMPLE_PAYLOAD = protocol.encode_payload(
    TokenEvent("req-é", 0, 3, 1, [7, 8], "héllo wörld", [TokenLogprob(7, "hé", -0.5, [])])
)


@settings(max_examples=200)
@given(
    position=st.integers(0, len(_SAMPLE_PAYLOAD) - 1),
    value=st.integers(0, 255),
    cut=st.integers(1, len(_SAMPLE_PAYLOAD)),
)
def test_corrupted_real_payload_is_a_protocol_error_or_a_message(
    position: int, value: int, cut: int
) -> None:
    """One flipped byte (or a truncation) of a real event: ProtocolError and nothing else.

    Unlike random bytes, this reaches the string decoder (invalid UTF-8 in ``text``).
    """
    mutated = bytearray(_SAMPLE_PAYLOAD)
    mutated[position] = value
    for payload in (bytes(mutated), bytes(mutated[:cut])):
        try:
            result = decode({VERSION_FIELD: VERSION, PAYLOAD_FIELD: payload})
        except ProtocolError:
            continue
        assert isinstance(result, typing.get_args(Message))


def test_a_batch_of_events_round_trips_in_order() -> None:
    events: list[protocol.Event] = [
        TokenEvent("r", 0, 0, 0, [5], "a"),
        TokenEvent("r", 1, 0, 0, [6], "b"),
        FinishEvent("r", 0, 1, 0, "stop", 3, 1),
    ]
    assert decode_events(encode_events(events)) == events


def test_decode_events_reads_a_single_message_entry_too() -> None:
    event = TokenEvent("r", 0, 0, 0, [5], "a")
    assert decode_events(encode(event)) == [event]


def test_a_batch_from_another_protocol_version_is_refused() -> None:
    fields = encode_events([TokenEvent("r", 0, 0, 0, [5], "a")])
    fields[VERSION_FIELD] = b"999"
    with pytest.raises(ProtocolError, match="version"):
        decode_events(fields)


def test_a_truncated_batch_is_refused() -> None:
    fields = encode_events([TokenEvent("r", 0, 0, 0, [5], "a")])
    fields[protocol.EVENTS_FIELD] = fields[protocol.EVENTS_FIELD][:-2]
    with pytest.raises(ProtocolError):
        decode_events(fields)


def test_embedding_messages_round_trip() -> None:
    job = protocol.EmbedJob(
        request_id="e",
        index=2,
        model="m",
        prompt_token_ids=[101, 102],
        reply_to="r",
        deadline_unix=1.0,
        created_unix=0.5,
        dimensions=64,
    )
    event = protocol.EmbeddingEvent("e", 2, 0, 0, b"\x00\x00\x80?", 2)
    assert decode(encode(job)) == job
    assert decode_events(encode_events([event])) == [event]
    assert job.job_id == "e/2"
