"""Decide, at dequeue, whether a job runs: the checks between a delivery and the engine.

In order: the client is gone (cancel flag, or its gateway's liveness key
expired) -> drop; the deadline passed -> 504; delivered too often -> dead
letter + 500; it would be a migration that is off, over its limit or not safe
(guided decoding past its first token) -> clean error; otherwise run.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.errors import (
    ConveyorError,
    DeadlineExceeded,
    MediaMissing,
    MigrationRefused,
    PoisonJob,
)
from shared.protocol import (
    GenerateJob,
    Job,
    encode,
    is_deterministic,
    is_guided,
    without_stored_schema,
)
from shared.queue import names
from shared.queue.liveness import GatewayWatch
from workers.journal.run_journal import RunLease

log = logging.getLogger(__name__)

DEAD_LETTER_MAX_LEN = 10_000
"""Entries each dead-letter stream keeps (the oldest go first)."""


class Verdict(Enum):
    RUN = "run"
    DROP = "drop"
    FAIL = "fail"


@dataclass(frozen=True, slots=True)
class IntakePolicy:
    max_deliveries: int
    migration_limit: int


@dataclass(frozen=True, slots=True)
class Decision:
    verdict: Verdict
    reason: str
    error: ConveyorError | None = None


class Intake:
    """The checks, with what they read: Redis, the policy, which gateways are gone."""

    def __init__(self, redis: aioredis.Redis, policy: IntakePolicy, gateways: GatewayWatch) -> None:
        self._redis = redis
        self._policy = policy
        self._gateways = gateways

    async def clients_gone(self, jobs: Sequence[Job]) -> list[str | None]:
        """Per job: why its client is gone, or None. One round trip for all of ``jobs``."""
        async with self._redis.pipeline(transaction=False) as pipe:
            for job in jobs:
                pipe.exists(names.cancel_flag(job.request_id))
                pipe.exists(names.gateway_heartbeat(names.gateway_of_reply_stream(job.reply_to)))
            replies = await pipe.execute()
        return [
            self._gone(job, bool(cancelled), bool(gateway_alive))
            for job, cancelled, gateway_alive in zip(jobs, replies[::2], replies[1::2], strict=True)
        ]

    def _gone(self, job: Job, cancelled: bool, gateway_alive: bool) -> str | None:
        gateway = names.gateway_of_reply_stream(job.reply_to)
        if cancelled:
            return "client disconnected"
        if self._gateways.observe({gateway: gateway_alive}):
            return f"its gateway {gateway} is gone"
        return None

    async def decide(self, lease: RunLease, gone: str | None) -> Decision:
        """What to do with a leased job; ``gone`` is :meth:`clients_gone`'s answer."""
        job = lease.delivery.job
        if gone is not None:
            return Decision(Verdict.DROP, gone)
        if time.time() > job.deadline_unix:
            return Decision(
                Verdict.FAIL,
                "deadline passed while queued",
                DeadlineExceeded("the request's deadline passed while it was queued"),
            )
        if lease.attempt >= self._policy.max_deliveries:
            return await self._dead_letter(lease)
        if isinstance(job, GenerateJob) and _schema_missing(job):
            reason = "its JSON schema expired before the job ran"
            return Decision(Verdict.FAIL, reason, MediaMissing(f"the request's {reason}; retry"))
        if lease.emitted:
            refusal = _migration_refusal(job, lease, self._policy)
            if refusal is not None:
                return Decision(Verdict.FAIL, refusal, MigrationRefused(refusal))
        return Decision(Verdict.RUN, "migrated" if lease.emitted else "new")

    async def _dead_letter(self, lease: RunLease) -> Decision:
        error = PoisonJob(
            f"the request failed on {lease.attempt} workers in a row and was set aside "
            "(dead-letter queue); it will not be retried"
        )
        try:
            await dead_letter(self._redis, lease, error.message)
        except RedisError as exc:  # the client still gets its error; only the copy is lost
            log.error("job %s: could not write its dead-letter entry: %s", lease.job_id, exc)
        return Decision(Verdict.FAIL, "dead-lettered", error)


def _schema_missing(job: GenerateJob) -> bool:
    """The request's stored JSON schema was gone when the job was read (see
    :attr:`shared.protocol.SamplingOptions.json_schema_stored`)."""
    return job.sampling.json_schema_stored and job.sampling.json_schema is None


def _migration_refusal(job: Job, lease: RunLease, policy: IntakePolicy) -> str | None:
    if policy.migration_limit <= 0:
        return "its worker stopped mid-stream and migration is off (CONVEYOR_MIGRATION_LIMIT=0)"
    if lease.attempt > policy.migration_limit:
        return f"its worker stopped mid-stream {lease.attempt} times (migration limit reached)"
    if not isinstance(job, GenerateJob):
        return None
    if is_guided(job.sampling) and not is_deterministic(job.sampling):
        return (
            "its worker stopped mid-stream and guided decoding resumes elsewhere only when "
            "it is deterministic (temperature 0 or a seed)"
        )
    return None


async def dead_letter(
    redis: aioredis.Redis, lease: RunLease, reason: str, *, max_len: int = DEAD_LETTER_MAX_LEN
) -> None:
    """Keep a copy of the job and why it was set aside; the stream keeps the newest
    ``max_len`` (a record, not work: trimming loses nothing that would run)."""
    fields = encode(without_stored_schema(lease.delivery.job))
    fields[b"reason"] = reason.encode()
    fields[b"entry"] = lease.delivery.entry_id.encode()
    stream = names.dead_letter_stream(lease.delivery.shared_stream)
    await redis.xadd(stream, fields, maxlen=max_len, approximate=False)  # type: ignore[arg-type]
