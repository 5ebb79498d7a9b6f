"""Worker admin commands end to end over Redis (shared/queue/worker_commands.py ->
workers/commands/admin.py), on fakeredis and the real Redis, around a fake engine."""

from __future__ import annotations

import asyncio
from typing import Any

from shared.protocol import FinishEvent, WorkerCommandResult
from shared.queue.liveness import WorkerRegistration, WorkerRegistry
from shared.queue.worker_commands import Command, CommandStatus, send_worker_command
from tests.conftest import RedisTarget
from tests.unit.worker_harness import FakeEngine, Harness, Timing, make_job, worker
from tests.waiting import eventually
from workers.engines.base import NotSupported

WORKER = "w-test"
FAST = Timing(janitor_s=0.05)


class FakeAdmin:
    """Refuses to clear the KV cache ``refusals`` times (requests running), has no sleep."""

    def __init__(self, refusals: int = 0) -> None:
        self.refusals = refusals
        self.asked = 0

    async def clear_kv(self) -> bool:
        self.asked += 1
        return self.asked > self.refusals

    async def sleep(self) -> None:
        raise NotSupported("not supported on this engine: the test engine has no sleep mode")

    async def wake(self) -> None:
        raise NotSupported("not supported on this engine: the test engine has no sleep mode")


class AdminEngine(FakeEngine):
    def __init__(self, admin: FakeAdmin | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if admin is not None:
            self.admin = admin


async def send(
    w: Harness, command: str, timeout_s: float = 5.0, worker_id: str = WORKER
) -> WorkerCommandResult:
    await w.listening()
    return await send_worker_command(w.redis, worker_id, command, timeout_s)


async def entry(w: Harness) -> WorkerRegistration:
    [found] = await WorkerRegistry(w.redis, ttl_s=1).live_workers()
    return found


async def test_drain_finishes_running_jobs_takes_no_new_ones_until_resume(
    redis_target: RedisTarget,
) -> None:
    engine = AdminEngine(FakeAdmin(), tokens=20, step_s=0.02)
    async with worker(redis_target, engine, timing=FAST, heartbeat_ttl_s=0.2) as w:
        await w.submit(make_job("running", max_tokens=20))
        await eventually(lambda: _true(engine.running() == 1), what="a job to run")
        result = await send(w, Command.DRAIN)
        assert (result.status, result.worker_id) == (CommandStatus.OK, WORKER)
        assert "1 running finish" in result.detail
        await w.submit(make_job("queued", max_tokens=2))
        [*_, last] = await w.final_events("running")  # the running one finishes
        assert isinstance(last, FinishEvent) and last.completion_tokens == 20
        await asyncio.sleep(0.4)
        assert "queued/0" not in engine.started  # no new job while drained

        async def drained_in_registry() -> bool:
            found = await entry(w)
            return found.draining and found.paused and found.active == 0

        await eventually(drained_in_registry, what="the registry to say draining")
        assert not w.task.done()  # still up
        assert (await send(w, Command.RESUME)).status == CommandStatus.OK
        await w.final_events("queued")
        await eventually(lambda: _not_draining(w), what="the registry to say taking jobs")


async def _not_draining(w: Harness) -> bool:
    found = await entry(w)
    return not found.draining and not found.paused


async def _true(value: bool) -> bool:
    return value


async def test_clear_kv_is_retried_until_the_engine_accepts(redis_target: RedisTarget) -> None:
    admin = FakeAdmin(refusals=3)
    async with worker(redis_target, AdminEngine(admin), timing=FAST) as w:
        result = await send(w, Command.CLEAR_KV)
        assert result.status == CommandStatus.OK
        assert admin.asked == 4 and "asked 4 times" in result.detail


async def test_clear_kv_gives_up_within_the_senders_timeout(redis_target: RedisTarget) -> None:
    admin = FakeAdmin(refusals=10**9)
    async with worker(redis_target, AdminEngine(admin), timing=FAST) as w:
        result = await send(w, Command.CLEAR_KV, timeout_s=1.0)
        assert result.status == CommandStatus.FAILED
        assert "refused to clear its KV cache" in result.detail and admin.asked > 3


async def test_sleep_and_wake_answer_not_supported_with_the_reason(
    redis_target: RedisTarget,
) -> None:
    async with worker(redis_target, AdminEngine(FakeAdmin()), timing=FAST) as w:
        for command in (Command.SLEEP, Command.WAKE):
            result = await send(w, command)
            assert result.status == CommandStatus.NOT_SUPPORTED
            assert result.detail.endswith(": the test engine has no sleep mode")


async def test_an_engine_without_admin_cannot_clear_kv(redis_target: RedisTarget) -> None:
    async with worker(redis_target, AdminEngine(None), timing=FAST) as w:
        result = await send(w, Command.CLEAR_KV)
        assert result.status == CommandStatus.NOT_SUPPORTED
        assert result.detail.startswith("not supported on this engine")


async def test_unknown_worker_command_and_silence(redis_target: RedisTarget) -> None:
    async with worker(
        redis_target, AdminEngine(FakeAdmin()), timing=FAST, heartbeat_ttl_s=0.2
    ) as w:
        gone = await send(w, Command.DRAIN, worker_id="w-nobody")
        assert gone.status == CommandStatus.UNKNOWN_WORKER
        odd = await send(w, "reboot")
        assert odd.status == CommandStatus.UNKNOWN_COMMAND and "reboot" in odd.detail
        # A live registry entry whose worker does not listen: the sender times out.
        fake = msgspec_entry("w-silent")
        await WorkerRegistry(w.redis, ttl_s=30).beat(fake)
        silent = await send(w, Command.DRAIN, timeout_s=0.5, worker_id="w-silent")
        assert silent.status == CommandStatus.TIMEOUT
        assert not (await entry_of(w, WORKER)).paused  # nobody else acted on it


def msgspec_entry(worker_id: str) -> WorkerRegistration:
    from shared.roles import Role

    return WorkerRegistration(
        worker_id=worker_id, role=Role.AGGREGATED, model="m", max_model_len=1, active=0, slots=1
    )


async def entry_of(w: Harness, worker_id: str) -> WorkerRegistration:
    found = await WorkerRegistry(w.redis, ttl_s=1).live_workers()
    return next(e for e in found if e.worker_id == worker_id)
