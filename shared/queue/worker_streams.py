"""Workers' own job streams: placed jobs, steal tickets, stealing and requeueing.

A placed job waits on its worker's own stream (``names.worker_job_stream``), which that
worker reads before its pool's shared stream. Admission adds a steal ticket per placed
request to the pool's ticket stream; the workers with free slots read tickets through the
job group, so each ticket wakes one of them. That worker waits until the ticket is
``steal_ms`` old and then, in one script, reads the victim's entries that are still
unread and older than that as its own consumer (:meth:`WorkerStreams.steal`): a
consumer-group read, so no entry is ever delivered twice, and a stolen entry is pending
on the victim's stream under the thief's name (journal, fencing and reclaim as usual).

:meth:`WorkerStreams.requeue` moves a worker's unread entries back to the shared stream
(copy and delete in one script: never lost, never twice): when it drains or pauses, when
it leaves, and (the janitors of its pool) when its liveness key expired.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import redis.asyncio as aioredis

from shared.connections.connect import as_text
from shared.queue import names
from shared.queue.job_queue import Delivery, JobQueue, JobStream

_LAST_DELIVERED = """
local function last_delivered(stream, group)
  if redis.call('EXISTS', stream) == 0 then return '0-0' end
  for _, info in ipairs(redis.call('XINFO', 'GROUPS', stream)) do
    local fields = {}
    for i = 1, #info, 2 do fields[info[i]] = info[i + 1] end
    if fields['name'] == group then return fields['last-delivered-id'] end
  end
  return '0-0'
end
"""

_STEAL = (
    _LAST_DELIVERED
    + """
-- KEYS: the victim's own stream, the pool's ticket stream. ARGV: group, thief, how many
-- entries at most, their minimum age (ms), when the newest ticket was placed (ms), then
-- the tickets to retire. Returns {ms to wait (the tickets are early by Redis's clock;
-- nothing done), then the entries read}.
local victim, tickets = KEYS[1], KEYS[2]
local group, thief, count, age_ms = ARGV[1], ARGV[2], tonumber(ARGV[3]), tonumber(ARGV[4])
local now = redis.call('TIME')
local now_ms = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
local wait = tonumber(ARGV[5]) + age_ms - now_ms
if wait > 0 then return {wait} end
for i = 6, #ARGV do
  redis.call('XACK', tickets, group, ARGV[i])
  redis.call('XDEL', tickets, ARGV[i])
end
if count <= 0 then return {0} end
local due = redis.call('XRANGE', victim, '(' .. last_delivered(victim, group),
  string.format('%d', now_ms - age_ms), 'COUNT', count)
if #due == 0 then return {0} end
if redis.call('EXISTS', victim) == 1 and last_delivered(victim, group) == '0-0' then
  -- the group may be missing (a stream made again by admission): make it
  pcall(redis.call, 'XGROUP', 'CREATE', victim, group, '0')
end
-- delivers exactly the entries of ``due``: the oldest unread ones
redis.call('XREADGROUP', 'GROUP', group, thief, 'COUNT', #due, 'STREAMS', victim, '>')
local reply = {0}
for _, entry in ipairs(due) do table.insert(reply, entry) end
return reply
"""
)

_REQUEUE = (
    _LAST_DELIVERED
    + """
-- KEYS: the worker's own stream, the pool's shared stream, the pool's placed-workers set,
-- the worker's liveness key. ARGV: group, worker id, mode ('drain': move the unread
-- entries; 'leave': and forget the stream once it is empty; 'dead': the same, only
-- while the liveness key is missing). Returns {entries moved (-1: 'dead' and the worker
-- is alive), 1 if the stream is still there}.
local own, shared, members, beat = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local group, worker, mode = ARGV[1], ARGV[2], ARGV[3]
if mode == 'dead' and redis.call('EXISTS', beat) == 1 then return {-1, 1} end
local unread = redis.call('XRANGE', own, '(' .. last_delivered(own, group), '+')
for _, entry in ipairs(unread) do
  redis.call('XADD', shared, '*', unpack(entry[2]))
  redis.call('XDEL', own, entry[1])
end
if mode ~= 'drain' and redis.call('XLEN', own) == 0 then
  redis.call('DEL', own)
  redis.call('SREM', members, worker)
