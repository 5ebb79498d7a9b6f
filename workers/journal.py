"""The run journal: who owns a running job, what it has emitted, and its events.

Each run of a job has a hash ``conveyor:run:{job}`` (``owner`` fence token,
``starts``, next ``seq``) and a string ``conveyor:emitted:{job}`` holding the
token ids published so far. Every write a worker makes for a job goes through
one Lua script that first checks the job is still this run's (the *fence*):

- events + emitted tokens + next seq are written together, so the journal is
  always exactly what the gateway received; a run that takes the job over
  (reclaim, hand-back) continues from there and nothing is lost or repeated;
- a run that lost the job (a zombie that was SIGSTOPped past the reclaim
  time) writes nothing and is told so, and stops.

Events produced in one pass of the event loop (one engine step) leave in one
script call, with the acks (``XACK`` + ``XDEL``) of jobs that just finished,
as one reply-stream entry per gateway holding every event of the step.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared import keys
from shared.errors import ConveyorError
from shared.job_queue import Delivery
from shared.protocol import (
    PROTOCOL_VERSION,
    ErrorEvent,
    Event,
    GenerateJob,
    encode,
    encode_payload,
)
from shared.redis_conn import as_text

log = logging.getLogger(__name__)

_BEGIN = """
local run, emitted = KEYS[1], KEYS[2]
local fence, ttl_ms = ARGV[1], tonumber(ARGV[2])
local starts = redis.call('HINCRBY', run, 'starts', 1)
redis.call('HSET', run, 'owner', fence)
redis.call('PEXPIRE', run, ttl_ms)
if redis.call('EXISTS', emitted) == 0 then
  redis.call('SET', emitted, '', 'PX', ttl_ms)
else
  redis.call('PEXPIRE', emitted, ttl_ms)
end
return {starts - 1, tonumber(redis.call('HGET', run, 'seq') or '0'), redis.call('GET', emitted)}
"""

_WRITE = """
local version, group = ARGV[1], ARGV[2]
local fenced = {}
local batches, reply_streams = {}, {}
local i = 4
for _ = 1, tonumber(ARGV[3]) do
  local run, emitted, fence, reply_to = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local seq_after, tokens = ARGV[i + 4], ARGV[i + 5]
  local ack_stream, ack_entry, done_key = ARGV[i + 6], ARGV[i + 7], ARGV[i + 8]
  local first, count = i + 10, tonumber(ARGV[i + 9])
  i = first + count
  local stored_seq = tonumber(redis.call('HGET', run, 'seq') or '0')
  local owner = redis.call('HGET', run, 'owner')
  local owned = owner == fence
  if owned and ack_stream == '' and stored_seq >= tonumber(seq_after) then
    -- a retry of a write that already landed (its reply was lost): apply it once
  elseif not owner and ack_stream ~= '' and redis.call('EXISTS', run) == 0 then
    -- a finish whose run is gone: it landed already (its reply was lost), nothing to do
  elseif owned then
    local batch = batches[reply_to]
    if batch == nil then
      batch = {}
      batches[reply_to] = batch
      table.insert(reply_streams, reply_to)
    end
    for k = first, first + count - 1 do
      table.insert(batch, ARGV[k])
    end
    if ack_stream ~= '' then
      redis.call('XACK', ack_stream, group, ack_entry)
      redis.call('XDEL', ack_stream, ack_entry)
      redis.call('DEL', run, emitted)
      redis.call('INCR', done_key)
    else
      if tokens ~= '' then redis.call('APPEND', emitted, tokens) end
      redis.call('HSET', run, 'seq', seq_after)
    end
  else
    table.insert(fenced, run)
  end
end
-- One entry per reply stream: a MessagePack array (array32 header + the events).
for _, reply_to in ipairs(reply_streams) do
  local batch = batches[reply_to]
  local n = #batch
  if n > 0 then
    local header = string.char(0xdd, math.floor(n / 16777216) % 256,
      math.floor(n / 65536) % 256, math.floor(n / 256) % 256, n % 256)
    redis.call('XADD', reply_to, '*', 'v', version, 'e', header .. table.concat(batch))
  end
end
return fenced
"""

_HAND_BACK = """
local run = KEYS[1]
local fence, stream, entry = ARGV[1], ARGV[2], ARGV[3]
local version, payload, group = ARGV[4], ARGV[5], ARGV[6]
if redis.call('HGET', run, 'owner') ~= fence then return 0 end
redis.call('XADD', stream, '*', 'v', version, 'm', payload)
redis.call('XACK', stream, group, entry)
redis.call('XDEL', stream, entry)
redis.call('HDEL', run, 'owner')
if ARGV[7] == '1' then
  redis.call('HINCRBY', run, 'starts', -1)  -- a graceful hand-back is not a failed delivery
