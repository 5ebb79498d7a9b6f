"""A fake worker for the in-process gateway: the real job queue in, the real protocol out.

It reads its job stream through :class:`shared.queue.job_queue.JobQueue` (consumer group,
decoding) and answers each job by playing a *script*: batches of events, each
written as ONE reply-stream entry holding a MessagePack array of events
(:func:`shared.protocol.encode_events`), the way ``workers/journal/run_journal.py`` writes one
engine step. A script may sleep between batches, repeat or skip ``seq`` numbers,
fail mid-stream, or never answer at all.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
from collections.abc import AsyncIterator, Callable, Sequence

import redis.asyncio as aioredis

from shared.errors import ConveyorError
from shared.protocol import (
    EmbeddingEvent,
    EmbedJob,
    ErrorEvent,
    Event,
    FinishEvent,
    GenerateJob,
    Job,
    TokenEvent,
    encode_events,
)
from shared.queue.job_queue import JobQueue, JobStream
from shared.roles import Role
from shared.tasks import cancel_and_wait

Script = Callable[[Job], AsyncIterator[Sequence[Event]]]
"""A job's answer: batches of events, one reply-stream entry each."""


def token(job: Job, seq: int, text: str, token_id: int = 7) -> TokenEvent:
    return TokenEvent(job.request_id, job.index, seq, 0, [token_id], text)


def finish(job: Job, seq: int, completion_tokens: int, reason: str = "stop") -> FinishEvent:
    return FinishEvent(
        job.request_id, job.index, seq, 0, reason, len(job.prompt_token_ids), completion_tokens
    )


def error(job: Job, seq: int, exc: ConveyorError) -> ErrorEvent:
    return ErrorEvent(
        job.request_id, job.index, seq, 0, exc.status, exc.type, exc.code, exc.message, exc.param
    )


def vector(job: Job, values: list[float]) -> EmbeddingEvent:
    data = struct.pack(f"<{len(values)}f", *values)
    return EmbeddingEvent(job.request_id, job.index, 0, 0, data, len(job.prompt_token_ids))


async def echo(job: Job) -> AsyncIterator[Sequence[Event]]:
    """Embeddings: the vector [index, prompt length]. Generation: ``c{index}-{i}`` for
    i < max_tokens, two tokens per step, then ``length``."""
    if isinstance(job, EmbedJob):
        yield [vector(job, [float(job.index), float(len(job.prompt_token_ids))])]
        return
    max_tokens = job.sampling.max_tokens
    events: list[Event] = [token(job, i, f"c{job.index}-{i} ") for i in range(max_tokens)]
    for start in range(0, max_tokens, 2):
        yield events[start : start + 2]
    yield [finish(job, max_tokens, max_tokens, "length")]


async def silent(job: Job) -> AsyncIterator[Sequence[Event]]:
    """A worker that takes the job and never answers."""
    await asyncio.Event().wait()
    yield []


class FakeWorker:
    def __init__(self, redis: aioredis.Redis, model: str, role: Role, script: Script) -> None:
        self._redis = redis
        self._queue = JobQueue(redis)
        self._stream = JobStream(model, role)
        self.script = script
        """Replace it to change how the jobs read from now on are answered."""
        self.jobs: list[Job] = []
        self.task: asyncio.Task[None] | None = None
        self._answers: set[asyncio.Task[None]] = set()
        self._stopping = False

    async def start(self) -> None:
        await self._queue.ensure_group(self._stream.name)
        self.task = asyncio.create_task(self._run(), name=f"fake-worker-{self._stream.name}")

    async def stop(self) -> None:
        """Stop reading: no job queued after this returns is taken.

        Not a cancel: fakeredis runs a blocking XREADGROUP in a task of its own that
        outlives its cancelled caller, and would still deliver a job added within the
        block window to this consumer, which never answers it.
        """
        self._stopping = True
        if self.task is not None:
            await self.task

    async def _run(self) -> None:
        try:
            while not self._stopping:
                deliveries = await self._queue.read(
                    [self._stream], "fake-worker", count=64, block_ms=20
                )
                for delivery in deliveries:
                    self.jobs.append(delivery.job)
                    await self._queue.ack(delivery.stream, delivery.entry_id)
                    answer = asyncio.create_task(self._answer(delivery.job))
                    self._answers.add(answer)
                    answer.add_done_callback(self._answers.discard)
        finally:
            await cancel_and_wait(self._answers)

    async def _answer(self, job: Job) -> None:
        with contextlib.suppress(asyncio.CancelledError):
            async for batch in self.script(job):
                if batch:
                    await self._redis.xadd(job.reply_to, encode_events(list(batch)))  # type: ignore[arg-type]

    def generate_jobs(self) -> list[GenerateJob]:
        return [job for job in self.jobs if isinstance(job, GenerateJob)]
