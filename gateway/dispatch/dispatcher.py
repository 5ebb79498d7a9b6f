"""Admission: a planned request becomes jobs on a job stream, or a refusal.

``Dispatcher.submit(plan)`` routes a :class:`~gateway.dispatch.plan.RequestPlan` (first
stage, encode in front when it has images), builds its jobs, asks the placer which
worker's own stream they should wait on (prefill and aggregated jobs: the injected
:class:`~gateway.placement.placer.Placer`; decode jobs: by load; encode and embed jobs:
the shared stream), queues them all or none (429/503/409) and returns the
:class:`~gateway.dispatch.request_handle.RequestHandle` whose events the reply router
delivers. A handle closed before its last event sends a cancel from a shielded task,
so the abort leaves even when the caller is being cancelled by a client disconnect.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from gateway.dispatch.drain_rate import DrainMeter
from gateway.dispatch.lost_admissions import Admitted, LostAdmissions
from gateway.dispatch.plan import AnyPlan, Deadline, Embedding, Generation, Resume
from gateway.dispatch.queue_watch import QueueBoard
from gateway.dispatch.refusal import Refusal, refusal_reason
from gateway.dispatch.reply_router import ReplyRouter
from gateway.dispatch.request_accounting import RequestAccounting
from gateway.dispatch.request_follow import follow
from gateway.dispatch.request_handle import RequestHandle
from gateway.dispatch.request_log import RequestLog, log_stream
from gateway.dispatch.request_tally import RequestTally
from gateway.dispatch.worker_directory import WorkerDirectory
from gateway.placement.load import LoadPlacer
from gateway.placement.placer import Placement, PlacementRequest, Placer
from shared.connections.connect import db_of
from shared.connections.retry import Backoff, retry
from shared.errors import (
    BackendUnavailable,
    ConveyorError,
    IdempotencyConflict,
    NoLiveWorker,
    Overloaded,
)
from shared.protocol import CancelCommand, EmbedJob, GenerateJob, Job, encode_bytes
from shared.queue import names
from shared.queue.job_queue import Admission, AdmissionResult, JobQueue, OpenedBy
from shared.queue.key_limits import (
    KeyLimitCounters,
    LimitKind,
    Limits,
    key_limit_error,
)
from shared.queue.liveness import hold_request
from shared.queue.lora_registry import SERVING_ROLE, adapter_stream
from shared.queue.media_store import ImageStore
from shared.queue.usage import UsageRecord
from shared.roles import Role
from shared.settings import GatewaySettings

log = logging.getLogger(__name__)

CANCEL_FLAG_TTL_S = 600


@dataclass(frozen=True, slots=True)
class AdmissionPolicy:
    queue_max_depth: int
    idempotency_ttl_s: int
    disagg_min_prompt_tokens: int
    admission_retry_s: float

    @classmethod
    def from_settings(cls, settings: GatewaySettings) -> AdmissionPolicy:
        return cls(
            queue_max_depth=settings.queue_max_depth,
            idempotency_ttl_s=settings.idempotency_ttl_s,
            disagg_min_prompt_tokens=settings.disagg_min_prompt_tokens,
            admission_retry_s=settings.admission_retry_s,
        )


class Dispatcher:
    def __init__(
        self,
        redis: aioredis.Redis,
        router: ReplyRouter,
        directory: WorkerDirectory,
        policy: AdmissionPolicy,
        *,
        images: ImageStore | None = None,
        on_usage: Callable[[UsageRecord, RequestTally], None] = lambda record, tally: None,
        placer: Placer | None = None,
        on_refused: Callable[[Refusal], None] = lambda refusal: None,
    ) -> None:
        self._redis = redis
        self._on_refused = on_refused
        self._placer = placer
        """Where prefill and aggregated jobs wait (None: placement off, all shared)."""
        self._by_load = LoadPlacer()
        self._images = images or ImageStore(redis)
        self._limit_counters = KeyLimitCounters(redis)
        self._queue = JobQueue(redis)
        self._router = router
        self._directory = directory
        self._policy = policy
        self._background: set[asyncio.Task[None]] = set()
        self._open_by_key: dict[str, set[str]] = {}
        """Each API key's open requests (to end them when the key is revoked)."""
        self._on_usage = on_usage
        self.accounting = RequestAccounting(redis, names.gateway_of_reply_stream(router.stream))
        self.drain = DrainMeter(redis)
        self.queue_board = QueueBoard(redis, self.drain)
        """Where queued streams stand (their SSE position comments)."""
        self.lost = LostAdmissions(
            redis, router, self.accounting.gateway_id, self._readmit, self._in_background
        )

    async def _admit(
        self,
        stream: str,
        jobs: Sequence[Job],
        plan: AnyPlan,
        opened: OpenedBy | None = None,
        placed_on: str | None = None,
    ) -> AdmissionResult:
        """Admission that rides out a short Redis outage (a restart takes about a second)."""
        return await retry(
            lambda: self._queue.submit(
                stream,
                jobs,
                max_depth=self._policy.queue_max_depth,
                idempotency_key=plan.idempotency_key,
                idempotency_owner=plan.key_id,
                idempotency_ttl_s=self._policy.idempotency_ttl_s,
                charge=plan.charge,
                opened=opened,
                placed_on=placed_on,
            ),
            for_s=self._policy.admission_retry_s,
            backoff=Backoff(first_s=0.1, max_s=1.0),
            what=f"admission of {jobs[0].request_id}",
            retry_on=(RedisConnectionError, RedisTimeoutError),
        )

    async def check_limits(self, key_id: str | None, limits: Limits, model: str) -> None:
        """Refuse a key already over its limits (the 429 admission would give) in one
        read, before any work is spent on its request; admission still counts the exact
        charge atomically. A Redis error here leaves the decision to admission."""
        if key_id is None or not limits.any():
            return
        try:
            over = await self._limit_counters.over(key_id, limits, time.time())
        except RedisError as exc:
            log.warning("could not pre-check the limits of key %s: %s", key_id, exc)
            return
        if over is not None:
            kind, usage = over
            self._on_refused(Refusal(model, "limited", key_id, kind.value))
            raise key_limit_error(usage, kind)

    async def submit(self, plan: AnyPlan) -> RequestHandle:
        """Queue the plan's jobs (all or none) and return the handle of their events;
        raises NoLiveWorker (503), Overloaded (429), IdempotencyConflict (409) or
        BackendUnavailable (503). The plan's stored images are released if it is refused
        (or the caller is cancelled), and when its handle closes otherwise."""
        work = plan.work
        try:
            placement = None
            if isinstance(work, Embedding):
                stream, jobs = self._embed_jobs(plan, work)
            else:
                stream, role, jobs = self._generate_jobs(plan, work)
                placement = self._place(plan, work, role)
                if placement is not None and placement.cached_tokens:
                    jobs = _expecting_cached(jobs, placement.cached_tokens)
            return await self._enqueue(stream, jobs, plan, placement)
        except BaseException as exc:
            self.release_images(plan)
            reason = refusal_reason(exc)
            if reason is not None:
                self._on_refused(Refusal(plan.model, reason))
            raise

    def release_images(self, plan: AnyPlan) -> None:
        """The plan no longer holds its stored images (deleted when no one else does; in
        the background, so it survives the caller's cancellation; their TTL is the
        fallback when Redis cannot be reached)."""
        if isinstance(plan.work, Generation) and plan.work.images:
            digests = [image.digest for image in plan.work.images]
            self._in_background(self._release_images(plan.request_id, digests))

    async def _release_images(self, request_id: str, digests: list[str]) -> None:
        try:
            await self._images.release(digests)
        except RedisError as exc:
            log.warning("could not release the images of %s: %s", request_id, exc)

    def _place(self, plan: AnyPlan, work: Generation, role: Role) -> Placement | None:
        """Where the jobs of a stage in ``role`` wait (None: placement off, or a role whose
        jobs always wait on the shared stream)."""
        if self._placer is None:
            return None
        if role in (Role.PREFILL, Role.AGGREGATED):
            placer = self._placer
        elif role is Role.DECODE:
            placer = self._by_load  # no prompt to match: a decode job goes by load
        else:
            return None  # encode: the embedding cache is keyed by image, not by worker
        request = PlacementRequest(
            model=plan.served_by,
            role=role,
            lora=plan.adapter,
            prompt_token_ids=work.choices[0].prompt_token_ids,
            cache_key=plan.cache_key,
        )
        candidates = self._directory.candidates(plan.served_by, role, plan.adapter)
        placement = placer.place(request, candidates)
        log.debug(
            "placement of %s (%s, %s): %s on %s (%d blocks matched, %d candidates)",
            plan.request_id,
            plan.model,
            role,
            placement.reason,
            placement.worker_id or "the shared stream",
            placement.matched_blocks,
            len(candidates),
        )
        return placement

    def _generate_jobs(self, plan: AnyPlan, work: Generation) -> tuple[str, Role, list[Job]]:
        """One job per choice, on the stream of the request's first stage (and its role)."""
        stream, role, after_encode = self._first_stream(plan, work)
        jobs: list[Job] = [
            GenerateJob(
                request_id=plan.request_id,
                index=choice.index,
                model=plan.model,
                prompt_token_ids=choice.prompt_token_ids,
                sampling=choice.sampling,
                reply_to=self._reply_to(plan),
                deadline_unix=plan.deadline.deadline_unix,
                created_unix=plan.deadline.created_unix,
                images=work.images,
                after_encode=after_encode,
                adapter=plan.adapter,
                traceparent=plan.traceparent,
            )
            for choice in work.choices
        ]
        return stream, role, jobs

    def _reply_to(self, plan: AnyPlan) -> str:
        """This gateway's reply stream, or a resumable request's own (its log)."""
        return self._router.stream if plan.resume is None else log_stream(plan.request_id)

    def _first_stream(self, plan: AnyPlan, work: Generation) -> tuple[str, Role, Role | None]:
        """The stream of the first stage, its role, and the stage after encode (if it is
        encode)."""
        if plan.adapter is not None:  # its own stream, read by the workers that loaded it
            if not self._directory.adapter_ready(plan.adapter):
                raise NoLiveWorker(
                    f"LoRA adapter `{plan.adapter}` is not loaded on any live worker right "
                    "now; retry shortly",
                    retry_after_s=5,
                )
            return adapter_stream(plan.adapter), SERVING_ROLE, None
        role = self._directory.first_stage(
            plan.model, work.longest_prompt(), self._policy.disagg_min_prompt_tokens
        )
        if role is None:
            raise NoLiveWorker(
                f"no live worker serves model `{plan.model}` right now; retry shortly",
                retry_after_s=5,
            )
        # With an encode pool, images go through it first; without, the language
        # worker takes the raw images itself.
        if work.images and self._directory.serving(plan.model, Role.ENCODE):
            return names.job_stream(plan.model, Role.ENCODE), Role.ENCODE, role
        return names.job_stream(plan.model, role), role, None

    def _embed_jobs(self, plan: AnyPlan, work: Embedding) -> tuple[str, list[Job]]:
        """One embedding job per input, on the model's embed stream."""
        if not self._directory.serving(plan.model, Role.EMBED):
            raise NoLiveWorker(
                f"no live embedding worker serves model `{plan.model}` right now; retry shortly",
                retry_after_s=5,
            )
        jobs: list[Job] = [
            EmbedJob(
                request_id=plan.request_id,
                index=index,
                model=plan.model,
                prompt_token_ids=prompt,
                reply_to=self._router.stream,
                deadline_unix=plan.deadline.deadline_unix,
                created_unix=plan.deadline.created_unix,
                dimensions=work.dimensions,
                traceparent=plan.traceparent,
            )
            for index, prompt in enumerate(work.prompts)
        ]
        return names.job_stream(plan.model, Role.EMBED), jobs

    async def _enqueue(
        self, stream: str, jobs: list[Job], plan: AnyPlan, placement: Placement | None
    ) -> RequestHandle:
        """Queue all of ``jobs`` (one request) on ``stream``'s pool (on the placed worker's
        own stream when ``placement`` names one) and open the route for their events."""
        request_id = plan.request_id
        self.drain.watch(stream)
        placed_on = placement.worker_id if placement is not None else None
        if plan.resume is not None:
            return await self._enqueue_resumable(stream, jobs, plan, plan.resume, placement)
        events = self._router.open(request_id)
        try:
            opened = self.accounting.opened_by(plan)
            result = await self._admit(stream, jobs, plan, opened, placed_on)
        except RedisError as exc:
            self._router.close(request_id)
            log.warning("the job queue is unreachable: %s", exc)
            raise BackendUnavailable("the job queue is unreachable; retry") from exc
        if result.outcome is not Admission.QUEUED:
            self._router.close(request_id)
        headers = self._admitted(result, stream, jobs, plan)
        self._note_placed(result, placement, jobs)
        self.accounting.opened(plan)
        if plan.key_id is not None:
            self._open_by_key.setdefault(plan.key_id, set()).add(request_id)
        handle = RequestHandle(
            request_id,
            len(jobs),
            events,
            plan.deadline,
            on_close=lambda cancel: self._finish(plan, handle, cancel=cancel),
            headers=headers,
        )
        if isinstance(plan.work, Generation):
            handle.tally.choices_per_prompt = plan.work.choices_per_prompt
        self.lost.watch(Admitted(stream, jobs, plan, handle))
        return handle

    def _admitted(
        self, result: AdmissionResult, stream: str, jobs: list[Job], plan: AnyPlan
    ) -> dict[str, str]:
        """Raise the refusal of ``result``, or log the request queued; its headers."""
        headers = result.usage.headers() if result.usage is not None else {}
        if result.outcome is not Admission.QUEUED:
            if result.outcome is Admission.LIMITED and result.usage is not None:
                kind = LimitKind(result.detail)
                self._on_refused(Refusal(plan.model, "limited", plan.key_id, kind.value))
                raise key_limit_error(result.usage, kind)
            retry_after = 1
            if result.outcome is Admission.FULL:
                excess = int(result.detail) + len(jobs) - self._policy.queue_max_depth
                retry_after = self.drain.retry_after_s(stream, excess)
            _raise_refusal(result.outcome, result.detail, plan.model, retry_after)
        log.debug("queued %s: %d sequence(s) for %s", plan.request_id, len(jobs), plan.model)
        return headers

    def _note_placed(
        self, result: AdmissionResult, placement: Placement | None, jobs: list[Job]
    ) -> None:
        """Count the jobs on the worker they were placed on until its next load report: their
        prompt tokens that worker has not cached are its queued prefill."""
        if result.placed_on is not None:
            prompt_tokens = sum(job.uncached_tokens for job in jobs)
            self._directory.note_placed(result.placed_on, len(jobs), prompt_tokens)
        elif placement is not None and placement.worker_id is not None:
            log.debug(
                "%s went to the shared stream: worker %s had left",
                jobs[0].request_id,
                placement.worker_id,
            )

    async def _enqueue_resumable(
        self,
        stream: str,
        jobs: list[Job],
        plan: AnyPlan,
        resume: Resume,
        placement: Placement | None,
    ) -> RequestHandle:
        """Queue a resumable request: its log and lease first (a worker checks the lease
        when it takes a job), then its jobs; its first reader follows its log."""
        try:
            await RequestLog(self._redis, plan.request_id).open(
                plan.deadline.remaining_s() + resume.keep_s
            )
            await hold_request(self._redis, plan.request_id, resume.holder, resume.lease_s)
            opened = self.accounting.opened_by(plan)
            placed_on = placement.worker_id if placement is not None else None
            result = await self._admit(stream, jobs, plan, opened, placed_on)
        except RedisError as exc:
            log.warning("the job queue is unreachable: %s", exc)
            raise BackendUnavailable("the job queue is unreachable; retry") from exc
        headers = self._admitted(result, stream, jobs, plan)
        self._note_placed(result, placement, jobs)
        handle = self.follow(plan.request_id, len(jobs), plan.deadline, resume)
        handle.headers.update(headers)
        return handle

    def follow(
        self,
        request_id: str,
        sequences: int,
        deadline: Deadline,
        resume: Resume,
        *,
        after: str = "0-0",
    ) -> RequestHandle:
        """A reader of a resumable request's events (request_follow.py): closing it never
        cancels the request."""
        return follow(
            self._redis, request_id, sequences, deadline, resume, self._in_background, after=after
        )

    def cancel(self, request_id: str) -> None:
        """Cancel a request on the workers (from a task that outlives the caller)."""
        self._in_background(self._send_cancel(request_id))

    async def _readmit(self, request: Admitted) -> AdmissionResult:
        plan = request.plan
        opened = self.accounting.opened_by(plan)
        return await self._admit(request.stream, request.jobs, plan, opened)

    def _finish(self, plan: AnyPlan, handle: RequestHandle, *, cancel: bool) -> None:
        """The request ended (its handle's owner left): close its route, cancel what still
        runs, settle its key's limits and write its usage row (in the background)."""
        self.close(plan.request_id, cancel=cancel)
        self.release_images(plan)
        if _stores_schema(plan):
            self._in_background(self._forget_schema(plan.request_id))
        if plan.key_id is not None:
            open_of_key = self._open_by_key.get(plan.key_id, set())
            open_of_key.discard(plan.request_id)
            if not open_of_key:
                self._open_by_key.pop(plan.key_id, None)
        record = handle.tally.record(plan, plan.key_id, cancelled=cancel)
        used = handle.tally.used_tokens()
        self._on_usage(record, handle.tally)
        self._in_background(self.accounting.settle(plan, record, used))

    def end_requests_of(self, key_ids: Iterable[str], error: ConveyorError) -> int:
        """End the open requests of these API keys with ``error`` (a stream gets it as its
        last event); each one's handle then closes and cancels what still runs."""
        ended = [rid for key_id in key_ids for rid in self._open_by_key.get(key_id, ())]
        self._router.interrupt(ended, error.message, error)
        return len(ended)

    def close(self, request_id: str, *, cancel: bool) -> None:
        self._router.close(request_id)
        self.lost.forget(request_id)
        if cancel:
            self._in_background(self._send_cancel(request_id))

    def _in_background(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` in its own task: it survives the caller's cancellation (a client
        disconnect), and the lifespan waits for it at shutdown."""
        task = asyncio.get_running_loop().create_task(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _send_cancel(self, request_id: str, *, retry_for_s: float = 30.0) -> None:
        async def send() -> None:
            async with self._redis.pipeline(transaction=False) as pipe:
                pipe.set(names.cancel_flag(request_id), b"1", ex=CANCEL_FLAG_TTL_S)
                pipe.publish(
                    names.command_channel(db_of(self._redis)),
                    encode_bytes(CancelCommand(request_id)),
                )
                await pipe.execute()

        try:
            await retry(
                send,
                for_s=retry_for_s,
                backoff=Backoff(first_s=0.5, max_s=0.5),
                what=f"cancel of {request_id}",
            )
        except RedisError as exc:
            log.warning("could not send cancel for %s: %s", request_id, exc)
            return
        log.info("cancel sent for %s", request_id)

    async def _forget_schema(self, request_id: str) -> None:
        """The request's stored JSON schema, deleted once it has ended (its TTL is the
        fallback when this fails)."""
        try:
            await self._redis.delete(names.json_schema(request_id))
        except RedisError as exc:
            log.warning("could not delete the JSON schema of %s: %s", request_id, exc)

    async def wait_background(self) -> None:
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)


def _stores_schema(plan: AnyPlan) -> bool:
    work = plan.work
    return isinstance(work, Generation) and work.choices[0].sampling.json_schema is not None


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


def _expecting_cached(jobs: list[Job], cached_tokens: int) -> list[Job]:
    """The jobs, each telling the worker it was placed on how much of its prompt that
    worker holds (its queued prefill then counts only the rest)."""
    return [
        msgspec.structs.replace(job, cached_tokens=cached_tokens)
        if isinstance(job, GenerateJob)
        else job
        for job in jobs
    ]