end
return 1
"""

_FORWARD = """
local run, emitted = KEYS[1], KEYS[2]
local fence, next_stream, version, payload = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local stream, entry, group, done_key = ARGV[5], ARGV[6], ARGV[7], ARGV[8]
if redis.call('HGET', run, 'owner') ~= fence then return 0 end
if next_stream ~= '' then
  redis.call('XADD', next_stream, '*', 'v', version, 'm', payload)
end
if entry ~= '' then
  redis.call('XACK', stream, group, entry)
  redis.call('XDEL', stream, entry)
  redis.call('DEL', run, emitted)
  redis.call('INCR', done_key)
end
return 1
"""

_REFRESH = """
local consumer, group, ttl_ms = ARGV[1], ARGV[2], tonumber(ARGV[3])
local lost = {}
for i = 4, #ARGV, 5 do
  local run, emitted, fence = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local stream, entry = ARGV[i + 3], ARGV[i + 4]
  if redis.call('HGET', run, 'owner') == fence then
    redis.call('XCLAIM', stream, group, consumer, 0, entry, 'JUSTID')
    redis.call('PEXPIRE', run, ttl_ms)
    redis.call('PEXPIRE', emitted, ttl_ms)
  else
    table.insert(lost, run)
  end
end
return lost
"""

_TOKEN = struct.Struct("<i")


def pack_tokens(token_ids: list[int]) -> bytes:
    return struct.pack(f"<{len(token_ids)}i", *token_ids)


def unpack_tokens(data: bytes) -> list[int]:
    return [value for (value,) in _TOKEN.iter_unpack(data)]


@dataclass(slots=True)
class RunLease:
    """This worker's claim on one job run."""

    delivery: Delivery
    fence: str
    attempt: int
    """0 for the first run; each takeover after a failure (reclaim, engine death) adds one;
    a graceful hand-back does not."""
    next_seq: int
    emitted: list[int]
    """Tokens published by earlier runs of this job."""

    @property
    def job_id(self) -> str:
        return self.delivery.job.job_id

    @property
    def run_key(self) -> str:
        return keys.job_run(self.job_id, self.stage)

    @property
    def stage(self) -> str:
        return keys.stage_of_stream(self.delivery.stream)

    @property
    def emitted_key(self) -> str:
        return keys.job_emitted(self.job_id, self.stage)

    def take_seq(self) -> int:
        seq = self.next_seq
        self.next_seq += 1
        return seq


@dataclass(slots=True)
class _JobWrites:
    lease: RunLease
    events: list[bytes] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    finish: bool = False


