"""WorkerRuntime driven by a scripted FakeEngine, on fakeredis and on the real Redis.

Jobs go in through JobQueue exactly as the gateway submits them; what the
runtime writes back is read straight off the gateway's reply stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, cast

import msgspec
import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from shared import keys
from shared.errors import EngineDead, EngineError
from shared.job_queue import JobQueue
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
    decode,
    decode_events,
    encode_bytes,
)
from shared.redis_conn import db_of
from shared.tasks import cancel_and_wait
from tests.conftest import RedisTarget
from workers import runtime as runtime_module
from workers.canary import Canary
from workers.engines.base import EngineInfo, Handoff, PromptTokenStats, StepOutput
from workers.journal import RunJournal, unpack_tokens
from workers.runtime import WorkerPolicy, WorkerRuntime

MODEL = "fake-model"
STAGE = "aggregated"
STREAM = keys.job_stream(MODEL, STAGE)


def run_keys(job_id: str) -> tuple[str, str]:
    """The run hash and emitted-token log of ``job_id`` at this stage."""
    return keys.job_run(job_id, STAGE), keys.job_emitted(job_id, STAGE)


async def entries(redis: aioredis.Redis, stream: str) -> list[tuple[bytes, dict[bytes, bytes]]]:
    found: list[tuple[bytes, dict[bytes, bytes]]] = cast(Any, await redis.xrange(stream))
    return found


async def emitted_tokens(redis: aioredis.Redis, job_id: str) -> list[int]:
    data: bytes | None = cast(Any, await redis.get(keys.job_emitted(job_id, STAGE)))
    return unpack_tokens(data or b"")


GATEWAY = "gw-test"
REPLY = keys.reply_stream(GATEWAY)


class FakeEngine:
    """Implements workers.engines.base.Engine with scripted outputs.

    Each sequence yields ``tokens`` steps (one token each, ``step_s`` apart), or
    fewer when ``max_tokens`` is smaller; ``fail`` raises at a given step.
    Cancellation of the consuming task lands inside ``generate`` and is counted.
    """

    def __init__(self, *, tokens: int = 4, step_s: float = 0.005) -> None:
        self.info = EngineInfo(model=MODEL, max_model_len=256)
        self.prompt_stats = PromptTokenStats()
        self.tokens = tokens
        self.step_s = step_s
        self.fail: tuple[int, BaseException] | None = None
        self.dead = False
        """check_health raises EngineDead once this is set."""
        self.requests: list[tuple[str, list[int], SamplingOptions]] = []
        self.handoffs: list[Handoff | None] = []
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
    ) -> AsyncIterator[StepOutput]:
        self.requests.append((job_id, list(prompt_token_ids), sampling))
        self.handoffs.append(handoff)
        self.started.append(job_id)
        self._running.add(job_id)
        self.peak = max(self.peak, len(self._running))
        try:
            steps = min(self.tokens, sampling.max_tokens)
            for step in range(steps):
                await asyncio.sleep(self.step_s)
                if self.fail is not None and self.fail[0] == step:
                    raise self.fail[1]
                reason = None
                if step == steps - 1:
                    reason = "length" if steps == sampling.max_tokens else "stop"
                    self.completed.append(job_id)
                yield StepOutput(
                    token_ids=[100 + step],
                    text=f"<{step}>",
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

    def plan_handoff(self, job_id: str) -> Handoff | None:
        return None

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

    async def prefill(
        self,
        job_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        *,
        handoff: Handoff | None = None,
        images: object = None,
    ) -> Handoff:
        raise NotImplementedError("the aggregated role never prefills")

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


async def eventually(
    check: Callable[[], Awaitable[bool]], *, timeout_s: float = 5.0, what: str = "condition"
) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.01)


@dataclass
class Harness:
    redis: aioredis.Redis
    """The test's own client (the 'gateway')."""
    engine: FakeEngine
    runtime: WorkerRuntime
    task: asyncio.Task[None]
    queue: JobQueue
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
            pending = await self.redis.xpending(self.stream, keys.JOB_GROUP)
            return await self.redis.xlen(self.stream) == 0 and pending["pending"] == 0

        await eventually(empty, timeout_s=timeout_s, what="the job stream to drain")

    async def publish_control(self, data: bytes) -> None:
        await self.redis.publish(keys.control_channel(db_of(self.redis)), data)


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
    role: str = STAGE,
    **policy: Any,
) -> AsyncIterator[Harness]:
    """A running WorkerRuntime; ``fresh`` empties the database before and after.

    ``setup`` runs on the test's client before the runtime starts reading.
    """
    if fresh:
        await target.flush()
    redis = target.connect()
    worker_redis = target.connect()
    engine = engine or FakeEngine()
    queue = JobQueue(redis)
    stream = keys.job_stream(MODEL, role)
    await queue.ensure_group(stream)
    if gateway_alive:
        await redis.set(keys.gateway_heartbeat(GATEWAY), b"1")
    if setup is not None:
        await setup(redis)
    policy.setdefault("max_slots", 8)
    policy.setdefault("heartbeat_ttl_s", 3.0)
    policy.setdefault("canary_idle_s", 3600.0)
    policy.setdefault("read_block_ms", 50)
    policy.setdefault("shutdown_grace_s", 0.0)
    runtime = WorkerRuntime(
        worker_id=worker_id,
        role=role,
        streams=[stream],
        engine=engine,
        redis=worker_redis,
        policy=WorkerPolicy(**policy),
    )
    task = asyncio.create_task(runtime.run(), name="worker-runtime")
    harness = Harness(redis, engine, runtime, task, queue, stream)
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


