"""The run journal: who owns a running job, what it has emitted, and its events.

Each run of a job has a hash ``conveyor:run:{role}:{job}`` (``owner`` fence token,
``starts``, next ``seq``) and a string ``conveyor:emitted:{role}:{job}`` holding the
token ids published so far. Every write a worker makes for a job goes through
one Lua script (:mod:`workers.journal.scripts`) that first checks the job is
still this run's (the *fence*):

- events + emitted tokens + next seq are written together, so the journal is
  always exactly what the gateway received; a run that takes the job over
  (reclaim, hand-back) continues from there and nothing is lost or repeated;
- a run that lost the job (a zombie that was SIGSTOPped past the reclaim
  time) writes nothing and is told so, and stops.

Events produced in one pass of the event loop (one engine step) leave in one
script call, with the acks (``XACK`` + ``XDEL``) of jobs that just finished,
as one reply-stream entry per gateway holding every event of the step. A job's token
events that pile up while the last call is on its way leave as one event.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.connections.connect import as_text
from shared.connections.retry import Backoff, retry
from shared.errors import ConveyorError
from shared.protocol import (
    VERSION,
    ErrorEvent,
    Event,
    GenerateJob,
    TokenEvent,
    encode_payload,
    without_stored_schema,
)
from shared.queue import names
from shared.queue.job_queue import Delivery
from workers.journal.scripts import (
    BeginArgs,
    ForwardArgs,
    HandBackArgs,
    JournalScripts,
    RefreshHeader,
    RefreshRow,
    WriteHeader,
)
from workers.journal.writes import JobWrites, unpack_tokens

log = logging.getLogger(__name__)

T = TypeVar("T")

JOURNAL_RETRY_S = 30.0
"""How long a journal write rides out Redis trouble before the journal gives up."""
TTL_RENEW_SHARE = 0.1
"""The janitor renews a run's claim every pass, and the TTL of its keys (the run TTL)
only once this share of it has passed since it was last set."""
SENT_REFRESH_SHARE = 0.1
"""A run's writes set the TTL of its request's sent tally (the run TTL) with its first
tokens and its final event, and otherwise only once this share of the TTL has passed
since they last set it: the tally outlives the run's last write by at least the TTL less
this share of it."""


@dataclass(frozen=True, slots=True)
class RunNames:
    """A job run's Redis names: its run hash, emitted tokens, the request's sent tally and
    the count of jobs done on its stream."""

    run: str
    emitted: str
    sent: str
    done: str

    @classmethod
    def of(cls, delivery: Delivery) -> RunNames:
        job = delivery.job
        return cls(
            run=names.job_run(job.job_id, delivery.role),
            emitted=names.job_emitted(job.job_id, delivery.role),
            sent=names.sent_tally(job.request_id),
            done=names.stream_done_counter(delivery.shared_stream),
        )


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
    emitted_chars: int = 0
    """Text characters published by earlier runs (counted only where ``counts_chars``)."""
    counts_chars: bool = False
    """Whether this run's writes count their text characters: a run that replays its
    output must know where the text the client has ends (see ``Replay``)."""
    first_seq_unix: float | None = None
    """When this run numbered its first event (its first engine output, for tracing)."""
    ttl_set_ms: int = 0
    """When the TTL of the run's keys was last set (by this run's begin, then by renewals)."""
    sent_refreshed_ms: int | None = None
    """When this run's writes last set the TTL of the request's sent tally (None: none
    carried tokens yet; the first that does also records the first-token time)."""
    _names: RunNames | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def job_id(self) -> str:
        return self.delivery.job.job_id

    @property
    def redis_names(self) -> RunNames:
        """The Redis names its writes touch (built once: every engine step writes them)."""
        if self._names is None:
            self._names = RunNames.of(self.delivery)
        return self._names

    @property
    def run_key(self) -> str:
        return self.redis_names.run

    @property
    def emitted_key(self) -> str:
        return self.redis_names.emitted

    def take_seq(self) -> int:
        if self.first_seq_unix is None:
            self.first_seq_unix = time.time()
        seq = self.next_seq
        self.next_seq += 1
        return seq


class RunJournal:
    def __init__(
        self,
        redis: aioredis.Redis,
        *,
        consumer: str,
        run_ttl_s: float = 3600.0,
        on_fenced: Callable[[str], None] = lambda job_id: None,
        retry_for_s: float = JOURNAL_RETRY_S,
        scripts: JournalScripts | None = None,
        join_tokens: bool = False,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._redis = redis
        self._join_tokens = join_tokens
        self._consumer = consumer
        self._run_ttl_ms = int(run_ttl_s * 1000)
        self._sent_refresh_ms = int(self._run_ttl_ms * SENT_REFRESH_SHARE)
        self._clock = clock
        self._on_fenced = on_fenced
        self._retry_for_s = retry_for_s
        self._scripts = scripts or JournalScripts(redis)
        self._pending: dict[str, JobWrites] = {}
        self._sending: list[JobWrites] = []
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
        replies = await self._scripts.begin(
            [
                (
                    names.job_run(delivery.job.job_id, delivery.role),
                    names.job_emitted(delivery.job.job_id, delivery.role),
                    BeginArgs(fence=fence, ttl_ms=self._run_ttl_ms),
                )
                for delivery, fence in zip(deliveries, fences, strict=True)
            ]
        )
        began_ms = int(self._clock() * 1000)
        return [
            RunLease(
                delivery,
                fence,
                int(attempt),
                int(seq),
                unpack_tokens(emitted or b""),
                int(chars),
                ttl_set_ms=began_ms,
            )
            for delivery, fence, (attempt, seq, emitted, chars) in zip(
                deliveries, fences, replies, strict=True
            )
        ]

    # ------------------------------------------------------------------ writes

    def publish(self, lease: RunLease, event: Event, token_ids: list[int]) -> None:
        """Journal ``event`` (and ``token_ids``, what it adds to the emitted tokens). With
        ``join_tokens``, a token event that finds the job's last one still waiting to be
        written joins it (its seq goes back to ``lease``)."""
        writes = self._writes(lease)
        if not (self._join_tokens and isinstance(event, TokenEvent) and writes.join(event)):
            writes.add(event)
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
            writes.add(event)
        writes.finish = True

    def _writes(self, lease: RunLease) -> JobWrites:
        writes = self._pending.get(lease.fence)
        if writes is None:
            writes = self._pending[lease.fence] = JobWrites(lease)
        if self._failed is not None:
            return writes  # nothing will write it: keep flush() from waiting forever
        self._idle.clear()
        self._wakeup.set()
        return writes

    def entries_unwritten(self) -> set[str]:
        """Stream entries of jobs whose writes (an ack among them) are not in Redis yet."""
        waiting = [*self._pending.values(), *self._sending]
        return {writes.lease.delivery.entry_id for writes in waiting}

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

    async def _send(self, batch: list[JobWrites]) -> None:
        header = WriteHeader(
            version=VERSION,
            group=names.JOB_GROUP,
            job_count=len(batch),
            sent_ttl_ms=self._run_ttl_ms,
        )
        now_ms, refresh_ms = int(self._clock() * 1000), self._sent_refresh_ms
        rows = [writes.row(now_ms, refresh_ms) for writes in batch]
        self._sending = batch
        try:
            fenced = await self._retrying(
                lambda: self._scripts.write(header, rows), "journal write"
            )
        finally:
            self._sending = []
        for run_key in fenced:
            job_id = names.job_of_run(as_text(run_key))
            log.warning("job %s belongs to another run now; stopping it here", job_id)
            self._on_fenced(job_id)

    async def _retrying(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        return await retry(call, for_s=self._retry_for_s, backoff=Backoff(0.1, 1.0), what=what)

    # --------------------------------------------------------------- ownership

    async def hand_back(self, lease: RunLease, *, failed: bool = False) -> bool:
        """Requeue the job (same payload) so another worker continues it.

        A graceful hand-back (drain) does not count as a delivery; one after an engine
        death does, so a job that kills every engine it meets is dead-lettered.
        """
        delivery = lease.delivery
        args = HandBackArgs(
            fence=lease.fence,
            stream=delivery.stream,
            entry=delivery.entry_id,
            version=VERSION,
            payload=encode_payload(without_stored_schema(delivery.job)),
            group=names.JOB_GROUP,
            graceful="0" if failed else "1",
            requeue_to=delivery.shared_stream,
        )
        return await self._scripts.hand_back(lease.run_key, args)

    async def forward(
        self, lease: RunLease, next_stream: str, job: GenerateJob, *, ack: bool
    ) -> bool:
        """Queue ``job`` on the next stage's stream (and, with ``ack``, finish this one)
        in one fenced step; False if this run no longer owns the job."""
        delivery = lease.delivery
        await self.flush()
        args = ForwardArgs(
            fence=lease.fence,
            next_stream=next_stream,
            version=VERSION,
            payload=encode_payload(without_stored_schema(job)),
            stream=delivery.stream,
            entry=delivery.entry_id if ack else "",
            group=names.JOB_GROUP,
            done_key=names.stream_done_counter(delivery.shared_stream),
        )
        return await self._retrying(
            lambda: self._scripts.forward(lease.run_key, lease.emitted_key, args), "forward"
        )

    def _ttl_due(self, lease: RunLease, now_ms: int) -> int:
        """The run TTL when it is due on ``lease``'s keys again (and noted as set), else 0."""
        if now_ms - lease.ttl_set_ms < self._run_ttl_ms * TTL_RENEW_SHARE:
            return 0
        lease.ttl_set_ms = now_ms
        return self._run_ttl_ms

    async def refresh(self, leases: list[RunLease]) -> list[str]:
        """Renew the claim on every lease still ours; returns the job ids lost."""
        if not leases:
            return []
        header = RefreshHeader(consumer=self._consumer, group=names.JOB_GROUP)
        now_ms = int(self._clock() * 1000)
        rows = [
            RefreshRow(
                run=lease.run_key,
                emitted=lease.emitted_key,
                fence=lease.fence,
                stream=lease.delivery.stream,
                entry=lease.delivery.entry_id,
                ttl_ms=self._ttl_due(lease, now_ms),
            )
            for lease in leases
        ]
        lost = await self._scripts.refresh(header, rows)
        return [names.job_of_run(as_text(run_key)) for run_key in lost]
