"""Usage for requests whose gateway died: what a gateway opened, and what workers sent.

1. The admission script that queues a request also stores its :class:`OpenRequest`
   (key, model, prompt tokens, choices, received time) in its gateway's
   ``open-requests`` hash: no extra round trip.
2. The run journal adds every token and final event it publishes for the request to
   the request's ``sent`` tally (:func:`finish_note`, in the journal's write script).
3. When the request ends, its gateway queues the usage row from what its client was
   sent and drops both entries, in one script call (:meth:`OpenRequests.close`).
4. If the gateway dies first, a live gateway's sweep (``gateway/control/orphan_usage.py``)
   builds the row from the tally (what the workers sent: the most the client can
   have received) and :meth:`OpenRequests.close_orphan` queues it only if the open
   entry was still there, removing it in the same script: one row however many
   gateways sweep; the ledger consumer also skips a request id it already holds.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, Final

import msgspec
import redis.asyncio as aioredis

from shared.connections.connect import as_text
from shared.errors import ProtocolError
from shared.protocol import (
    PAYLOAD_FIELD,
    VERSION_FIELD,
    EmbeddingEvent,
    ErrorEvent,
    Event,
    FinishEvent,
)
from shared.queue import names
from shared.queue.key_limits import Reservation
from shared.queue.usage import UsageRecord, UsageStatus, encode_usage

OPEN_VERSION: Final = b"1"
OPEN_TTL_S: Final = 86_400
"""A gateway's open-requests hash outlives any request; a sweep empties a dead one's."""
SENT_COMPLETION: Final = b"c"
SENT_FIRST_TOKEN_MS: Final = b"t"
SENT_FINISH_PREFIX: Final = "f:"
STATUS_FINISHED_TTL_S: Final = 600
"""How long a finished request's status record (shared/queue/request_status.py) stays."""


class OpenRequest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The part of a usage record known at admission (a map: new fields take a default)."""

    key_id: str | None
    model: str
    prompt_tokens: Annotated[int, msgspec.Meta(ge=0)]
    """Every prompt once, however many choices share it (as the gateway counts usage)."""
    n: Annotated[int, msgspec.Meta(ge=1)]
    """Sequences (choices, or embedding inputs): all of them must finish to complete."""
    received_unix: float
    reservation: Reservation | None = None
    """The key's limit reservation, settled by whoever closes the request."""


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(OpenRequest)


def encode_open(opened: OpenRequest) -> bytes:
    return OPEN_VERSION + b":" + _encoder.encode(opened)


def decode_open(value: bytes) -> OpenRequest:
    version, _, payload = value.partition(b":")
    if version != OPEN_VERSION:
        raise ProtocolError(f"unsupported open-request version {version!r}")
    try:
        return _decoder.decode(payload)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise ProtocolError(str(exc)) from exc


def finish_note(event: Event) -> tuple[str, str] | None:
    """The sent-tally field and value a job's final event leaves (None: not final):
    ``f:{index}`` -> ``reason|cached tokens|attempt``."""
    if isinstance(event, FinishEvent):
        reason, cached = event.finish_reason, event.cached_tokens
    elif isinstance(event, ErrorEvent):
        reason, cached = "error", None
    elif isinstance(event, EmbeddingEvent):
        reason, cached = "embedding", None
    else:
        return None
    value = f"{reason}|{'' if cached is None else cached}|{event.attempt}"
    return f"{SENT_FINISH_PREFIX}{event.index}", value


@dataclass(frozen=True, slots=True)
class Finish:
    reason: str
    cached_tokens: int | None
    attempt: int


@dataclass(frozen=True, slots=True)
class SentTally:
    """What workers published for one request, all its sequences together."""

    completion_tokens: int = 0
    first_token_unix: float | None = None
    finishes: dict[int, Finish] = field(default_factory=dict)

    @classmethod
    def from_hash(cls, fields: Mapping[bytes, bytes]) -> SentTally:
        finishes: dict[int, Finish] = {}
        for name, value in fields.items():
            text = name.decode()
            if text.startswith(SENT_FINISH_PREFIX):
                reason, cached, attempt = value.decode().split("|")
                index = int(text.removeprefix(SENT_FINISH_PREFIX))
                finishes[index] = Finish(reason, int(cached) if cached else None, int(attempt))
        first_ms = fields.get(SENT_FIRST_TOKEN_MS)
        return cls(
            completion_tokens=int(fields.get(SENT_COMPLETION, b"0")),
            first_token_unix=int(first_ms) / 1000 if first_ms else None,
            finishes=finishes,
        )


