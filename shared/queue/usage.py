"""The usage record: what one request cost, on its way to the SQL ledger.

Whoever finishes a request (the gateway; a worker's journal when the gateway died)
calls :func:`record_usage`, which appends one entry to the ``conveyor:usage``
stream; the gateways' ledger consumer (``gateway/control/ledger.py``) writes it to SQL,
keyed by ``request_id``, so a record sent twice is counted once.

Encoded like ``shared/protocol.py``'s messages (MessagePack, a version field,
never pickled), as a map with defaults omitted: a new field takes a default and
goes at the end, so entries written before it still decode without a version bump.
Field limits match the ledger's columns, so an entry the table cannot hold fails to
decode (and goes to the dead-letter stream) instead of failing its whole batch.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

import msgspec
import redis.asyncio as aioredis

from shared.errors import ProtocolError
from shared.protocol import PAYLOAD_FIELD, VERSION_FIELD
from shared.queue import names

USAGE_VERSION: Final = 1

UsageStatus = Literal["completed", "cancelled", "failed"]
"""completed: the model finished (any finish reason); cancelled: the client went away
(it pays for what it was sent); failed: an error ended it."""

_Count = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
_Unix = Annotated[float, msgspec.Meta(ge=0)]


class UsageRecord(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    request_id: Annotated[str, msgspec.Meta(min_length=1, max_length=64)]
    key_id: Annotated[str, msgspec.Meta(max_length=32)] | None
    """The API key's id; None when auth is off."""
    model: Annotated[str, msgspec.Meta(min_length=1, max_length=200)]
    prompt_tokens: _Count
    completion_tokens: _Count
    """Tokens delivered to the client, all choices together."""
    status: UsageStatus
    received_unix: _Unix
    finished_unix: _Unix
    first_token_unix: _Unix | None = None
    cached_prompt_tokens: _Count | None = None
    """Prompt tokens served from the prefix cache, where the engine reports them."""
    finish_reason: Annotated[str, msgspec.Meta(max_length=64)] | None = None
    """The choices' finish reasons, comma-separated in choice order."""
    n: Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)] = 1
    migrations: _Count = 0
    """Times the request moved to another worker mid-stream."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(UsageRecord)


def encode_usage(record: UsageRecord) -> dict[bytes, bytes]:
    """The stream entry's fields (for a caller that adds it inside its own MULTI or Lua)."""
    return {VERSION_FIELD: b"%d" % USAGE_VERSION, PAYLOAD_FIELD: _encoder.encode(record)}


def decode_usage(fields: dict[bytes, bytes]) -> UsageRecord:
    version = fields.get(VERSION_FIELD)
    if version != b"%d" % USAGE_VERSION:
        raise ProtocolError(f"unsupported usage record version {version!r}")
    try:
        return _decoder.decode(fields.get(PAYLOAD_FIELD, b""))
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(str(exc)) from exc


async def record_usage(redis: aioredis.Redis, record: UsageRecord) -> None:
    """Queue ``record`` for the ledger (one XADD; the stream is never trimmed: the consumer
    deletes entries once they are committed). Raises RedisError: the caller retries, and a
    retry cannot count twice."""
    await redis.xadd(names.USAGE_STREAM, encode_usage(record))  # type: ignore[arg-type]