# --------------------------------------------------------------------------- tests


async def test_job_streams_tokens_then_finish_and_is_acked(redis_target: RedisTarget) -> None:
    async with worker(redis_target, FakeEngine(tokens=4)) as w:
        await w.submit(make_job("r1", max_tokens=16))
        events = await w.final_events("r1")
        *tokens, finish = events
        assert [type(e) for e in tokens] == [TokenEvent] * 4
        assert [e.seq for e in events] == [0, 1, 2, 3, 4]
        assert [e.token_ids for e in tokens] == [[100], [101], [102], [103]]  # type: ignore[union-attr]
        assert "".join(e.text for e in tokens) == "<0><1><2><3>"  # type: ignore[union-attr]
        assert finish == FinishEvent("r1", 0, 4, 0, "stop", 3, 4)
        await w.drained()
        assert w.engine.running() == 0
        assert w.engine.started == ["r1/0"]
        # Nothing of the finished run is left behind.
        assert await w.redis.exists(*run_keys("r1/0")) == 0


async def test_max_tokens_gives_length(redis_target: RedisTarget) -> None:
    async with worker(redis_target, FakeEngine(tokens=50)) as w:
        await w.submit(make_job("r1", max_tokens=3))
        events = await w.final_events("r1")
        assert len(events) == 4
        assert isinstance(events[-1], FinishEvent)
        assert events[-1].finish_reason == "length"
        assert events[-1].completion_tokens == 3
        await w.drained()


async def test_choices_of_one_request_are_numbered_separately(redis_target: RedisTarget) -> None:
    async with worker(redis_target, FakeEngine(tokens=3)) as w:
        await w.submit(*(make_job("r1", index) for index in range(3)))
        events = await w.final_events("r1", sequences=3)
        for index in range(3):
            mine = [e for e in events if e.index == index]
            assert [e.seq for e in mine] == [0, 1, 2, 3]
            assert isinstance(mine[-1], FinishEvent)
        await w.drained()


async def test_cancel_flag_set_before_dequeue_drops_the_job(redis_target: RedisTarget) -> None:
    async with worker(redis_target) as w:
        await w.redis.set(keys.cancel_flag("gone"), b"1")
        await w.submit(make_job("gone"), make_job("gone", 1))
        await w.submit(make_job("stays"))
        await w.final_events("stays")
        await w.drained()
        assert await w.events("gone") == []
        assert all(not job.startswith("gone/") for job in w.engine.started)


async def test_cancel_that_lands_while_the_job_is_being_leased_drops_it(
    redis_target: RedisTarget,
) -> None:
    """The cancel command arrives after the intake read no cancel flag but before the
    job's task exists: nothing was running to cancel, so the start must catch it."""
    async with worker(redis_target) as w:
        w.runtime._on_control(encode_bytes(CancelCommand("raced")))  # no flag in Redis
        await w.submit(make_job("raced"))
        await w.submit(make_job("kept"))
        await w.final_events("kept")
        await w.drained()
        assert await w.events("raced") == []
        assert all(not job.startswith("raced/") for job in w.engine.started)


async def test_job_of_a_dead_gateway_is_dropped(redis_target: RedisTarget) -> None:
    async with worker(redis_target, gateway_alive=False, gateway_grace_s=0.0) as w:
        await w.submit(make_job("orphan"))
        await w.drained()
        assert await w.events("orphan") == []
        assert w.engine.started == []


async def test_a_gateway_key_missing_for_a_moment_does_not_drop_its_job(
    redis_target: RedisTarget,
) -> None:
    """A stalled gateway or a restarted Redis must not make a live gateway's client hang."""
    async with worker(redis_target, gateway_alive=False, gateway_grace_s=60.0) as w:
        await w.submit(make_job("kept"))
        assert isinstance((await w.final_events("kept"))[-1], FinishEvent)


async def test_running_job_is_aborted_once_its_gateway_stays_gone(
    redis_target: RedisTarget,
) -> None:
    engine = FakeEngine(tokens=100_000, step_s=0.01)
    async with worker(redis_target, engine, gateway_grace_s=0.5) as w:
        await w.submit(make_job("orphaned", max_tokens=100_000))

        async def streaming() -> bool:
            return engine.running() == 1

        await eventually(streaming, what="the job to stream")
        await w.redis.delete(keys.gateway_heartbeat(GATEWAY))

        async def aborted() -> bool:
            return engine.running() == 0 and w.runtime.active_jobs() == 0

        await eventually(aborted, what="the orphaned job to be aborted", timeout_s=5.0)