class RunJournal:
    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        consumer: str,
        run_ttl_s: float = 3600.0,
        on_fenced: Callable[[str], None] = lambda job_id: None,
        retry_for_s: float = 30.0,
    ) -> None:
        self._redis = redis
        self._consumer = consumer
        self._run_ttl_ms = int(run_ttl_s * 1000)
        self._on_fenced = on_fenced
        self._retry_for_s = retry_for_s
        self._begin = redis.register_script(_BEGIN)
        self._write = redis.register_script(_WRITE)
        self._hand_back = redis.register_script(_HAND_BACK)
        self._refresh = redis.register_script(_REFRESH)
        self._forward = redis.register_script(_FORWARD)
        self._pending: dict[str, _JobWrites] = {}
        self._wakeup = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._failed: BaseException | None = None

    async def begin(self, delivery: Delivery) -> RunLease:
        (lease,) = await self.begin_all([delivery])
        return lease

    async def begin_all(self, deliveries: Sequence[Delivery]) -> list[RunLease]:
        """Lease every delivery in one round trip (on one connection, however many)."""
        fences = [f"{self._consumer}/{uuid.uuid4().hex[:8]}" for _ in deliveries]
        async with self._redis.pipeline(transaction=False) as pipe:
            for delivery, fence in zip(deliveries, fences, strict=True):
                job_id = delivery.job.job_id
                stage = keys.stage_of_stream(delivery.stream)
                await self._begin(
                    keys=[keys.job_run(job_id, stage), keys.job_emitted(job_id, stage)],
                    args=[fence, self._run_ttl_ms],
                    client=pipe,
                )
            replies = await pipe.execute()
        return [
            RunLease(delivery, fence, int(attempt), int(seq), unpack_tokens(emitted or b""))
            for delivery, fence, (attempt, seq, emitted) in zip(
                deliveries, fences, replies, strict=True
            )
        ]

    # ------------------------------------------------------------------ writes

    def publish(self, lease: RunLease, event: Event, token_ids: list[int]) -> None:
        writes = self._writes(lease)
        writes.events.append(_payload(event))
        writes.tokens.extend(token_ids)

    def fail(self, lease: RunLease, error: ConveyorError) -> None:
        """End the job with the error the client should see, and ack it."""
        job = lease.delivery.job
        event = ErrorEvent(
            job.request_id,
            job.index,
            lease.take_seq(),
            lease.attempt,
            error.status,
            error.type,
            error.code,
            error.message,
            error.param,
        )
        self.finish(lease, event)

    def finish(self, lease: RunLease, event: Event | None = None) -> None:
        """The job is done (final event, or none when the client left): ack it."""
        writes = self._writes(lease)
        if event is not None:
            writes.events.append(_payload(event))
        writes.finish = True

    def _writes(self, lease: RunLease) -> _JobWrites:
        writes = self._pending.get(lease.fence)
        if writes is None:
            writes = self._pending[lease.fence] = _JobWrites(lease)
        if self._failed is not None:
            return writes  # nothing will write it: keep flush() from waiting forever
        self._idle.clear()
        self._wakeup.set()
        return writes

    async def flush(self) -> None:
        """Wait until everything written so far is in Redis."""
        if self._failed is None:
            await self._idle.wait()
        if self._failed is not None:
            raise RedisError(f"the journal stopped: {self._failed}")

    async def run(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            batch, self._pending = self._pending, {}
            try:
                if batch:
                    await self._send(list(batch.values()))
            except BaseException as exc:
                self._failed = exc
                self._idle.set()  # nobody may wait forever on a journal that stopped
                raise
            if not self._pending:
                self._idle.set()

    async def _send(self, batch: list[_JobWrites]) -> None:
        args: list[Any] = [PROTOCOL_VERSION, keys.JOB_GROUP, len(batch)]
        for writes in batch:
            lease = writes.lease
            stream = lease.delivery.stream
            args += [
                lease.run_key,
                lease.emitted_key,
                lease.fence,
                lease.delivery.job.reply_to,
                lease.next_seq,
                pack_tokens(writes.tokens),
                stream if writes.finish else "",
                lease.delivery.entry_id if writes.finish else "",
                keys.stream_done_counter(stream),
                len(writes.events),
                *writes.events,
            ]
        fenced = await self._with_retry(lambda: self._write(args=args))
        for run_key in fenced or []:
            job_id = keys.job_of_run(as_text(run_key))
            log.warning("job %s belongs to another run now; stopping it here", job_id)
            self._on_fenced(job_id)

    async def _with_retry(self, call: Callable[[], Any]) -> Any:
        deadline = time.monotonic() + self._retry_for_s
        delay = 0.1
        while True:
            try:
                return await call()
            except RedisError as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning("journal write failed (%s); retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)

    # --------------------------------------------------------------- ownership

    async def hand_back(self, lease: RunLease, *, failed: bool = False) -> bool:
        """Requeue the job (same payload) so another worker continues it.

        A graceful hand-back (drain) does not count as a delivery; one after an engine
        death does, so a job that kills every engine it meets is dead-lettered.
        """
        delivery = lease.delivery
        done = await self._hand_back(
            keys=[lease.run_key],
            args=[
                lease.fence,
                delivery.stream,
                delivery.entry_id,
                PROTOCOL_VERSION,
                encode(delivery.job)[b"m"],
                keys.JOB_GROUP,
                "0" if failed else "1",
            ],
        )
        return bool(done)

    async def forward(
        self, lease: RunLease, next_stream: str, job: GenerateJob, *, ack: bool
    ) -> bool:
        """Queue ``job`` on the next stage's stream (and, with ``ack``, finish this one)
        in one fenced step; False if this run no longer owns the job."""
        delivery = lease.delivery
        await self.flush()
        done = await self._with_retry(
            lambda: self._forward(
                keys=[lease.run_key, lease.emitted_key],
                args=[
                    lease.fence,
                    next_stream,
                    PROTOCOL_VERSION,
                    encode(job)[b"m"],
                    delivery.stream,
                    delivery.entry_id if ack else "",
                    keys.JOB_GROUP,
                    keys.stream_done_counter(delivery.stream),
                ],
            )
        )
        return bool(done)

    async def refresh(self, leases: list[RunLease]) -> list[str]:
        """Renew the claim on every lease still ours; returns the job ids lost."""
        if not leases:
            return []
        args: list[Any] = [self._consumer, keys.JOB_GROUP, self._run_ttl_ms]
        for lease in leases:
            args += [lease.run_key, lease.emitted_key, lease.fence, lease.delivery.stream,
                     lease.delivery.entry_id]
        lost = await self._refresh(args=args)
        return [keys.job_of_run(as_text(r)) for r in lost or []]


def _payload(event: Event) -> bytes:
    return encode_payload(event)
