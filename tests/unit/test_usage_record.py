"""The usage record on its way to the ledger: round trips and refusals."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.errors import ProtocolError
from shared.queue.usage import UsageRecord, decode_usage, encode_usage

counts = st.integers(min_value=0, max_value=2**31 - 1)
times = st.floats(min_value=0, max_value=4e9, allow_nan=False)

records = st.builds(
    UsageRecord,
    request_id=st.text(min_size=1, max_size=64),
    key_id=st.none() | st.text(max_size=32),
    model=st.text(min_size=1, max_size=200),
    prompt_tokens=counts,
    completion_tokens=counts,
    status=st.sampled_from(["completed", "cancelled", "failed"]),
    received_unix=times,
    finished_unix=times,
    first_token_unix=st.none() | times,
    cached_prompt_tokens=st.none() | counts,
    finish_reason=st.none() | st.text(max_size=64),
    n=st.integers(min_value=1, max_value=128),
    migrations=st.integers(min_value=0, max_value=10),
)


@given(records)
def test_round_trip(record: UsageRecord) -> None:
    assert decode_usage(encode_usage(record)) == record


def _record(**fields: object) -> UsageRecord:
    base: dict[str, object] = {
        "request_id": "r",
        "key_id": None,
        "model": "m",
        "prompt_tokens": 1,
        "completion_tokens": 2,
        "status": "completed",
        "received_unix": 1.0,
        "finished_unix": 2.0,
    }
    return UsageRecord(**{**base, **fields})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "fields",
    [
        {"status": "paused"},
        {"prompt_tokens": -1},
        {"model": "m" * 201},
        {"request_id": ""},
        {"n": 0},
    ],
)
def test_what_the_ledger_cannot_hold_does_not_decode(fields: dict[str, object]) -> None:
    with pytest.raises(ProtocolError):
        decode_usage(encode_usage(_record(**fields)))  # encoding does not validate


def test_wrong_version_or_garbage() -> None:
    good = encode_usage(_record())
    with pytest.raises(ProtocolError, match="version"):
        decode_usage({**good, b"v": b"2"})
    with pytest.raises(ProtocolError):
        decode_usage({b"v": b"1", b"m": b"\xc1"})


def test_defaults_are_omitted_so_new_fields_can_follow() -> None:
    assert b"migrations" not in encode_usage(_record())[b"m"]