async def test_cancel_command_stops_a_running_job(redis_target: RedisTarget) -> None:
    engine = FakeEngine(tokens=100_000, step_s=0.01)
    async with worker(redis_target, engine) as w:
        await w.submit(make_job("long", max_tokens=100_000), make_job("other", max_tokens=100_000))

        async def streaming() -> bool:
            return engine.running() == 2 and len(await w.events("long")) >= 2

        await eventually(streaming, what="both jobs to stream")

        async def cancelled() -> bool:
            await w.publish_control(encode_bytes(CancelCommand("long")))
            await asyncio.sleep(0.05)
            return engine.running() == 1

        await eventually(cancelled, timeout_s=5.0, what="the cancel to land")
        assert engine.cancelled == ["long/0"]

        async def long_acked() -> bool:
            return await w.redis.xlen(STREAM) == 1

        await eventually(long_acked, what="the cancelled job's ack")
        events = await w.events("long")
        assert all(isinstance(e, TokenEvent) for e in events)  # no finish, no error
        assert w.runtime.active_jobs() == 1
        # A cancel for a request this worker does not run is harmless.
        await w.publish_control(encode_bytes(CancelCommand("unknown")))
        await w.publish_control(b"9:not-a-message")
        await asyncio.sleep(0.1)
        assert engine.running() == 1
        w.runtime.cancel_request("other")
        await w.drained()
        assert engine.running() == 0


async def test_control_listener_survives_a_malformed_message(redis_target: RedisTarget) -> None:
    engine = FakeEngine(tokens=100_000, step_s=0.01)
    async with worker(redis_target, engine) as w:
        await w.submit(make_job("long", max_tokens=100_000))

        async def streaming() -> bool:
            return engine.running() == 1

        await eventually(streaming, what="the job to start")
        await w.publish_control(b"1:\x91\xaa" + b"\x00" * 9 + b"\x80")
        await asyncio.sleep(0.1)

        async def cancelled() -> bool:
            await w.publish_control(encode_bytes(CancelCommand("long")))
            await asyncio.sleep(0.05)
            return engine.running() == 0

        await eventually(cancelled, timeout_s=1.5, what="the cancel to land")


async def test_deadline_passed_in_queue_gives_504(redis_target: RedisTarget) -> None:
    async with worker(redis_target) as w:
        await w.submit(make_job("late", deadline_in_s=-1.0))
        [event] = await w.final_events("late")
        assert isinstance(event, ErrorEvent)
        assert (event.status, event.type, event.code, event.seq) == (
            504,
            "timeout",
            "deadline_exceeded",
            0,
        )
        await w.drained()
        assert w.engine.started == []


async def test_deadline_passing_while_generating_gives_504(redis_target: RedisTarget) -> None:
    engine = FakeEngine(tokens=100_000, step_s=0.01)
    async with worker(redis_target, engine) as w:
        await w.submit(make_job("slow", max_tokens=100_000, deadline_in_s=0.3))
        events = await w.final_events("slow")
        *tokens, last = events
        assert tokens and all(isinstance(e, TokenEvent) for e in tokens)
        assert isinstance(last, ErrorEvent)
        assert last.status == 504
        assert [e.seq for e in events] == list(range(len(events)))
        await w.drained()
        assert engine.running() == 0


async def test_max_slots_is_respected(redis_target: RedisTarget) -> None:
    engine = FakeEngine(tokens=5, step_s=0.01)
    async with worker(redis_target, engine, max_slots=2) as w:
        await w.submit(*(make_job(f"r{i}") for i in range(6)))

        async def all_done() -> bool:
            return len(engine.completed) == 6

        await eventually(all_done, what="six jobs")
        assert engine.peak == 2
        for i in range(6):
            assert isinstance((await w.final_events(f"r{i}"))[-1], FinishEvent)
        await w.drained()


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (EngineError("kv cache exploded"), 500, "engine_error"),
        (RuntimeError("adapter bug"), 500, "engine_error"),
    ],
    ids=["engine-error", "unexpected-exception"],
)
async def test_engine_failure_mid_stream_gives_error_event(
    redis_target: RedisTarget, error: BaseException, status: int, code: str
) -> None:
    engine = FakeEngine(tokens=10)
    engine.fail = (2, error)
    async with worker(redis_target, engine) as w:
        await w.submit(make_job("bad"))
        events = await w.final_events("bad")
        assert [type(e) for e in events] == [TokenEvent, TokenEvent, ErrorEvent]
        last = events[-1]
        assert isinstance(last, ErrorEvent)
        assert (last.seq, last.status, last.code) == (2, status, code)
        await w.drained()
        # The worker keeps serving.
        engine.fail = None
        await w.submit(make_job("next"))
        assert isinstance((await w.final_events("next"))[-1], FinishEvent)


