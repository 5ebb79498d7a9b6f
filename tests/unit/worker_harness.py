"""A worker built by :func:`workers.assembly.build_worker` around a scripted FakeEngine.

Jobs go in through JobQueue exactly as the gateway submits them; what the worker
writes back is read straight off the gateway's reply stream. What a test needs to
control is injected (timing of the loops, journal scripts that fail, the table of
recent cancels), never patched into the worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import msgspec
import redis.asyncio as aioredis

from shared.connections.connect import db_of
from shared.errors import EngineDead
from shared.protocol import (
    FINAL_EVENTS,
    CancelCommand,
    EmbeddingEvent,
    ErrorEvent,
    Event,
    FinishEvent,
    GenerateJob,
    Job,
    SamplingOptions,
    TokenEvent,
    decode_events,
    encode_bytes,
)
from shared.queue import names
from shared.queue.job_queue import JobQueue, JobStream
from shared.roles import Role
from shared.settings import Settings
from shared.tasks import cancel_and_wait
from tests.conftest import RedisTarget
from tests.waiting import eventually
from workers.assembly import Timing, WorkerPolicy, build_worker
from workers.engines.base import EngineInfo, Handoff, PromptTokenStats, StepOutput
from workers.intake.recent_cancels import RecentCancels
from workers.journal.run_journal import RunJournal, unpack_tokens
from workers.journal.scripts import JournalScripts
from workers.roles import generate
from workers.roles.base import RoleParts
from workers.runtime import WorkerRuntime

MODEL = "fake-model"
STAGE = Role.AGGREGATED
JOBS = JobStream(MODEL, STAGE)
STREAM = JOBS.name
GATEWAY = "gw-test"
REPLY = names.reply_stream(GATEWAY)

TEST_POLICY = dataclasses.replace(
    WorkerPolicy.from_settings(Settings()),
    max_slots=8,
    heartbeat_ttl_s=3.0,
    canary_idle_s=3600.0,
    job_read_block_ms=50,
    shutdown_grace_s=0.0,
)
FAST_JANITOR = Timing(janitor_s=0.02)
"""Reclaim abandoned jobs within ~0.1 s (the janitor runs every 0.5 s otherwise)."""


def run_keys(job_id: str) -> tuple[str, str]:
    """The run hash and emitted-token log of ``job_id`` at this stage."""
    return names.job_run(job_id, STAGE), names.job_emitted(job_id, STAGE)


async def entries(redis: aioredis.Redis, stream: str) -> list[tuple[bytes, dict[bytes, bytes]]]:
    found: list[tuple[bytes, dict[bytes, bytes]]] = cast(Any, await redis.xrange(stream))
    return found


async def emitted_tokens(redis: aioredis.Redis, job_id: str) -> list[int]:
    data: bytes | None = cast(Any, await redis.get(names.job_emitted(job_id, STAGE)))
    return unpack_tokens(data or b"")


class FakeEngine:
    """A GenerateEngine and EmbedEngine with scripted outputs.

    Each sequence yields ``tokens`` tokens (``tokens_per_step`` a step, ``step_s`` apart),
    or fewer when ``max_tokens`` is smaller; ``fail`` raises at a given step.
    Cancellation of the consuming task lands inside ``generate`` and is counted.
    """

    def __init__(self, *, tokens: int = 4, step_s: float = 0.005, tokens_per_step: int = 1) -> None:
        self.info = EngineInfo(model=MODEL, max_model_len=256)
        self.prompt_stats = PromptTokenStats()
        self.tokens = tokens
        self.tokens_per_step = tokens_per_step
        self.step_s = step_s
        self.fail: tuple[int, BaseException] | None = None
        self.dead = False
        """check_health raises EngineDead once this is set."""
        self.requests: list[tuple[str, list[int], SamplingOptions]] = []
        self.handoffs: list[Handoff | None] = []
        self.adapters_used: list[str | None] = []
        self.started: list[str] = []
        self.completed: list[str] = []
        self.cancelled: list[str] = []
        self.aborted: list[str] = []
        self.peak = 0
        self._running: set[str] = set()

    async def generate(
        self,
        job_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        *,
        handoff: Handoff | None = None,
        images: object = None,
        adapter: str | None = None,
    ) -> AsyncIterator[StepOutput]:
        self.requests.append((job_id, list(prompt_token_ids), sampling))
        self.adapters_used.append(adapter)
        self.handoffs.append(handoff)
        self.started.append(job_id)
        self._running.add(job_id)
        self.peak = max(self.peak, len(self._running))
        try:
            count = min(self.tokens, sampling.max_tokens)
            starts = range(0, count, self.tokens_per_step)
            for step, first in enumerate(starts):
                await asyncio.sleep(self.step_s)
                if self.fail is not None and self.fail[0] == step:
                    raise self.fail[1]
                positions = range(first, min(count, first + self.tokens_per_step))
                reason = None
                if step == len(starts) - 1:
                    reason = "length" if count == sampling.max_tokens else "stop"
                    self.completed.append(job_id)
                yield StepOutput(
                    token_ids=[100 + n for n in positions],
                    text="".join(f"<{n}>" for n in positions),
                    logprobs=None,
                    finish_reason=reason,
                    prompt_tokens=len(prompt_token_ids),
                )
        except (asyncio.CancelledError, GeneratorExit):
            # Closing the generator after its final step is not a cancellation.
            if job_id not in self.completed:
                self.cancelled.append(job_id)
            raise
        finally:
            self._running.discard(job_id)

    async def embed(
        self, job_id: str, prompt_token_ids: list[int], *, dimensions: int | None = None
    ) -> list[float]:
        """The prompt's token ids as floats (truncated to ``dimensions``)."""
        self.started.append(job_id)
        await asyncio.sleep(self.step_s)
        if self.fail is not None:
            raise self.fail[1]
        self.completed.append(job_id)
        vector = [float(t) for t in prompt_token_ids]
        return vector[:dimensions] if dimensions else vector

    async def abort(self, job_id: str) -> None:
        self.aborted.append(job_id)

    async def check_health(self) -> None:
        if self.dead:
            raise EngineDead("the engine process exited")

    def running(self) -> int:
        return len(self._running)

    def shutdown(self) -> None:
        return None


