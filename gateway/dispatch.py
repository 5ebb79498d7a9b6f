"""Admission and the life of one request inside the gateway.

``Dispatcher.submit`` queues a request's jobs (or refuses it with 429/503/409)
and returns a :class:`RequestHandle` whose :meth:`RequestHandle.events` yields
the workers' events in order. Closing a handle before its last event sends a
cancel from a shielded task, so the abort leaves even when the caller is being
cancelled by a client disconnect.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.drain_rate import DrainMeter
from gateway.translate import ChoiceSpec
from gateway.worker_directory import WorkerDirectory
from shared import keys
from shared.errors import (
    BackendUnavailable,
    DeadlineExceeded,
    IdempotencyConflict,
    NoLiveWorker,
    Overloaded,
)
from shared.job_queue import Admission, AdmissionResult, JobQueue
from shared.protocol import (
    FINAL_EVENTS,
    CancelCommand,
    EmbedJob,
    Event,
    GenerateJob,
    ImageRef,
    Job,
    encode_bytes,
)
from shared.redis_conn import db_of
from shared.reply_stream import ReplyRouter, StreamInterrupted
from shared.retry import Backoff, retry
from shared.roles import Role
from shared.settings import Settings

log = logging.getLogger(__name__)

CANCEL_FLAG_TTL_S = 600


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    queue_max_depth: int
    idempotency_ttl_s: int
    min_prefill_tokens: int
    admission_retry_s: float

    @classmethod
    def from_settings(cls, settings: Settings) -> AdmissionPolicy:
        return cls(
            queue_max_depth=settings.queue_max_depth,
            idempotency_ttl_s=settings.idempotency_ttl_s,
            min_prefill_tokens=settings.disagg_min_prompt_tokens,
            admission_retry_s=settings.admission_retry_s,
        )


class Dispatcher:
    def __init__(
        self,
        redis: aioredis.Redis,
        router: ReplyRouter,
        directory: WorkerDirectory,
        policy: AdmissionPolicy,
    ) -> None:
        self._redis = redis
        self._queue = JobQueue(redis)
        self._router = router
        self._directory = directory
        self._policy = policy
        self._background: set[asyncio.Task[None]] = set()
        self.drain = DrainMeter(redis)

    async def _admit(
        self, stream: str, jobs: Sequence[Job], idempotency_key: str | None
    ) -> AdmissionResult:
        """Admission that rides out a short Redis outage (a restart takes about a second)."""
        return await retry(
            lambda: self._queue.submit(
                stream,
                jobs,
                max_depth=self._policy.queue_max_depth,
                idempotency_key=idempotency_key,
                idempotency_ttl_s=self._policy.idempotency_ttl_s,
            ),
            for_s=self._policy.admission_retry_s,
            backoff=Backoff(first_s=0.1, max_s=1.0),
            what=f"admission of {jobs[0].request_id}",
            retry_on=(RedisConnectionError, RedisTimeoutError),
        )

    async def submit(
        self,
        request_id: str,
        model: str,
        choices: list[ChoiceSpec],
        *,
        timeout_s: float,
        idempotency_key: str | None,
        images: tuple[ImageRef, ...] = (),
    ) -> RequestHandle:
        longest_prompt = max(len(choice.prompt_token_ids) for choice in choices)
        role = self._directory.first_stage(model, longest_prompt, self._policy.min_prefill_tokens)
        if role is None:
            raise NoLiveWorker(
                f"no live worker serves model `{model}` right now; retry shortly",
                retry_after_s=5,
            )
        # With an encode pool, images go through it first; without, the language
        # worker takes the raw images itself.
        after_encode = None
        if images and self._directory.serving(model, Role.ENCODE):
            role, after_encode = Role.ENCODE, role
        now = time.time()
        jobs = [
            GenerateJob(
                request_id=request_id,
                index=choice.index,
                model=model,
                prompt_token_ids=choice.prompt_token_ids,
                sampling=choice.sampling,
                reply_to=self._router.stream,
                deadline_unix=now + timeout_s,
                created_unix=now,
                images=images,
                after_encode=after_encode,
            )
            for choice in choices
        ]
        return await self._enqueue(keys.job_stream(model, role), jobs, idempotency_key)

    async def submit_embeddings(
        self,
        request_id: str,
        model: str,
        prompts: list[list[int]],
        *,
        timeout_s: float,
        dimensions: int | None,
    ) -> RequestHandle:
        """One embedding job per input, on the model's embed stream."""
        if not self._directory.serving(model, Role.EMBED):
            raise NoLiveWorker(
                f"no live embedding worker serves model `{model}` right now; retry shortly",
                retry_after_s=5,
            )
        now = time.time()
        jobs = [
            EmbedJob(
                request_id=request_id,
                index=index,
                model=model,
                prompt_token_ids=prompt,
                reply_to=self._router.stream,
                deadline_unix=now + timeout_s,
                created_unix=now,
                dimensions=dimensions,
            )
            for index, prompt in enumerate(prompts)
        ]
        return await self._enqueue(keys.job_stream(model, Role.EMBED), jobs, None)

    async def _enqueue(
        self, stream: str, jobs: Sequence[Job], idempotency_key: str | None
    ) -> RequestHandle:
        """Queue all of ``jobs`` (one request) and open the route for their events."""
        request_id, model, deadline = jobs[0].request_id, jobs[0].model, jobs[0].deadline_unix
        self.drain.watch(stream)
        events = self._router.open(request_id)
        try:
            result = await self._admit(stream, jobs, idempotency_key)
        except RedisError as exc:
            self._router.close(request_id)
            raise BackendUnavailable(f"the job queue is unreachable: {exc}") from exc
        if result.outcome is not Admission.QUEUED:
            self._router.close(request_id)
            retry_after = 1
            if result.outcome is Admission.FULL:
                excess = int(result.detail) + len(jobs) - self._policy.queue_max_depth
                retry_after = self.drain.retry_after_s(stream, excess)
            _raise_refusal(result.outcome, result.detail, model, retry_after)
        log.info("queued %s: %d sequence(s) for %s", request_id, len(jobs), model)
        return RequestHandle(self, request_id, len(jobs), events, deadline)

    def close(self, request_id: str, *, cancel: bool) -> None:
        self._router.close(request_id)
        if cancel:
            task = asyncio.get_running_loop().create_task(self._send_cancel(request_id))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _send_cancel(self, request_id: str, *, retry_for_s: float = 30.0) -> None:
        async def send() -> None:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.set(keys.cancel_flag(request_id), b"1", ex=CANCEL_FLAG_TTL_S)
                pipe.publish(
                    keys.control_channel(db_of(self._redis)),
                    encode_bytes(CancelCommand(request_id)),
                )
                await pipe.execute()

        try:
            await retry(send, for_s=retry_for_s, backoff=Backoff(first_s=0.5, max_s=0.5),
                        what=f"cancel of {request_id}")
        except RedisError as exc:
            log.warning("could not send cancel for %s: %s", request_id, exc)
            return
        log.info("cancel sent for %s", request_id)

    async def wait_background(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)