async def test_stop_lets_running_jobs_finish(redis_target: RedisTarget) -> None:
    engine = FakeEngine(tokens=20, step_s=0.01)
    async with worker(redis_target, engine, shutdown_grace_s=5.0) as w:
        await w.submit(make_job("r1"))

        async def started() -> bool:
            return engine.running() == 1

        await eventually(started, what="the job to start")
        w.runtime.stop()
        await asyncio.wait_for(asyncio.shield(w.task), 5.0)
        assert isinstance((await w.events("r1"))[-1], FinishEvent)
        await w.drained()
        assert await w.redis.exists(keys.worker_heartbeat("w-test")) == 0


async def test_heartbeat_registers_the_worker(redis_target: RedisTarget) -> None:
    engine = FakeEngine()
    engine.prompt_stats = PromptTokenStats(computed=40, from_local_cache=8, transferred=24)
    async with worker(redis_target, engine, max_slots=3) as w:

        async def registered() -> bool:
            return bool(await w.redis.exists(keys.worker_heartbeat("w-test")))

        await eventually(registered, what="the heartbeat")
        from shared.registry import WorkerRegistry

        [registration] = await WorkerRegistry(w.redis, ttl_s=3.0).live_workers()
        assert registration.model == MODEL
        assert registration.slots == 3
        assert registration.draining is False
        assert registration.can_decode_alone is True
        assert (registration.prompt_tokens_computed, registration.prompt_tokens_transferred) == (
            40,
            24,
        )


# ----------------------------------------------------------- resume and migration


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
    [delivery] = await queue.read([STREAM], "w-dead", count=1, block_ms=100)
    journal = RunJournal(redis, consumer="w-dead")
    task = asyncio.create_task(journal.run())
    try:
        for _ in range(runs):
            lease = await journal.begin(delivery)
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


