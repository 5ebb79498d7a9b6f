"""The run journal's Lua scripts and the rows of arguments each one takes.

Each script's ``ARGV`` is a header and then, for the batch scripts, one row per
job. Every header and row is a ``NamedTuple``: Python builds it by field name,
and the Lua text unpacks the same field names into locals (:func:`lua_locals`),
so the two sides cannot drift apart; no index arithmetic is kept in step by hand.
A write row is followed by a :class:`WriteTail` when its ``tail`` flag says so (the
fields only a finish or a touch of the sent tally needs), then by its ``event_count``
encoded events; a row without a tail reads the tail's defaults (:func:`lua_defaults`).

What the scripts do is described in :mod:`workers.journal.run_journal`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, TypeAlias

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError


def lua_locals(fields: Sequence[str], offset: str | int = 0) -> str:
    """``local a, b = ARGV[offset + 1], ARGV[offset + 2]``: one row's fields as Lua locals."""
    return f"local {lua_assign(fields, offset)}"


def lua_assign(fields: Sequence[str], offset: str | int = 0) -> str:
    """``a, b = ARGV[offset + 1], ARGV[offset + 2]``: one row's fields into declared locals."""

    def at(n: int) -> str:
        return f"ARGV[{n}]" if offset == 0 else f"ARGV[{offset} + {n}]"

    return f"{', '.join(fields)} = {', '.join(at(n + 1) for n in range(len(fields)))}"


def lua_defaults(fields: Sequence[str], defaults: Mapping[str, str | int]) -> str:
    """``local a, b = 'x', '0'``: a row's fields as Lua locals holding their defaults, as the
    strings a script's ARGV would carry."""
    return f"local {', '.join(fields)} = {', '.join(repr(str(defaults[f])) for f in fields)}"


# --------------------------------------------------------------------------- begin


class BeginArgs(NamedTuple):
    """KEYS: the run hash, the emitted-tokens string."""

    fence: str
    ttl_ms: int


BEGIN = f"""
local run, emitted = KEYS[1], KEYS[2]
{lua_locals(BeginArgs._fields)}
local starts = redis.call('HINCRBY', run, 'starts', 1)
local now = redis.call('TIME')
redis.call('HSET', run, 'owner', fence, 'began_ms', now[1] * 1000 + math.floor(now[2] / 1000))
redis.call('PEXPIRE', run, ttl_ms)
if redis.call('EXISTS', emitted) == 0 then
  redis.call('SET', emitted, '', 'PX', ttl_ms)
else
  redis.call('PEXPIRE', emitted, ttl_ms)
end
local seq, chars = unpack(redis.call('HMGET', run, 'seq', 'chars'))
return {{starts - 1, tonumber(seq or '0'), redis.call('GET', emitted), tonumber(chars or '0')}}
"""

# --------------------------------------------------------------------------- write


class WriteHeader(NamedTuple):
    version: bytes
    group: str
    job_count: int
    sent_ttl_ms: int
    """The TTL a write sets on a request's sent tally (shared/queue/open_requests.py)."""


class WriteRow(NamedTuple):
    """One job's writes of a step: a :class:`WriteTail` follows when ``tail`` is 1, then
    the row's ``event_count`` encoded events."""

    run: str
    emitted: str
    fence: str
    reply_to: str
    seq_after: int
    """The job's next seq once these events are out."""
    tokens: bytes
    """The step's token ids (int32, little-endian), appended to ``emitted``."""
    chars: int
    """Text characters the step's events carry, added to the run's ``chars`` (only runs
    that replay count them: 0 writes nothing)."""
    sent: str
    """The request's sent tally (shared/queue/open_requests.py): usage if its gateway dies."""
    sent_tokens: int
    """Added to the tally's ``c``; a write that creates ``c`` also sets the tally's TTL."""
    event_count: int
    tail: int
    """1: a :class:`WriteTail` follows; 0: the row reads the tail's defaults."""