end
return {#unread, redis.call('EXISTS', own)}
"""
)


_SWEEP = """
-- KEYS: the pool's placed-workers set, the worker's own stream. ARGV: group, the worker's
-- id, the liveness key of a worker without its id. Returns {entries pending on the own
-- stream, then the other members whose liveness key is gone}.
local members, own = KEYS[1], KEYS[2]
local group, me, beat_prefix = ARGV[1], ARGV[2], ARGV[3]
local pending = 0
if redis.call('EXISTS', own) == 1 then
  local ok, summary = pcall(redis.call, 'XPENDING', own, group)
  if ok then pending = tonumber(summary[1]) end
end
local reply = {pending}
for _, member in ipairs(redis.call('SMEMBERS', members)) do
  if member ~= me and redis.call('EXISTS', beat_prefix .. member) == 0 then
    table.insert(reply, member)
  end
end
return reply
"""


class Requeue(StrEnum):
    DRAIN = "drain"
    """Move the unread entries (the worker stays)."""
    LEAVE = "leave"
    """Move them, and forget the stream once nothing on it is pending either."""
    DEAD = "dead"
    """As LEAVE, but only while the worker's liveness key is missing."""


@dataclass(frozen=True, slots=True)
class Ticket:
    pool: JobStream
    entry_id: str
    victim: str
    """The worker the request was placed on."""
    at_ms: int
    """When it was placed (Redis clock, from the entry id)."""


def ticket_from(pool: JobStream, entry_id: str, fields: dict[Any, Any]) -> Ticket:
    victim = as_text(fields.get(b"w") or fields.get("w") or b"")
    return Ticket(pool, entry_id, victim, int(entry_id.split("-", 1)[0]))


@dataclass(frozen=True, slots=True)
class PoolRead:
    deliveries: list[Delivery]
    tickets: list[Ticket]


class WorkerStreams:
    def __init__(self, redis: aioredis.Redis, queue: JobQueue) -> None:
        self._redis = redis
        self._queue = queue
        self._steal = redis.register_script(_STEAL)
        self._requeue = redis.register_script(_REQUEUE)
        self._sweep = redis.register_script(_SWEEP)

    async def read(
        self,
        streams: Sequence[JobStream],
        ticket_pools: Sequence[JobStream],
        consumer: str,
        *,
        count: int,
        block_ms: int | None,
    ) -> PoolRead:
        """One read of ``streams`` (in their order: a worker's own first) and of the steal
        tickets of ``ticket_pools``, blocking up to ``block_ms`` (None: not at all)."""
        jobs = {stream.name: stream for stream in streams}
        tickets = {names.steal_tickets(pool.name): pool for pool in ticket_pools}
        reply: Any = await self._redis.xreadgroup(
            names.JOB_GROUP,
            consumer,
            dict.fromkeys([*jobs, *tickets], ">"),
            count=count,
            block=block_ms,
        )
        read = PoolRead([], [])
        for raw_stream, entries in reply or []:
            name = as_text(raw_stream)
            if name in jobs:
                read.deliveries.extend(await self._queue.decode_entries(jobs[name], entries))
                continue
            pool = tickets[name]
            read.tickets.extend(ticket_from(pool, as_text(i), f) for i, f in entries)
        return read

    async def ensure_groups(self, pool: JobStream, worker: str) -> None:
        """The worker's own stream and the pool's ticket stream, with the job group."""
        await self._queue.ensure_group(pool.own(worker).name)
        await self._queue.ensure_group(names.steal_tickets(pool.name))

    async def steal(
        self,
        pool: JobStream,
        victim: str,
        thief: str,
        *,
        count: int,
        age_ms: int,
        tickets: Sequence[Ticket],
    ) -> tuple[int, list[Delivery]]:
        """Once ``tickets`` (about ``victim``) are ``age_ms`` old by Redis's clock: retire
        them and read as ``thief`` up to ``count`` entries of ``victim``'s stream that are
        still unread and at least ``age_ms`` old. Returns (ms still to wait, when the
        tickets are early: nothing was done; the entries read)."""
        reply: Any = await self._steal(
            keys=[pool.own(victim).name, names.steal_tickets(pool.name)],
            args=[
                names.JOB_GROUP,
                thief,
                count,
                age_ms,
                max((t.at_ms for t in tickets), default=0),
                *(t.entry_id for t in tickets),
            ],
        )
        wait, raw = int(reply[0]), reply[1:]
        entries = [
            (entry_id, dict(zip(flat[::2], flat[1::2], strict=True))) for entry_id, flat in raw
        ]
        return wait, await self._queue.decode_entries(pool.own(victim), entries)

    async def retire(self, pool: JobStream, tickets: Sequence[str]) -> None:
        if not tickets:
            return
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.xack(names.steal_tickets(pool.name), names.JOB_GROUP, *tickets)
            pipe.xdel(names.steal_tickets(pool.name), *tickets)
            await pipe.execute()

    async def requeue(self, pool: JobStream, worker: str, mode: Requeue) -> int:
        """Move ``worker``'s unread entries in ``pool`` to the shared stream; how many
        (-1: ``mode`` is DEAD and the worker is alive)."""
        moved, _ = await self.requeue_and_look(pool, worker, mode)
        return moved

    async def requeue_and_look(
        self, pool: JobStream, worker: str, mode: Requeue
    ) -> tuple[int, bool]:
        """:meth:`requeue`, and whether the worker's stream is still there (entries read
        from it are pending) or was forgotten."""
        reply: Any = await self._requeue(
            keys=[
                pool.own(worker).name,
                pool.name,
                names.placed_workers(pool.name),
                names.worker_heartbeat(worker),
            ],
            args=[names.JOB_GROUP, worker, mode.value],
        )
        return int(reply[0]), bool(int(reply[1]))

    async def sweep(self, pool: JobStream, worker: str) -> tuple[int, set[str]]:
        """One janitor look at ``pool`` (one round trip): the entries pending on
        ``worker``'s own stream, and the other workers with an own stream that are dead."""
        reply: Any = await self._sweep(
            keys=[names.placed_workers(pool.name), pool.own(worker).name],
            args=[names.JOB_GROUP, worker, names.worker_heartbeat("")],
        )
        return int(reply[0]), {as_text(member) for member in reply[1:]}

    async def members(self, pool: JobStream) -> set[str]:
        """The workers that may have an own stream in ``pool``."""
        found: Any = await self._redis.smembers(names.placed_workers(pool.name))
        return {as_text(member) for member in found}
