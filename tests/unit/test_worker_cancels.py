"""Client cancels on the command channel stop a worker's jobs, or drop them at dequeue."""

from __future__ import annotations

from shared.protocol import VERSION, CancelCommand, TokenEvent, encode_bytes
from tests.conftest import RedisTarget
from tests.unit.worker_harness import STREAM, FakeEngine, Harness, make_job, worker
from tests.waiting import eventually


async def streaming(w: Harness, request_ids: list[str], *, at_least: int = 2) -> None:
    async def all_streaming() -> bool:
        for request_id in request_ids:
            if len(await w.events(request_id)) < at_least:
                return False
        return w.engine.running() == len(request_ids)

    await eventually(all_streaming, what=f"{request_ids} to stream")


async def test_cancel_that_lands_while_the_job_is_being_leased_drops_it(
    redis_target: RedisTarget,
) -> None:
    """The cancel command arrives after the intake read no cancel flag but before the
    job's task exists: nothing was running to cancel, so the start must catch it."""
    async with worker(redis_target) as w:
        await w.cancel("raced")  # heard by the worker; no flag in Redis
        await w.submit(make_job("raced"))
        await w.submit(make_job("kept"))
        await w.final_events("kept")
        await w.drained()
        assert await w.events("raced") == []
        assert all(not job.startswith("raced/") for job in w.engine.started)


async def test_cancel_command_stops_a_running_job(redis_target: RedisTarget) -> None:
    engine = FakeEngine(tokens=100_000, step_s=0.01)
    async with worker(redis_target, engine) as w:
        await w.submit(make_job("long", max_tokens=100_000), make_job("other", max_tokens=100_000))
        await streaming(w, ["long", "other"])

        await w.cancel("long")

        async def long_acked() -> bool:
            return engine.running() == 1 and await w.redis.xlen(STREAM) == 1

        await eventually(long_acked, what="the cancelled job to stop and be acked")
        assert engine.cancelled == ["long/0"]
        events = await w.events("long")
        assert all(isinstance(e, TokenEvent) for e in events)  # no finish, no error
        assert w.runtime.active_jobs() == 1
        # A cancel for a request this worker does not run, and a message that is not a
        # command, are harmless. Messages arrive in order: once a later cancel was heard,
        # these two were handled.
        await w.publish_control(encode_bytes(CancelCommand("unknown")))
        await w.publish_control(b"9:not-a-message")
        await w.cancel("marker")
        assert engine.running() == 1
        assert engine.cancelled == ["long/0"]
        w.runtime.cancel_request("other")
        await w.drained()
        assert engine.running() == 0


async def test_control_listener_survives_a_malformed_message(redis_target: RedisTarget) -> None:
    engine = FakeEngine(tokens=100_000, step_s=0.01)
    async with worker(redis_target, engine) as w:
        await w.submit(make_job("long", max_tokens=100_000))
        await streaming(w, ["long"], at_least=1)
        await w.listening()
        await w.publish_control(VERSION + b":\x91\xaa" + b"\x00" * 9 + b"\x80")  # bad UTF-8
        await w.cancel("long")

        async def stopped() -> bool:
            return engine.running() == 0

        await eventually(stopped, timeout_s=1.5, what="the cancel to land")