def _raise_refusal(outcome: Admission, detail: str, model: str, retry_after_s: int) -> None:
    if outcome is Admission.FULL:
        raise Overloaded(
            f"the queue for `{model}` is full ({detail} jobs queued or running); retry in "
            f"about {retry_after_s}s",
            retry_after_s=retry_after_s,
        )
    raise IdempotencyConflict(
        f"a request with this Idempotency-Key was already accepted (request id {detail}); "
        "it is not queued twice",
        param="Idempotency-Key",
    )


class RequestHandle:
    """Events of one request's sequences; ``close`` cancels what has not finished."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        request_id: str,
        sequences: int,
        queue: asyncio.Queue[Event | StreamInterrupted],
        deadline_unix: float,
    ) -> None:
        self.request_id = request_id
        self._dispatcher = dispatcher
        self._queue = queue
        self._unfinished = sequences
        self._next_seq: dict[int, int] = {}
        self.duplicates_dropped = 0
        self._deadline_unix = deadline_unix
        self._closed = False

    async def events(self, *, idle_timeout_s: float | None = None) -> AsyncIterator[Event | None]:
        """Yields events until every sequence ended; ``None`` after ``idle_timeout_s`` of quiet."""
        while self._unfinished > 0:
            remaining = self._deadline_unix - time.time()
            if remaining <= 0:
                raise DeadlineExceeded("the request timed out before the model finished")
            wait = remaining if idle_timeout_s is None else min(idle_timeout_s, remaining)
            try:
                item = await self._next(wait)
            except TimeoutError:
                if time.time() >= self._deadline_unix:
                    raise DeadlineExceeded(
                        "the request timed out before the model finished"
                    ) from None
                yield None
                continue
            if isinstance(item, StreamInterrupted):
                raise BackendUnavailable(item.reason)
            if not self._in_order(item):
                continue
            if isinstance(item, FINAL_EVENTS):
                self._unfinished -= 1
            yield item

    async def _next(self, wait_s: float) -> Event | StreamInterrupted:
        try:
            return self._queue.get_nowait()  # the common case under load: no timer, no task
        except asyncio.QueueEmpty:
            # A timeout scope, not wait_for: no task per event while a stream waits.
            async with asyncio.timeout(wait_s):
                return await self._queue.get()

    def has_buffered(self) -> bool:
        """Events already arrived and not yet yielded (a writer can batch them)."""
        return not self._queue.empty()

    def _in_order(self, event: Event) -> bool:
        """Drop repeats (seq already seen for this choice); note gaps."""
        expected = self._next_seq.get(event.index, 0)
        if event.seq < expected:
            self.duplicates_dropped += 1
            return False
        if event.seq > expected:
            log.warning("%s choice %d: seq gap %d..%d", self.request_id, event.index,
                        expected, event.seq - 1)
        self._next_seq[event.index] = event.seq + 1
        return True

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._dispatcher.close(self.request_id, cancel=self._unfinished > 0)