def make_job(
    request_id: str,
    index: int = 0,
    *,
    max_tokens: int = 16,
    deadline_in_s: float = 60.0,
    reply_to: str = REPLY,
) -> GenerateJob:
    now = time.time()
    return GenerateJob(
        request_id=request_id,
        index=index,
        model=MODEL,
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingOptions(max_tokens=max_tokens),
        reply_to=reply_to,
        deadline_unix=now + deadline_in_s,
        created_unix=now,
    )


def with_sampling(job: GenerateJob, **changes: Any) -> GenerateJob:
    return msgspec.structs.replace(job, sampling=msgspec.structs.replace(job.sampling, **changes))


@dataclass
class Harness:
    redis: aioredis.Redis
    """The test's own client (the 'gateway')."""
    engine: FakeEngine
    runtime: WorkerRuntime
    task: asyncio.Task[None]
    queue: JobQueue
    recent_cancels: RecentCancels
    stream: str = STREAM

    async def submit(self, *jobs: Job) -> None:
        result = await self.queue.submit(self.stream, list(jobs), max_depth=1000)
        assert result.outcome.value == "queued", result

    async def events(self, request_id: str) -> list[Any]:
        """The events of ``request_id`` on the reply stream (Any: tests read any field)."""
        found: list[Any] = []
        for _, fields in await entries(self.redis, REPLY):
            for event in decode_events(fields):
                if (
                    isinstance(event, TokenEvent | FinishEvent | ErrorEvent | EmbeddingEvent)
                    and event.request_id == request_id
                ):
                    found.append(event)
        return found

    async def final_events(
        self, request_id: str, *, sequences: int = 1, timeout_s: float = 5.0
    ) -> list[Event]:
        """All events of ``request_id`` once each of its sequences has ended."""

        async def ended() -> bool:
            events = await self.events(request_id)
            return sum(isinstance(e, FINAL_EVENTS) for e in events) >= sequences

        await eventually(ended, timeout_s=timeout_s, what=f"the end of {request_id}")
        return await self.events(request_id)

    async def drained(self, *, timeout_s: float = 5.0) -> None:
        """The job stream is empty: every entry was acked and deleted."""

        async def empty() -> bool:
            pending = await self.redis.xpending(self.stream, names.JOB_GROUP)
            return await self.redis.xlen(self.stream) == 0 and pending["pending"] == 0

        await eventually(empty, timeout_s=timeout_s, what="the job stream to drain")

    async def publish_control(self, data: bytes) -> None:
        await self.redis.publish(self._control_channel(), data)

    async def listening(self) -> None:
        """The worker's cancel listener is subscribed to the command channel."""

        async def subscribed() -> bool:
            [(_, count)] = await self.redis.pubsub_numsub(self._control_channel())
            return int(count) >= 1

        await eventually(subscribed, what="the cancel listener to subscribe")

    async def cancel(self, request_id: str) -> None:
        """Send a client's cancel command and wait until the worker heard it."""
        await self.listening()
        await self.publish_control(encode_bytes(CancelCommand(request_id)))

        async def heard() -> bool:
            return self.recent_cancels.holds(request_id)

        await eventually(heard, what=f"the worker to hear the cancel of {request_id}")

    def _control_channel(self) -> str:
        return names.command_channel(db_of(self.redis))