class WriteTail(NamedTuple):
    """What only some of a job's writes need: its finish, or a touch of the request's sent
    tally. A row with a tail that adds to the tally (tokens, a finish note) sets its TTL."""

    first_token_ms: int = 0
    """Recorded as the tally's first-token time unless one is there (0 = not the run's
    first write with tokens)."""
    ack_stream: str = ""
    """The job's stream when it finished (ack it), else ''."""
    ack_entry: str = ""
    done_key: str = ""
    finish_field: str = ""
    """The tally field of the job's final event in this write ('' = none)."""
    finish_value: str = ""


WritePart: TypeAlias = tuple[WriteRow, WriteTail | None, Sequence[bytes]]
"""One job's part of a write: its row, its tail (None: the row has none) and its events."""

WRITE = f"""
{lua_locals(WriteHeader._fields)}
local fenced = {{}}
local batches, reply_streams = {{}}, {{}}
local i = {len(WriteHeader._fields)}
for _ = 1, tonumber(job_count) do
  {lua_locals(WriteRow._fields, "i")}
  i = i + {len(WriteRow._fields)}
  {lua_defaults(WriteTail._fields, WriteTail._field_defaults)}
  if tail == '1' then
    {lua_assign(WriteTail._fields, "i")}
    i = i + {len(WriteTail._fields)}
  end
  local first, count = i + 1, tonumber(event_count)
  i = i + count
  local stored = redis.call('HMGET', run, 'seq', 'owner')
  local stored_seq, owner = tonumber(stored[1] or '0'), stored[2]
  local owned = owner == fence
  if owned and ack_stream == '' and stored_seq >= tonumber(seq_after) then
    -- a retry of a write that already landed (its reply was lost): apply it once
  elseif not owner and ack_stream ~= '' and redis.call('EXISTS', run) == 0 then
    -- a finish whose run is gone: it landed already (its reply was lost), nothing to do
  elseif owned then
    local added = tonumber(sent_tokens)
    local touch = tail == '1' and (added > 0 or finish_field ~= '')
    if added > 0 then
      -- a count this write creates is a tally with no TTL yet (new, or deleted at close)
      if redis.call('HINCRBY', sent, 'c', added) == added then touch = true end
      if first_token_ms ~= '0' then redis.call('HSETNX', sent, 't', first_token_ms) end
    end
    if finish_field ~= '' then redis.call('HSET', sent, finish_field, finish_value) end
    if touch then redis.call('PEXPIRE', sent, sent_ttl_ms) end
    local batch = batches[reply_to]
    if batch == nil then
      batch = {{}}
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
      if chars ~= '0' then redis.call('HINCRBY', run, 'chars', chars) end
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

# ----------------------------------------------------------------------- hand back


class HandBackArgs(NamedTuple):
    """KEYS: the run hash."""

    fence: str
    stream: str
    entry: str
    version: bytes
    payload: bytes
    group: str
    graceful: str
    """'1': a drain, which is not a failed delivery; '0': after an engine death."""
    requeue_to: str
    """The pool's shared stream (a job read from a worker's own stream goes back there)."""


HAND_BACK = f"""
local run = KEYS[1]
{lua_locals(HandBackArgs._fields)}
if redis.call('HGET', run, 'owner') ~= fence then return 0 end
redis.call('XADD', requeue_to, '*', 'v', version, 'm', payload)
redis.call('XACK', stream, group, entry)
redis.call('XDEL', stream, entry)
redis.call('HDEL', run, 'owner')
if graceful == '1' then
  redis.call('HINCRBY', run, 'starts', -1)  -- a graceful hand-back is not a failed delivery
end
return 1
"""

# ------------------------------------------------------------------------- forward


class ForwardArgs(NamedTuple):
    """KEYS: the run hash, the emitted-tokens string."""

    fence: str
    next_stream: str
    """Where the next stage's job goes ('' = nowhere: only finish this one)."""
    version: bytes
    payload: bytes
    stream: str
    entry: str
    """This job's entry, acked with the forward ('' = keep it: the job runs on)."""
    group: str
    done_key: str


