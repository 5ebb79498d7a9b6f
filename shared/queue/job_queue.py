"""The job queue: one Redis stream per (model, stage) with a consumer group.

Admission (idempotency key, depth cap, XADD) is one Lua script, so a request is
either queued whole (all of its ``n`` jobs) or not at all. Entries are deleted
on ack (``XACK`` + ``XDEL`` in one ``MULTI``), never trimmed, so ``XLEN`` is
the number of jobs queued or running.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from shared.connections.connect import as_text
from shared.errors import ProtocolError
from shared.protocol import VERSION, EmbedJob, GenerateJob, Job, decode, encode
from shared.queue import names
from shared.queue.key_limits import (
    ADMIT_LIMITS_LUA,
    LIMIT_ARG_COUNT,
    LimitCharge,
    LimitUsage,
    usage_from_reply,
)
from shared.queue.open_requests import OPEN_TTL_S, OpenRequest, encode_open
from shared.queue.request_status import status_ttl_s
from shared.roles import Role

log = logging.getLogger(__name__)

_ADMIT = (
    ADMIT_LIMITS_LUA
    + """
-- KEYS: the shared stream, idempotency key ('' = none), admitted marker, then the
-- key-limit counters (see shared.queue.key_limits), then the gateway's open-requests hash
-- (when the open record is given), then the request's JSON-schema key. ARGV: max depth,
-- idempotency ttl, request id, protocol version, job count, 1 if the request is limited,
-- the pool's placed-workers set, the prefix of its workers' own streams, the worker the
-- jobs are placed on ('' = none), its liveness key, the pool's steal tickets, then the
-- limit arguments (when limited), then one payload per job, then the JSON schema ('' =
-- none: stored once for all the jobs) and its ttl, then the open record
-- (shared.queue.open_requests; optional), then its hash's ttl, then (with the open record)
-- the gateway's id (added to names.GATEWAY_SET) and the status record's ttl
-- (shared.queue.request_status; its key is the last of KEYS, after the schema key).
local stream, idem, admitted = KEYS[1], KEYS[2], KEYS[3]
local max_depth, idem_ttl, request_id = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local version, count, limited = ARGV[4], tonumber(ARGV[5]), ARGV[6] == '1'
local members, own_prefix, worker, beat, tickets = ARGV[7], ARGV[8], ARGV[9], ARGV[10], ARGV[11]
local first_job = limited and (12 + LIMIT_ARGS) or 12
local none = {0, 0, 0, 0}
-- the pool's depth: the shared stream and every worker's own one
local function pool_depth()
  local depth = redis.call('XLEN', stream)
  for _, member in ipairs(redis.call('SMEMBERS', members)) do
    depth = depth + redis.call('XLEN', own_prefix .. member)
  end
  return depth
end
if redis.call('EXISTS', admitted) == 1 then
  -- a retry whose first try landed (its reply was lost): queued once, not twice
  return {'queued', tostring(pool_depth()), none, ''}
end
if idem ~= '' then
  local existing = redis.call('GET', idem)
  if existing then return {'duplicate', existing, none, ''} end
end
local used = none
if limited then
  local over
  over, used = limits_check(4, 12)
  if over then return {'limited', over, used, ''} end
end
local depth = pool_depth()
if depth + count > max_depth then return {'full', tostring(depth), used, ''} end
-- placed only on a live worker: once its liveness key is gone (it left or died), nothing
-- lands on its stream that its last requeue would not see
local target = stream
if worker ~= '' and redis.call('EXISTS', beat) == 1 then
  target = own_prefix .. worker
  redis.call('SADD', members, worker)
  redis.call('XADD', tickets, '*', 'w', worker)
else
  worker = ''
end
local first_entry = ''
for i = first_job, first_job + count - 1 do
  local entry = redis.call('XADD', target, '*', 'v', version, 'm', ARGV[i])
  if first_entry == '' then first_entry = entry end