async def stop_task(task: asyncio.Task[Any], *, within_s: float = 5.0) -> None:
    deadline = time.monotonic() + within_s
    while not task.done() and time.monotonic() < deadline:
        task.cancel()
        await asyncio.wait({task}, timeout=0.2)
    assert task.done(), f"{task.get_name()} ignored cancellation"


@contextlib.asynccontextmanager
async def worker(
    target: RedisTarget,
    engine: FakeEngine | None = None,
    *,
    gateway_alive: bool = True,
    fresh: bool = True,
    setup: Callable[[aioredis.Redis], Awaitable[None]] | None = None,
    worker_id: str = "w-test",
    role: Role = STAGE,
    parts: Callable[[FakeEngine], RoleParts] | None = None,
    timing: Timing = Timing(),  # noqa: B008 (frozen)
    scripts: Callable[[aioredis.Redis], JournalScripts] | None = None,
    **policy: Any,
) -> AsyncIterator[Harness]:
    """A running worker; ``fresh`` empties the database before and after.

    ``setup`` runs on the test's client before the worker starts reading; ``parts``
    gives the role's parts for the engine (default: the generate role's).
    """
    if fresh:
        await target.flush()
    redis = target.connect()
    worker_redis = target.connect()
    engine = engine or FakeEngine()
    queue = JobQueue(redis)
    stream = names.job_stream(MODEL, role)
    await queue.ensure_group(stream)
    if gateway_alive:
        await redis.set(names.gateway_heartbeat(GATEWAY), b"1")
    if setup is not None:
        await setup(redis)
    recent = RecentCancels()
    runtime = build_worker(
        worker_id=worker_id,
        role=role,
        model=MODEL,
        parts=(parts or (lambda e: generate.parts(e, None)))(engine),
        redis=worker_redis,
        policy=dataclasses.replace(TEST_POLICY, **policy),
        timing=timing,
        scripts=None if scripts is None else scripts(worker_redis),
        recent_cancels=recent,
    )
    task = asyncio.create_task(runtime.run(), name="worker-runtime")
    harness = Harness(redis, engine, runtime, task, queue, recent, stream)
    try:
        yield harness
        assert not task.done() or task.exception() is None, task.exception()
    finally:
        runtime.stop(immediate=True)
        done, _ = await asyncio.wait({task}, timeout=5.0)
        if not done:
            await stop_task(task)
        await worker_redis.aclose()
        if fresh:
            await target.flush()
        await redis.aclose()


async def has_events(w: Harness, request_id: str, at_least: int) -> bool:
    return len(await w.events(request_id)) >= at_least


async def earlier_run(
    redis: aioredis.Redis,
    job: GenerateJob,
    *,
    tokens: list[list[int]],
    runs: int = 1,
    hand_back: bool = False,
) -> tuple[list[TokenEvent], str]:
    """Play a worker ("w-dead") that ran ``job`` ``runs`` times; the last run streamed ``tokens``.

    Every run but the last crashed: its lease was abandoned and the next run's begin took
    the job over (as a reclaim does). The last lease is then abandoned too (the job stays
    pending to w-dead, for the janitor to reclaim: one more failed run) or handed back
    (the job is queued again; a hand-back is not a failed run). The next run's attempt is
    so ``runs - 1`` after a hand-back, else ``runs``. Returns the events the client got
    and the entry id the job has now.
    """
    queue = JobQueue(redis)
    await queue.submit(STREAM, [job], max_depth=100)
    [delivery] = await queue.read([JOBS], "w-dead", count=1, block_ms=100)
    journal = RunJournal(redis, consumer="w-dead")
    task = asyncio.create_task(journal.run())
    try:
        for _ in range(runs):
            lease = await journal.begin(delivery)
        lease.counts_chars = generate.replays(job.sampling)  # as SequenceRun does
        events = []
        for token_ids in tokens:
            text = "".join(f"<{t - 100}>" for t in token_ids)
            event = TokenEvent(
                job.request_id, job.index, lease.take_seq(), lease.attempt, token_ids, text
            )
            journal.publish(lease, event, token_ids)
            events.append(event)
        await journal.flush()
        if hand_back:
            assert await journal.hand_back(lease)
    finally:
        await cancel_and_wait([task])
    [(entry_id, _)] = await entries(redis, STREAM)
    return events, entry_id.decode()