@pytest.fixture
def fast_janitor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reclaim abandoned jobs within ~0.1 s (the janitor runs every 0.5 s otherwise)."""
    monkeypatch.setattr(runtime_module, "JANITOR_INTERVAL_S", 0.02)


def with_sampling(job: GenerateJob, **changes: Any) -> GenerateJob:
    return msgspec.structs.replace(job, sampling=msgspec.structs.replace(job.sampling, **changes))


@pytest.mark.usefixtures("fast_janitor")
async def test_reclaimed_job_resumes_after_the_tokens_already_sent(
    redis_target: RedisTarget,
) -> None:
    job = with_sampling(make_job("r1", max_tokens=16), min_tokens=5)
    before: list[TokenEvent] = []

    async def crashed_worker(redis: aioredis.Redis) -> None:
        events, _ = await earlier_run(redis, job, tokens=[[100], [101, 102]])
        before.extend(events)

    engine = FakeEngine(tokens=4)
    async with worker(redis_target, engine, setup=crashed_worker, claim_idle_ms=100) as w:
        events = await w.final_events("r1")
        await w.drained()

    [(job_id, prompt, sampling)] = engine.requests
    assert job_id == "r1/0"
    assert prompt == [1, 2, 3, 100, 101, 102]
    assert (sampling.max_tokens, sampling.min_tokens) == (13, 2)
    assert msgspec.structs.replace(sampling, max_tokens=16, min_tokens=5) == job.sampling
    assert events[:2] == before
    assert [e.seq for e in events] == list(range(7))
    assert [e.attempt for e in events] == [0, 0, 1, 1, 1, 1, 1]
    assert events[-1] == FinishEvent("r1", 0, 6, 1, "stop", 3, 7)


async def test_resumed_job_with_no_room_left_finishes_with_length(
    redis_target: RedisTarget,
) -> None:
    job = make_job("full", max_tokens=2)

    async def handed_back(redis: aioredis.Redis) -> None:
        await earlier_run(redis, job, tokens=[[100], [101]], hand_back=True)

    engine = FakeEngine(tokens=4)
    async with worker(redis_target, engine, setup=handed_back) as w:
        events = await w.final_events("full")
        await w.drained()
    assert engine.requests == []
    # Handed back, not crashed: the run that finishes it keeps attempt 0.
    assert events[-1] == FinishEvent("full", 0, 2, 0, "length", 3, 2)


@pytest.mark.usefixtures("fast_janitor")
async def test_job_that_failed_max_deliveries_times_is_dead_lettered(
    redis_target: RedisTarget,
) -> None:
    job = make_job("poison")
    entry: list[str] = []

    async def crashed_twice(redis: aioredis.Redis) -> None:
        _, entry_id = await earlier_run(redis, job, tokens=[], runs=2)
        entry.append(entry_id)

    engine = FakeEngine()
    async with worker(
        redis_target, engine, setup=crashed_twice, max_deliveries=2, claim_idle_ms=50
    ) as w:
        [event] = await w.final_events("poison")
        await w.drained()
        [(_, fields)] = await entries(w.redis, keys.dead_letter_stream(STREAM))
        assert decode(fields) == job
        assert fields[b"entry"].decode() == entry[0]
        assert b"dead-letter" in fields[b"reason"]
        assert await w.redis.exists(keys.job_run("poison/0", STAGE)) == 0
    assert isinstance(event, ErrorEvent)
    assert (event.status, event.type, event.code) == (500, "server_error", "job_failed_repeatedly")
    assert (event.seq, event.attempt) == (0, 2)
    assert engine.started == []


async def test_crashes_then_a_hand_back_count_only_the_crashes(redis_target: RedisTarget) -> None:
    job = make_job("poison")

    async def crashed_twice_then_handed_back(redis: aioredis.Redis) -> None:
        await earlier_run(redis, job, tokens=[], runs=3, hand_back=True)

    engine = FakeEngine()
    async with worker(
        redis_target, engine, setup=crashed_twice_then_handed_back, max_deliveries=2
    ) as w:
        [event] = await w.final_events("poison")
        await w.drained()
        assert await w.redis.xlen(keys.dead_letter_stream(STREAM)) == 1
    assert isinstance(event, ErrorEvent)
    assert (event.code, event.attempt) == ("job_failed_repeatedly", 2)
    assert engine.started == []


@pytest.mark.usefixtures("fast_janitor")
async def test_job_that_failed_fewer_times_still_runs(redis_target: RedisTarget) -> None:
    async def crashed_once(redis: aioredis.Redis) -> None:
        await earlier_run(redis, make_job("retry"), tokens=[])

    engine = FakeEngine(tokens=2)
    async with worker(
        redis_target, engine, setup=crashed_once, max_deliveries=2, claim_idle_ms=50
    ) as w:
        events = await w.final_events("retry")
        await w.drained()
        assert await w.redis.xlen(keys.dead_letter_stream(STREAM)) == 0
    assert events[-1] == FinishEvent("retry", 0, 2, 1, "stop", 3, 2)
    # Nothing was emitted before: a restart from scratch, not a migration.
    assert engine.requests[0][1] == [1, 2, 3]


async def has_events(w: Harness, request_id: str, at_least: int) -> bool:
    return len(await w.events(request_id)) >= at_least


async def test_hand_backs_never_dead_letter_a_job(redis_target: RedisTarget) -> None:
    """Rolling restarts: every worker is stopped mid-stream and hands the job back."""
    hand_backs = 4
    strict = {"max_deliveries": 1, "migration_limit": 1}  # ONE counted failure would end it
    await redis_target.flush()
    sent: list[Any] = []
    try:
        for n in range(hand_backs):
            engine = FakeEngine(tokens=100_000, step_s=0.005)
            async with worker(redis_target, engine, fresh=False, worker_id=f"w-{n}", **strict) as w:
                if n == 0:
                    await w.submit(make_job("rolling", max_tokens=1000))

                streamed_more = functools.partial(has_events, w, "rolling", len(sent) + 2)
                await eventually(streamed_more, what=f"worker {n} to stream")
                w.runtime.stop()
                await asyncio.wait_for(asyncio.shield(w.task), 5.0)
                sent = await w.events("rolling")
                assert all(isinstance(e, TokenEvent) for e in sent)
                assert engine.cancelled == ["rolling/0"]
                assert await w.redis.hget(keys.job_run("rolling/0", STAGE), "starts") == b"0"

        last = FakeEngine(tokens=3)
        async with worker(redis_target, last, fresh=False, worker_id="w-last", **strict) as w:
            events = await w.final_events("rolling")
            await w.drained()
            assert await w.redis.xlen(keys.dead_letter_stream(STREAM)) == 0
    finally:
        await redis_target.flush()
    assert events[: len(sent)] == sent
    assert isinstance(events[-1], FinishEvent)
    assert events[-1].finish_reason == "stop"
    assert [e.seq for e in events] == list(range(len(events)))
    assert {e.attempt for e in events} == {0}
    [(_, prompt, _)] = last.requests
    assert prompt == [1, 2, 3, *(t for e in sent for t in e.token_ids)]


@pytest.mark.parametrize(
    ("policy", "sampling", "runs", "hand_back", "attempt"),
    [
        ({"migration_limit": 0}, {}, 1, True, 0),
        ({"migration_limit": 0}, {}, 1, False, 1),
        ({"migration_limit": 1}, {}, 2, False, 2),
        ({"migration_limit": 1}, {}, 3, True, 2),
        ({}, {"json_schema": '{"type": "object"}'}, 1, True, 0),
        ({}, {"json_object": True}, 1, False, 1),
    ],
    ids=[
        "migration-off-hand-back",
        "migration-off-crash",
        "over-the-limit",
        "over-the-limit-then-hand-back",
        "json-schema",
        "json-object",
    ],
)
@pytest.mark.usefixtures("fast_janitor")
async def test_resume_that_may_not_migrate_ends_with_a_clean_error(
    redis_target: RedisTarget,
    policy: dict[str, Any],
    sampling: dict[str, Any],
    runs: int,
    hand_back: bool,
    attempt: int,
) -> None:
    job = with_sampling(make_job("stuck"), **sampling)

    async def stopped_mid_stream(redis: aioredis.Redis) -> None:
        await earlier_run(redis, job, tokens=[[100], [101]], runs=runs, hand_back=hand_back)

    engine = FakeEngine()
    async with worker(
        redis_target, engine, setup=stopped_mid_stream, claim_idle_ms=50, **policy
    ) as w:
        events = await w.final_events("stuck")
        await w.drained()
        assert await w.redis.exists(*run_keys("stuck/0")) == 0
    *tokens, error = events
    assert [e.seq for e in tokens] == [0, 1]
    assert isinstance(error, ErrorEvent)
    assert (error.status, error.code, error.seq, error.attempt) == (
        500,
        "migration_failed",
        2,
        attempt,
    )
    assert "mid-stream" in error.message
    assert engine.started == []


async def test_guided_job_without_emitted_tokens_may_restart(redis_target: RedisTarget) -> None:
    job = with_sampling(make_job("guided"), json_schema='{"type": "object"}')

    async def crashed_before_a_token(redis: aioredis.Redis) -> None:
        await earlier_run(redis, job, tokens=[], hand_back=True)

    engine = FakeEngine(tokens=2)
    async with worker(redis_target, engine, setup=crashed_before_a_token) as w:
        events = await w.final_events("guided")
    assert isinstance(events[-1], FinishEvent)
    assert engine.started == ["guided/0"]


# ------------------------------------------------------------ hand back on stop


async def test_stop_without_grace_hands_running_jobs_back(redis_target: RedisTarget) -> None:
    engine = FakeEngine(tokens=100_000, step_s=0.01)
    async with worker(redis_target, engine, shutdown_grace_s=0.0) as w:
        await w.submit(make_job("moving", max_tokens=1000))

        async def streaming() -> bool:
            return len(await w.events("moving")) >= 3

        await eventually(streaming, what="the job to stream")
        w.runtime.stop()
        await asyncio.wait_for(asyncio.shield(w.task), 5.0)

        sent = await w.events("moving")
        assert all(isinstance(e, TokenEvent) for e in sent)  # no finish, no error
        assert [e.seq for e in sent] == list(range(len(sent)))
        journaled = await emitted_tokens(w.redis, "moving/0")
        assert journaled == [t for e in sent for t in e.token_ids]
        run = await w.redis.hgetall(keys.job_run("moving/0", STAGE))
        assert b"owner" not in run
        assert int(run[b"seq"]) == len(sent)
        assert run[b"starts"] == b"0"  # a hand-back is not a failed delivery
        assert await w.redis.xlen(STREAM) == 1  # queued again...
        pending = await w.redis.xpending(STREAM, keys.JOB_GROUP)
        assert pending["pending"] == 0  # ...and the delivery it had is acked
        assert engine.cancelled == ["moving/0"]
        assert await w.redis.exists(keys.worker_heartbeat("w-test")) == 0

        # Another worker picks it up and continues where this one stopped.
        successor = FakeEngine(tokens=3)
        async with worker(redis_target, successor, fresh=False, worker_id="w-next") as w2:
            events = await w2.final_events("moving")
            await w2.drained()
        assert events[: len(sent)] == sent
        assert [e.seq for e in events] == list(range(len(sent) + 4))
        [(_, prompt, sampling)] = successor.requests
        assert prompt == [1, 2, 3, *journaled]
        assert sampling.max_tokens == 1000 - len(journaled)
        # The successor's run keeps the attempt number of the run that handed it back.
        assert events[-1] == FinishEvent("moving", 0, len(sent) + 3, 0, "stop", 3, len(sent) + 3)
        assert {e.attempt for e in events} == {0}


async def test_engine_dead_mid_stream_stops_the_worker_and_hands_jobs_back(
    redis_target: RedisTarget,
) -> None:
    engine = FakeEngine(tokens=10)
    engine.fail = (2, EngineDead("CUDA error: device lost"))
    async with worker(redis_target, engine, shutdown_grace_s=30.0) as w:
        await w.submit(make_job("a"), make_job("b"))
        await asyncio.wait_for(asyncio.shield(w.task), 5.0)
        assert w.runtime.engine_dead is True
        assert w.task.exception() is None
        for request_id in ("a", "b"):
            sent = await w.events(request_id)
            assert [type(e) for e in sent] == [TokenEvent, TokenEvent]  # no error to clients
            assert await emitted_tokens(w.redis, f"{request_id}/0") == [100, 101]
        assert await w.redis.xlen(STREAM) == 2
        assert (await w.redis.xpending(STREAM, keys.JOB_GROUP))["pending"] == 0


async def test_engine_found_dead_by_the_health_check_stops_the_worker(
    redis_target: RedisTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(runtime_module, "HEALTH_CHECK_INTERVAL_S", 0.05)
    engine = FakeEngine(tokens=100_000, step_s=0.01)
    async with worker(redis_target, engine, shutdown_grace_s=30.0) as w:
        await w.submit(make_job("running", max_tokens=1000))

        async def streaming() -> bool:
            return len(await w.events("running")) >= 2

        await eventually(streaming, what="the job to stream")
        engine.dead = True
        await asyncio.wait_for(asyncio.shield(w.task), 5.0)
        assert w.runtime.engine_dead is True
        assert all(isinstance(e, TokenEvent) for e in await w.events("running"))
        assert await w.redis.xlen(STREAM) == 1
        assert (await w.redis.xpending(STREAM, keys.JOB_GROUP))["pending"] == 0
        assert engine.running() == 0


# ------------------------------------------------------------------------ canary


class ProbeEngine(FakeEngine):
    """Answers a canary with one token, or hangs / fails when told to."""

    def __init__(self) -> None:
        super().__init__(tokens=1, step_s=0.0)
        self.hang = False
        self.error: BaseException | None = None

    async def generate(
        self,
        job_id: str,
        prompt_token_ids: list[int],
        sampling: SamplingOptions,
        *,
        handoff: Handoff | None = None,
        images: object = None,
    ) -> AsyncIterator[StepOutput]:
        self.requests.append((job_id, list(prompt_token_ids), sampling))
        if self.hang:
            await asyncio.Event().wait()
        if self.error is not None:
            raise self.error
        yield StepOutput([7], "x", None, "length", len(prompt_token_ids))


async def test_canary_marks_the_worker_not_ready_while_the_engine_hangs() -> None:
    engine = ProbeEngine()
    canary = Canary(engine, idle_s=0.0, timeout_s=0.05)
    assert canary.healthy
    assert await canary.probe() is True

    engine.hang = True
    started = time.monotonic()
    assert await canary.probe() is False
    assert time.monotonic() - started < 0.5
    assert canary.healthy is False

    engine.hang = False
    assert await canary.probe() is True
    assert canary.healthy is True

    engine.error = EngineError("sampler crashed")
    assert await canary.probe() is False
    assert canary.healthy is False
    [(job_id, prompt, sampling)] = engine.requests[:1]
    assert job_id.startswith("canary-")
    assert (prompt, sampling.max_tokens, sampling.temperature) == ([0], 1, 0.0)


async def test_canary_probes_only_an_idle_worker() -> None:
    idle, busy, recent = ProbeEngine(), ProbeEngine(), ProbeEngine()
    for engine in (idle, busy, recent):
        engine.hang = True
    canaries = {
        "idle": (Canary(idle, idle_s=0.0, timeout_s=0.05), False),
        "busy": (Canary(busy, idle_s=0.0, timeout_s=0.05), True),
        "recent": (Canary(recent, idle_s=3600.0, timeout_s=0.05), False),
    }
    tasks = [
        asyncio.create_task(canary.run(functools.partial(bool, is_busy)))
        for canary, is_busy in canaries.values()
    ]
    try:

        async def idle_probed() -> bool:
            return not canaries["idle"][0].healthy

        await eventually(idle_probed, timeout_s=3.0, what="the idle worker's canary")
    finally:
        await cancel_and_wait(tasks)
    assert idle.requests
    assert busy.requests == [] and canaries["busy"][0].healthy
    assert recent.requests == [] and canaries["recent"][0].healthy


async def test_handoff_goes_to_a_fresh_decode_but_not_to_a_resumed_one(
    redis_target: RedisTarget,
) -> None:
    fresh = msgspec.structs.replace(make_job("fresh"), handoff={"room": 7})
    resumed = msgspec.structs.replace(make_job("resumed"), handoff={"room": 8})

    async def crashed_mid_stream(redis: aioredis.Redis) -> None:
        await earlier_run(redis, resumed, tokens=[[100]], hand_back=True)

    engine = FakeEngine(tokens=2)
    async with worker(redis_target, engine, setup=crashed_mid_stream) as w:
        await w.submit(fresh)
        await w.final_events("fresh")
        await w.final_events("resumed")
    handoffs = dict(zip(engine.started, engine.handoffs, strict=True))
    # A resumed run recomputes prompt + emitted tokens: the prefilled KV is stale.
    assert handoffs == {"fresh/0": {"room": 7}, "resumed/0": None}


@pytest.mark.usefixtures("fast_janitor")
async def test_a_journal_that_gave_up_stops_the_worker_and_its_jobs_are_reclaimed(
    redis_target: RedisTarget,
) -> None:
    engine = FakeEngine(tokens=100_000, step_s=0.01)

    async def redis_down(*args: Any, **kwargs: Any) -> Any:
        raise RedisConnectionError("Connection refused")

    async with worker(redis_target, engine, shutdown_grace_s=30.0) as w:
        journal = w.runtime._journal
        journal._retry_for_s = 0.1
        journal._write = redis_down  # type: ignore[assignment]
        await w.submit(make_job("stranded", max_tokens=100_000))
        # Nobody calls stop(): the worker sees its journal give up and exits at once
        # (the grace period would only let jobs publish into a journal nobody sends).
        await asyncio.wait_for(asyncio.shield(w.task), 2.0)
        assert w.task.exception() is None
        assert (w.runtime.journal_failed, w.runtime.engine_dead) == (True, False)
        assert engine.running() == 0
        assert engine.cancelled == ["stranded/0"]
        assert await w.events("stranded") == []  # nothing it streamed ever landed
        # Not handed back: the job stays pending to this worker for another to reclaim.
        [pending] = await w.redis.xpending_range(STREAM, keys.JOB_GROUP, "-", "+", 10)
        assert pending["consumer"] == b"w-test"

        successor = FakeEngine(tokens=3)
        async with worker(
            redis_target, successor, fresh=False, worker_id="w-next", claim_idle_ms=50
        ) as w2:
            events = await w2.final_events("stranded")
            await w2.drained()
    assert [e.seq for e in events] == [0, 1, 2, 3]
    # The lost run counts as a failed one; nothing was journaled, so it restarts.
    assert events[-1] == FinishEvent("stranded", 0, 3, 1, "stop", 3, 3)
    assert successor.requests[0][1] == [1, 2, 3]


async def test_a_job_that_kills_the_engine_is_dead_lettered(redis_target: RedisTarget) -> None:
    """An engine death is no graceful hand-back: it counts toward max_deliveries."""
    await redis_target.flush()
    try:
        for n in range(2):
            killed = FakeEngine()
            killed.fail = (0, EngineDead("CUDA error: an illegal memory access"))
            async with worker(
                redis_target, killed, fresh=False, worker_id=f"w-{n}", max_deliveries=2
            ) as w:
                if n == 0:
                    await w.submit(make_job("killer"))
                await asyncio.wait_for(asyncio.shield(w.task), 5.0)
                assert w.runtime.engine_dead is True
                assert killed.started == ["killer/0"]

        engine = FakeEngine()
        async with worker(
            redis_target, engine, fresh=False, worker_id="w-next", max_deliveries=2
        ) as w:
            events = await w.final_events("killer")
            dead_letters = await w.redis.xlen(keys.dead_letter_stream(STREAM))
    finally:
        await redis_target.flush()
    assert engine.started == []
    assert isinstance(events[-1], ErrorEvent)
    assert (events[-1].code, events[-1].attempt) == ("job_failed_repeatedly", 2)
    assert dead_letters == 1


# ------------------------------------------------------------- bursts and start failures


async def test_a_burst_of_jobs_in_one_read_starts_on_a_few_connections(
    redis_target: RedisTarget,
) -> None:
    """64 deliveries in one read are leased in one round trip, not one connection each:
    with a pool of 8 connections (the old code needed 2 per delivery) all run at once."""
    if redis_target.kind == "fake":
        pytest.skip("fakeredis has no connection pool to exhaust")
    small_pool = aioredis.ConnectionPool.from_url(redis_target.url, max_connections=8)

    def connect_small() -> aioredis.Redis:
        return aioredis.Redis(connection_pool=small_pool)

    target = RedisTarget(kind="real", url=redis_target.url)
    target.connect = connect_small  # type: ignore[method-assign]
    async with worker(target, FakeEngine(tokens=2), max_slots=64) as w:
        jobs = [make_job("burst", index=i, max_tokens=2) for i in range(64)]
        await w.submit(*jobs)
        started = time.monotonic()
        await w.final_events("burst", sequences=64, timeout_s=5.0)
        assert time.monotonic() - started < 2.0
        await w.drained()
    await small_pool.aclose()


async def test_a_start_that_fails_is_tried_again_at_once(
    redis_target: RedisTarget, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Redis fails the lease of a fresh delivery: the worker starts it again right away
    instead of leaving it pending for the stale-entry reclaim (30 s)."""
    async with worker(redis_target, FakeEngine(tokens=2)) as w:
        journal = w.runtime._journal
        real_begin_all = journal.begin_all
        failures = 0

        async def flaky_begin_all(deliveries: Any) -> Any:
            nonlocal failures
            if failures < 2:
                failures += 1
                raise RedisConnectionError("Too many connections")
            return await real_begin_all(deliveries)

        monkeypatch.setattr(journal, "begin_all", flaky_begin_all)
        started = time.monotonic()
        await w.submit(make_job("flaky", max_tokens=2))
        await w.final_events("flaky", timeout_s=3.0)
        assert failures == 2
        assert time.monotonic() - started < 1.0
        await w.drained()
