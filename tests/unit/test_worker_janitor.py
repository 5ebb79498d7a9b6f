"""The janitor, through a running worker: jobs whose gateway died are aborted, a stall holds
reclaim back. (Reclaiming a dead worker's jobs: test_worker_intake.py, where the reclaimed
job resumes or is refused.)"""

from __future__ import annotations

from shared import keys
from tests.conftest import RedisTarget
from tests.unit.worker_harness import GATEWAY, FakeEngine, Timing, make_job, worker
from tests.waiting import eventually
from workers.janitor import STALL_S, stall_check


async def test_running_job_is_aborted_once_its_gateway_stays_gone(
    redis_target: RedisTarget,
) -> None:
    engine = FakeEngine(tokens=100_000, step_s=0.01)
    async with worker(
        redis_target, engine, gateway_grace_s=0.5, timing=Timing(orphan_check_s=0.1)
    ) as w:
        await w.submit(make_job("orphaned", max_tokens=100_000))

        async def streaming() -> bool:
            return engine.running() == 1

        await eventually(streaming, what="the job to stream")
        await w.redis.delete(keys.gateway_heartbeat(GATEWAY))

        async def aborted() -> bool:
            return engine.running() == 0 and w.runtime.active_jobs() == 0

        await eventually(aborted, what="the orphaned job to be aborted", timeout_s=5.0)


def test_without_a_heartbeat_thread_a_late_pass_is_a_stall() -> None:
    stalled = stall_check(None, ttl_s=1.5, interval_s=0.5)
    assert not stalled(0.5)
    assert not stalled(0.5 + STALL_S)
    assert stalled(0.5 + STALL_S + 0.01)