def orphan_record(request_id: str, opened: OpenRequest, sent: SentTally) -> UsageRecord:
    """The usage row of a request whose gateway died, from what its workers sent.

    Completed only if every sequence finished without an error; otherwise failed (the
    gateway's death ended it). Cached tokens: the most any sequence reported (choices
    of one prompt share its cache hits)."""
    reasons = [finish.reason for _, finish in sorted(sent.finishes.items())]
    status: UsageStatus = "failed"
    if len(reasons) >= opened.n and "error" not in reasons:
        status = "completed"
    cached = [f.cached_tokens for f in sent.finishes.values() if f.cached_tokens is not None]
    return UsageRecord(
        request_id=request_id,
        key_id=opened.key_id,
        model=opened.model,
        prompt_tokens=opened.prompt_tokens,
        completion_tokens=sent.completion_tokens,
        cached_prompt_tokens=min(max(cached), opened.prompt_tokens) if cached else None,
        status=status,
        received_unix=opened.received_unix,
        finished_unix=time.time(),
        first_token_unix=sent.first_token_unix,
        finish_reason=",".join(reasons)[:64] if reasons else None,
        n=opened.n,
        migrations=max((f.attempt for f in sent.finishes.values()), default=0),
    )


_CLOSE = """
-- KEYS: the usage stream, the gateway's open-requests hash, then per request its sent
-- tally and its status record.
-- ARGV: the status record's TTL (s), the usage entry's two field names, then per request
-- its id, its usage entry's two values and its finish note.
local ttl, version_field, payload_field = ARGV[1], ARGV[2], ARGV[3]
local count = (#KEYS - 2) / 2
for i = 1, count do
  local at = 3 + (i - 1) * 4
  local request_id, version, payload, note = ARGV[at + 1], ARGV[at + 2], ARGV[at + 3], ARGV[at + 4]
  local sent, status = KEYS[1 + 2 * i], KEYS[2 + 2 * i]
  redis.call('XADD', KEYS[1], '*', version_field, version, payload_field, payload)
  redis.call('HDEL', KEYS[2], request_id)
  redis.call('DEL', sent)
  redis.call('HSET', status, 'f', note)
  redis.call('EXPIRE', status, ttl)
end
return count
"""

_CLOSE_ORPHAN = """
-- KEYS: the open-requests hash, the sent tally, the usage stream.
-- ARGV: request id, then the usage entry's fields (name, value, ...).
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('XADD', KEYS[3], '*', unpack(ARGV, 2))
redis.call('DEL', KEYS[2])
return 1
"""


def finish_note_of(record: UsageRecord) -> str:
    """A finished request's outcome in its status record: ``status|reason|finished|first
    token|migrations``."""
    first = "" if record.first_token_unix is None else f"{record.first_token_unix:.3f}"
    parts = [record.status, record.finish_reason or "", f"{record.finished_unix:.3f}"]
    return "|".join([*parts, first, str(record.migrations)])


class OpenRequests:
    """Closing open requests: normally (their gateway) or as orphans (a sweep)."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis
        self._close = redis.register_script(_CLOSE)
        self._close_orphan = redis.register_script(_CLOSE_ORPHAN)

    async def close(self, gateway_id: str, record: UsageRecord) -> None:
        """Queue ``record`` for the ledger and forget the request, in one script call."""
        await self.close_many(gateway_id, [record])

    async def close_many(self, gateway_id: str, records: Sequence[UsageRecord]) -> None:
        """:meth:`close` for many requests of one gateway, in one script call (a MULTI of
        the same commands cost the gateway's client about twice the CPU: it sends and
        parses every command and its QUEUED reply)."""
        keys = [names.USAGE_STREAM, names.open_requests(gateway_id)]
        args: list[bytes | str | int] = [STATUS_FINISHED_TTL_S, VERSION_FIELD, PAYLOAD_FIELD]
        for record in records:
            keys += [names.sent_tally(record.request_id), names.request_status(record.request_id)]
            entry = encode_usage(record)
            args += [
                record.request_id,
                entry[VERSION_FIELD],
                entry[PAYLOAD_FIELD],
                finish_note_of(record),
            ]
        await self._close(keys=keys, args=args)

    async def close_orphan(self, gateway_id: str, record: UsageRecord) -> bool:
        """Queue ``record`` unless the request was closed already; True if this call did."""
        fields = [part for pair in encode_usage(record).items() for part in pair]
        closed = await self._close_orphan(
            keys=[
                names.open_requests(gateway_id),
                names.sent_tally(record.request_id),
                names.USAGE_STREAM,
            ],
            args=[record.request_id, *fields],
        )
        return bool(closed)

    async def opened(self, gateway_id: str) -> dict[str, bytes]:
        """The requests ``gateway_id`` left open: request id -> encoded OpenRequest."""
        entries: Any = await self._redis.hgetall(names.open_requests(gateway_id))
        return {as_text(name): value for name, value in entries.items()}

    async def sent(self, request_id: str) -> SentTally:
        fields: Any = await self._redis.hgetall(names.sent_tally(request_id))
        return SentTally.from_hash(fields)