end
if limited then used = limits_charge(4, 12, used) end
if idem ~= '' then redis.call('SET', idem, request_id, 'EX', idem_ttl) end
local schema = ARGV[first_job + count]
if schema ~= '' then
  redis.call('SET', KEYS[#KEYS - 1], schema, 'EX', tonumber(ARGV[first_job + count + 1]))
end
local opened = ARGV[first_job + count + 2]
if opened then
  redis.call('HSET', KEYS[#KEYS - 2], request_id, opened)
  redis.call('EXPIRE', KEYS[#KEYS - 2], tonumber(ARGV[first_job + count + 3]))
  redis.call('SADD', 'GATEWAY_SET', ARGV[first_job + count + 4])
  local status = KEYS[#KEYS]
  redis.call('HSET', status, 'o', opened, 'g', ARGV[first_job + count + 4], 's', target,
             'e', first_entry)
  redis.call('EXPIRE', status, tonumber(ARGV[first_job + count + 5]))
end
redis.call('SET', admitted, '1', 'EX', 600)
return {'queued', tostring(depth + count), used, worker}
""".replace("LIMIT_ARGS", str(LIMIT_ARG_COUNT)).replace("GATEWAY_SET", names.GATEWAY_SET)
)


SCHEMA_TTL_MARGIN_S = 60
"""A stored JSON schema outlives its request's deadline by this much (then it expires
even if the gateway that queued the request never deleted it)."""


def _schema_apart(jobs: Sequence[Job]) -> tuple[Sequence[Job], str]:
    """``jobs`` without their shared JSON schema, and that schema ('' when the jobs have
    none, or not one shared by all): stored once, not once per job."""
    first = jobs[0]
    if not isinstance(first, GenerateJob) or first.sampling.json_schema is None:
        return jobs, ""
    schema = first.sampling.json_schema
    if any(not isinstance(j, GenerateJob) or j.sampling.json_schema != schema for j in jobs):
        return jobs, ""
    apart = [
        msgspec.structs.replace(
            job,
            sampling=msgspec.structs.replace(
                job.sampling, json_schema=None, json_schema_stored=True
            ),
        )
        for job in jobs
        if isinstance(job, GenerateJob)
    ]
    return apart, schema


def _schema_ttl_s(job: Job) -> int:
    return max(1, int(job.deadline_unix - time.time()) + SCHEMA_TTL_MARGIN_S)


def _with_schema(job: Job, schemas: dict[str, str]) -> Job:
    """``job`` with its request's stored JSON schema filled in (when it has one)."""
    if not isinstance(job, GenerateJob) or not job.sampling.json_schema_stored:
        return job
    schema = schemas.get(job.request_id)
    if schema is None or job.sampling.json_schema is not None:
        return job
    sampling = msgspec.structs.replace(job.sampling, json_schema=schema)
    return msgspec.structs.replace(job, sampling=sampling)


class Admission(StrEnum):
    QUEUED = "queued"
    FULL = "full"
    DUPLICATE = "duplicate"
    LIMITED = "limited"


@dataclass(frozen=True, slots=True)
class AdmissionResult:
    outcome: Admission
    detail: str
    """Queue depth after admission (queued/full), the original request id (duplicate),
    or the limit the request would pass (limited: a :class:`LimitKind` value)."""
    usage: LimitUsage | None = None
    """With a limited key: its counts after admission (or at refusal)."""
    placed_on: str | None = None
    """The worker whose own stream the jobs went to (None: the shared stream; also when
    the worker asked for had left)."""


@dataclass(frozen=True, slots=True)
class OpenedBy:
    """The gateway that queues a request, and the request's open record."""

    gateway_id: str
    record: OpenRequest


@dataclass(frozen=True, slots=True)
class JobStream:
    """The shared job stream of one (model, role) pool, or (``worker`` set) one worker's
    own stream in that pool."""

    model: str
    role: Role
    worker: str | None = None

    @property
    def shared(self) -> str:
        return names.job_stream(self.model, self.role)

    @property
    def name(self) -> str:
        shared = self.shared
        return shared if self.worker is None else names.worker_job_stream(shared, self.worker)

    def own(self, worker_id: str) -> JobStream:
        """The pool's stream of ``worker_id``."""
        return JobStream(self.model, self.role, worker_id)


@dataclass(frozen=True, slots=True)
class Delivery:
    stream: str
    entry_id: str
    job: Job
    role: Role
    """The role of the stream it was read from (a job's run keys are per role)."""
    shared: str = ""
    """The pool's shared stream when read from a worker's own stream ('' otherwise)."""

    @property
    def shared_stream(self) -> str:
        """Where the job counts as done, is dead-lettered and is handed back to."""
        return self.shared or self.stream


class JobQueue:
    """Job streams on one Redis connection (real Redis, or fakeredis in unit tests)."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis
        self._admit = redis.register_script(_ADMIT)

    async def submit(
        self,
        stream: str,
        jobs: Sequence[Job],
        *,
        max_depth: int,
        idempotency_key: str | None = None,
        idempotency_owner: str | None = None,
        idempotency_ttl_s: int = 3600,
        charge: LimitCharge | None = None,
        opened: OpenedBy | None = None,
        placed_on: str | None = None,
    ) -> AdmissionResult:
        """Queue all of ``jobs`` or none. Safe to retry: a request is queued at most once.

        ``stream`` is the pool's shared stream; with ``placed_on`` (a worker id) the jobs
        go to that worker's own stream instead while it is alive (the shared one if not),
        with a steal ticket. The depth cap counts the whole pool. With ``charge``, the
        key's limits are checked and counted in the same step; with ``opened``, the
        request's open record is stored (shared/queue/open_requests.py).
        ``idempotency_owner`` (the API key's id) scopes ``idempotency_key`` to that key.
        """
        if not jobs:
            raise ValueError("submit needs at least one job")
        idem = (
            names.idempotency(jobs[0].model, idempotency_key, idempotency_owner)
            if idempotency_key
            else ""
        )
        header: list[bytes | str | int] = [
            max_depth,
            idempotency_ttl_s,
            jobs[0].request_id,
            VERSION,
            len(jobs),
            1 if charge is not None else 0,
            names.placed_workers(stream),
            names.worker_job_stream(stream, ""),
            placed_on or "",
            names.worker_heartbeat(placed_on or ""),
            names.steal_tickets(stream),
        ]
        limit_keys = charge.keys() if charge is not None else []
        limit_args = charge.args() if charge is not None else []
        jobs, schema = _schema_apart(jobs)
        payloads = [encode(job)[b"m"] for job in jobs]
        schema_args: list[str | int] = [schema, _schema_ttl_s(jobs[0])]
        admitted = names.admitted(jobs[0].request_id)
        open_keys: list[str] = []
        open_args: list[bytes | int | str] = []
        if opened is not None:
            open_keys = [names.open_requests(opened.gateway_id)]
            open_args = [
                encode_open(opened.record),
                OPEN_TTL_S,
                opened.gateway_id,
                status_ttl_s(jobs[0].deadline_unix),
            ]
        schema_key = names.json_schema(jobs[0].request_id)
        status_key = names.request_status(jobs[0].request_id)
        outcome, detail, counts, worker = await self._admit(
            keys=[stream, idem, admitted, *limit_keys, *open_keys, schema_key, status_key],
            args=[*header, *limit_args, *payloads, *schema_args, *open_args],
        )
        usage = usage_from_reply(charge, counts) if charge is not None else None
        placed = as_text(worker) or None
        return AdmissionResult(Admission(as_text(outcome)), as_text(detail), usage, placed)

    async def ensure_group(self, stream: str) -> None:
        try:
            await self._redis.xgroup_create(stream, names.JOB_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read(
        self, streams: Sequence[JobStream], consumer: str, *, count: int, block_ms: int
    ) -> list[Delivery]:
        """New entries for ``consumer``; malformed ones are dead-ended and skipped."""
        by_name = {stream.name: stream for stream in streams}
        reply: Any = await self._redis.xreadgroup(
            names.JOB_GROUP, consumer, dict.fromkeys(by_name, ">"), count=count, block=block_ms
        )
        deliveries: list[Delivery] = []
        for raw_stream, entries in reply or []:
            deliveries += await self.decode_entries(by_name[as_text(raw_stream)], entries)
        return deliveries

    async def decode_entries(self, stream: JobStream, entries: list[Any]) -> list[Delivery]:
        """``entries`` (id, fields) read from ``stream``; malformed ones are dead-ended."""
        deliveries: list[Delivery] = []
        for raw_id, fields in entries:
            entry_id = as_text(raw_id)
            try:
                message = decode(fields)
            except ProtocolError as exc:
                log.error("dropping undecodable entry %s on %s: %s", entry_id, stream.name, exc)
                await self.ack(stream.name, entry_id)
                continue
            if isinstance(message, GenerateJob | EmbedJob):
                shared = stream.shared if stream.worker is not None else ""
                deliveries.append(Delivery(stream.name, entry_id, message, stream.role, shared))
            else:
                log.error("dropping non-job entry %s on %s", entry_id, stream.name)
                await self.ack(stream.name, entry_id)
        return await self._with_schemas(deliveries)

    async def _with_schemas(self, deliveries: list[Delivery]) -> list[Delivery]:
        """``deliveries`` with their requests' stored JSON schemas filled in, read in one
        round trip (a job whose schema expired keeps none: it fails at intake)."""
        request_ids = sorted(
            {
                d.job.request_id
                for d in deliveries
                if isinstance(d.job, GenerateJob) and d.job.sampling.json_schema_stored
            }
        )
        if not request_ids:
            return deliveries
        values = await self._redis.mget([names.json_schema(r) for r in request_ids])
        schemas = {
            request_id: as_text(value)
            for request_id, value in zip(request_ids, values, strict=True)
            if value is not None
        }
        return [dataclasses.replace(d, job=_with_schema(d.job, schemas)) for d in deliveries]

    async def reclaim(
        self,
        stream: JobStream,
        consumer: str,
        *,
        min_idle_ms: int,
        count: int,
        from_consumers: set[str] | None = None,
        include_own: bool = False,
    ) -> list[Delivery]:
        """Take over entries idle for ``min_idle_ms`` held by ``from_consumers`` (dead
        workers; default: any consumer but ``consumer`` itself)."""
        rows = await self._idle_entries(stream, min_idle_ms=min_idle_ms, count=count)
        ids = [
            row["message_id"]
            for row in rows
            if (include_own or as_text(row["consumer"]) != consumer)
            and (from_consumers is None or as_text(row["consumer"]) in from_consumers)
        ][:count]
        return await self.claim(stream, consumer, min_idle_ms=min_idle_ms, ids=ids)

    async def idle_own_entries(
        self, stream: JobStream, consumer: str, *, min_idle_ms: int, count: int
    ) -> list[str]:
        """Ids of entries ``consumer`` has read and not acked, idle for ``min_idle_ms``."""
        rows = await self._idle_entries(
            stream, min_idle_ms=min_idle_ms, count=count, consumer=consumer
        )
        return [as_text(row["message_id"]) for row in rows]

    async def claim(
        self, stream: JobStream, consumer: str, *, min_idle_ms: int, ids: Sequence[str]
    ) -> list[Delivery]:
        """Claim ``ids`` for ``consumer`` where still pending and idle for ``min_idle_ms``
        (an entry acked meanwhile is skipped: every ack deletes its entry too)."""
        if not ids:
            return []
        entries: Any = await self._redis.xclaim(
            stream.name, names.JOB_GROUP, consumer, min_idle_ms, list(ids)
        )
        return await self.decode_entries(stream, [e for e in entries or [] if e and e[1]])

    async def _idle_entries(
        self, stream: JobStream, *, min_idle_ms: int, count: int, consumer: str | None = None
    ) -> list[Any]:
        rows: Any = await self._redis.xpending_range(
            stream.name,
            names.JOB_GROUP,
            min="-",
            max="+",
            count=max(count * 4, 64),
            consumername=consumer,
            idle=min_idle_ms,
        )
        return list(rows or [])

    async def consumers(self, stream: JobStream) -> list[str]:
        """The consumers (workers) holding pending entries of ``stream``."""
        summary: Any = await self._redis.xpending(stream.name, names.JOB_GROUP)
        return [as_text(c["name"]) for c in summary.get("consumers") or []]

    async def ack(self, stream: str, entry_id: str) -> None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.xack(stream, names.JOB_GROUP, entry_id)
            pipe.xdel(stream, entry_id)
            await pipe.execute()

    async def depth(self, stream: str) -> int:
        """Jobs queued or running in the pool of ``stream`` (its shared stream's name)."""
        members = await self._redis.smembers(names.placed_workers(stream))
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.xlen(stream)
            for member in sorted(members):
                pipe.xlen(names.worker_job_stream(stream, as_text(member)))
            return sum(int(n) for n in await pipe.execute())

    async def oldest_entry_ms(self, stream: str) -> int | None:
        """When the oldest job queued or running in the pool of ``stream`` was added (ms,
        its entry id's time; None when there is none)."""
        members = await self._redis.smembers(names.placed_workers(stream))
        async with self._redis.pipeline(transaction=False) as pipe:
            pipe.xrange(stream, count=1)
            for member in sorted(members):
                pipe.xrange(names.worker_job_stream(stream, as_text(member)), count=1)
            firsts = await pipe.execute()
        times = [int(as_text(entries[0][0]).split("-")[0]) for entries in firsts if entries]
        return min(times, default=None)