FORWARD = f"""
local run, emitted = KEYS[1], KEYS[2]
{lua_locals(ForwardArgs._fields)}
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

# ------------------------------------------------------------------------- refresh


class RefreshHeader(NamedTuple):
    consumer: str
    group: str


class RefreshRow(NamedTuple):
    run: str
    emitted: str
    fence: str
    stream: str
    entry: str
    ttl_ms: int
    """The TTL to set again on the run's keys (0: not due yet, see ``TTL_RENEW_SHARE`` in
    workers/journal/run_journal.py)."""


_HEADER, _ROW = len(RefreshHeader._fields), len(RefreshRow._fields)
CLAIM_CHUNK = 500
"""Entry ids per ``XCLAIM`` (``unpack`` has a stack limit)."""
REFRESH = f"""
{lua_locals(RefreshHeader._fields)}
local lost, claims, streams = {{}}, {{}}, {{}}
for i = {_HEADER}, #ARGV - {_ROW}, {_ROW} do
  {lua_locals(RefreshRow._fields, "i")}
  if redis.call('HGET', run, 'owner') == fence then
    local ids = claims[stream]
    if ids == nil then
      ids = {{}}
      claims[stream] = ids
      table.insert(streams, stream)
    end
    table.insert(ids, entry)
    if ttl_ms ~= '0' then
      redis.call('PEXPIRE', run, ttl_ms)
      redis.call('PEXPIRE', emitted, ttl_ms)
    end
  else
    table.insert(lost, run)
  end
end
-- one XCLAIM per stream: it resets the idle time of every entry still ours
for _, stream in ipairs(streams) do
  local ids = claims[stream]
  for first = 1, #ids, {CLAIM_CHUNK} do
    local call = {{'XCLAIM', stream, group, consumer, 0}}
    for k = first, math.min(first + {CLAIM_CHUNK - 1}, #ids) do
      table.insert(call, ids[k])
    end
    table.insert(call, 'JUSTID')
    redis.call(unpack(call))
  end
end
return lost
"""


class JournalScripts:
    """The scripts, registered on one client; each call takes its header and rows."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis
        self._begin = redis.register_script(BEGIN)
        self._write = redis.register_script(WRITE)
        self._hand_back = redis.register_script(HAND_BACK)
        self._forward = redis.register_script(FORWARD)
        self._refresh = redis.register_script(REFRESH)

    async def begin(self, leases: Sequence[tuple[str, str, BeginArgs]]) -> list[Any]:
        """Lease ``(run, emitted, args)`` each, in one round trip; a reply per lease:
        attempt, next seq, emitted tokens, chars.

        The calls go on a pipeline as plain ``EVALSHA``: a script registered on a
        redis-py pipeline costs one more round trip (``SCRIPT EXISTS``) on every
        execute, here on the way to every job's first token. A Redis that lost the
        script (a restart) answers ``NOSCRIPT`` to every call alike, so none ran: load
        it and send them again."""
        try:
            return await self._begin_calls(leases)
        except NoScriptError:
            await self._redis.script_load(BEGIN)
            return await self._begin_calls(leases)

    async def _begin_calls(self, leases: Sequence[tuple[str, str, BeginArgs]]) -> list[Any]:
        async with self._redis.pipeline(transaction=False) as pipe:
            for run, emitted, args in leases:
                pipe.evalsha(self._begin.sha, 2, run, emitted, *args)
            return await pipe.execute()

    async def write(self, header: WriteHeader, rows: Sequence[WritePart]) -> list[Any]:
        """Returns the run keys of the rows that were fenced out (written nothing)."""
        args: list[Any] = list(header)
        for row, tail, events in rows:
            args += row
            if tail is not None:
                args += tail
            args += events
        fenced: list[Any] = await self._write(args=args)
        return fenced or []

    async def hand_back(self, run: str, args: HandBackArgs) -> bool:
        return bool(await self._hand_back(keys=[run], args=list(args)))

    async def forward(self, run: str, emitted: str, args: ForwardArgs) -> bool:
        return bool(await self._forward(keys=[run, emitted], args=list(args)))

    async def refresh(self, header: RefreshHeader, rows: Sequence[RefreshRow]) -> list[Any]:
        """Returns the run keys no longer owned (not renewed)."""
        args: list[Any] = list(header)
        for row in rows:
            args += list(row)
        lost: list[Any] = await self._refresh(args=args)
        return lost or []
