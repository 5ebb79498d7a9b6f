"""Redis Sentinel fail-over against real ``redis-server`` and ``redis-sentinel`` processes
(tests/support/sentinel.py): Conveyor's clients, opened on a ``redis+sentinel://`` URL,
work again on the promoted replica after the master is SIGKILLed.

Fail-over time as Conveyor sees it (SIGKILL to the first command that succeeds) is
printed; docs/operations/several-hosts.md quotes it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError

from conveyor.redis_server import redis_answers, start_private_redis
from gateway.catalog.served_models import ServedModel
from shared.connections.connect import connect, db_of
from shared.connections.model_redis import ModelRedis
from shared.connections.url import async_client
from shared.protocol import ErrorEvent, FinishEvent
from shared.queue import names
from shared.queue.job_queue import Admission, JobQueue
from shared.queue.liveness import HeartbeatThread, forget_dead_process
from tests.conftest import RedisTarget
from tests.contract.test_job_queue import JOBS, STREAM, make_job
from tests.gateway.fake_worker import echo, silent
from tests.gateway.harness import BODIES, CHAT, live_gateway
from tests.gateway.sse import DONE, content, events
from tests.support.sentinel import SentinelGroup
from tests.unit.worker_harness import FakeEngine, Harness, has_events, worker
from tests.unit.worker_harness import make_job as make_generate_job
from tests.waiting import eventually

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.timeout(120)]

FAILOVER_BOUND_S = 15.0
"""down-after 500 ms + a Sentinel election (+ a retry after a split vote) with room."""


@pytest.fixture
def group(tmp_path: Path) -> Iterator[SentinelGroup]:
    started = SentinelGroup(tmp_path, db=2)
    try:
        started.start()
        yield started
    finally:
        started.stop()


async def test_the_job_queue_admits_again_on_the_promoted_replica(group: SentinelGroup) -> None:
    client = connect(group.url)
    try:
        assert db_of(client) == 2
        queue = JobQueue(client)
        await queue.ensure_group(STREAM)
        first = await queue.submit(STREAM, [make_job("before")], max_depth=10)
        assert first.outcome is Admission.QUEUED
        group.wait_replicated()
        killed = group.kill_master()
        killed_at = time.monotonic()
        while True:  # what a gateway's retries see: errors, then admission again
            try:
                second = await queue.submit(STREAM, [make_job("after")], max_depth=10)
                break
            except RedisError:
                assert time.monotonic() - killed_at < FAILOVER_BOUND_S, "no fail-over"
                await asyncio.sleep(0.05)
        print(f"\nasync client: fail-over seen in {time.monotonic() - killed_at:.2f}s")
        assert second.outcome is Admission.QUEUED
        assert group.master_address()[1] == group.replica_port != killed
        deliveries = await queue.read([JOBS], "c1", count=10, block_ms=100)
        assert [d.job.request_id for d in deliveries] == ["before", "after"]
    finally:
        await client.aclose()


async def test_the_heartbeat_thread_beats_again_on_the_promoted_replica(
    group: SentinelGroup,
) -> None:
    key = names.worker_heartbeat("aggregated-host-1-abc")
    heartbeat = HeartbeatThread(
        group.url, "aggregated-host-1-abc", ttl_s=1.0, payload=lambda: b"{}"
    )
    task = asyncio.create_task(heartbeat.run())
    try:
        await _wait_for(lambda: heartbeat.beats > 0, "a first beat")
        group.kill_master()
        killed_at, beats = time.monotonic(), heartbeat.beats
        await _wait_for(lambda: heartbeat.beats > beats + 1, "beats after the fail-over")
        print(f"\nheartbeat thread: beating again {time.monotonic() - killed_at:.2f}s after")
        promoted = redis.Redis(port=group.replica_port, db=2)
        try:
            assert promoted.get(key) == b"{}"
            assert promoted.pttl(key) > 0
        finally:
            promoted.close()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def _wait_for(condition: object, what: str) -> None:
    assert callable(condition)
    deadline = time.monotonic() + FAILOVER_BOUND_S
    while not condition():
        assert time.monotonic() < deadline, f"no {what} in {FAILOVER_BOUND_S}s"
        await asyncio.sleep(0.05)


async def test_the_pool_stays_bounded_and_blocking(group: SentinelGroup) -> None:
    """More commands than connections wait for one (no "Too many connections")."""
    client = connect(group.url, max_connections=2)
    try:
        replies = await asyncio.gather(*(client.xread({f"s{n}": "$"}, block=200) for n in range(6)))
        assert replies == [[]] * 6
        assert len(client.connection_pool._available_connections) <= 2  # type: ignore[attr-defined]
    finally:
        await client.aclose()
    cli = async_client(group.url, timeout_s=2.0, connect_timeout_s=1.0)  # the admin CLI's
    try:
        assert await cli.ping()
    finally:
        await cli.aclose()


async def test_a_write_the_replica_never_got_is_lost_in_the_fail_over(
    group: SentinelGroup,
) -> None:
    """Replication is asynchronous (docs/operations/several-hosts.md, "What a fail-over can lose"):
    a job the master
    admitted while its replica was not reading is gone once that replica is promoted."""
    client = connect(group.url)
    try:
        queue = JobQueue(client)
        await queue.ensure_group(STREAM)
        await queue.submit(STREAM, [make_job("replicated")], max_depth=10)
        group.wait_replicated()
        group.cut_replication()
        lost = await queue.submit(STREAM, [make_job("lost")], max_depth=10)
        assert lost.outcome is Admission.QUEUED  # acknowledged by the master
        group.kill_master()
        group.resume_replica()
        deadline = time.monotonic() + FAILOVER_BOUND_S
        while True:
            try:
                deliveries = await queue.read([JOBS], "c1", count=10, block_ms=100)
                break
            except RedisError:
                assert time.monotonic() < deadline, "no fail-over"
                await asyncio.sleep(0.05)
        assert group.master_address()[1] == group.replica_port
        assert [d.job.request_id for d in deliveries] == ["replicated"]
    finally:
        await client.aclose()


async def test_min_replicas_to_write_refuses_what_a_fail_over_would_lose(
    group: SentinelGroup,
) -> None:
    """The operator setting docs/operations/several-hosts.md asks for: a master that has not heard
    from a replica
    for ``min-replicas-max-lag`` refuses writes (NOREPLICAS, a RedisError: the gateway's
    503) instead of acknowledging a job no replica has."""
    client = connect(group.url)
    try:
        queue = JobQueue(client)
        await queue.ensure_group(STREAM)
        master = redis.Redis(port=group.master_port)
        master.config_set("min-replicas-to-write", 1)
        master.config_set("min-replicas-max-lag", 1)
        master.close()
        group.cut_replication()
        refused_after = time.monotonic()
        while True:
            try:
                await queue.submit(STREAM, [make_job(uuid4().hex)], max_depth=100)
            except ResponseError as exc:
                assert "NOREPLICAS" in str(exc)
                break
            assert time.monotonic() - refused_after < 5, "the master kept taking writes"
            await asyncio.sleep(0.1)
        group.resume_replica()
        deadline = time.monotonic() + FAILOVER_BOUND_S
        while True:  # the replica reconnects: writes are taken again
            try:
                await queue.submit(STREAM, [make_job("after")], max_depth=100)
                break
            except ResponseError:
                assert time.monotonic() < deadline, "writes never came back"
                await asyncio.sleep(0.1)
    finally:
        await client.aclose()


def test_the_supervisor_forgets_a_dead_worker_through_the_sentinels(group: SentinelGroup) -> None:
    client = redis.Redis(port=group.master_port, db=2)
    try:
        for worker_id in ("aggregated-hostx-42-abc", "aggregated-hostx-43-abc"):
            client.set(names.worker_heartbeat(worker_id), b"{}", ex=60)
            client.zadd(names.WORKER_SET, {worker_id: time.time() * 1000 + 60_000})
    finally:
        client.close()
    assert forget_dead_process(group.url, 42, host="hostx") == ["aggregated-hostx-42-abc"]


def test_conveyor_up_uses_the_sentinels_master_and_never_starts_a_private_redis(
    group: SentinelGroup, tmp_path: Path
) -> None:
    assert redis_answers(group.url)
    group.stop()
    asked_at = time.monotonic()
    assert not redis_answers(group.url, 0.2)
    assert time.monotonic() - asked_at < 2  # no retries per Sentinel (they were 12 s)
    with pytest.raises(RuntimeError, match="through the Sentinels of redis\\+sentinel://"):
        start_private_redis(group.url, tmp_path)
    assert not (tmp_path / "redis").exists()


async def test_a_request_the_fail_over_lost_is_queued_again_as_the_gateway_reconnects(
    group: SentinelGroup, served_model: ServedModel
) -> None:
    """A request queued while the replica was cut off is gone after the promotion (jobs,
    open entry, admitted marker: one admission script). The in-process gateway, on this
    Sentinel group, queues it again as soon as its reply stream reads again, and a
    worker on the promoted replica answers it; the request queued before the cut (on
    the replica, held by the worker that died with the master) is left alone."""
    models = ModelRedis(group.url, {}, connect, home=connect(group.url))
    body = {**BODIES[CHAT], "stream": True}
    async with live_gateway(
        served_model, workers=(), model_redis=models, sse_keepalive_s=0.05
    ) as gateway:
        await gateway.add_worker(script=silent)  # takes jobs, says nothing; dies with the master
        async with gateway.call(CHAT, body) as kept:
            assert await kept.start() == 200
            await kept.read_until(": keep-alive")
            group.wait_replicated()
            group.cut_replication()
            async with gateway.call(CHAT, body) as lost:
                assert await lost.start() == 200
                await lost.read_until(": keep-alive")  # acknowledged by the master only
                group.kill_master()
                group.resume_replica()
                deadline = time.monotonic() + FAILOVER_BOUND_S
                while group.master_address()[1] != group.replica_port:
                    assert time.monotonic() < deadline, "no fail-over"
                    await asyncio.sleep(0.05)
                answering = await gateway.add_worker(script=echo)
                text = await asyncio.wait_for(lost.read_all(), FAILOVER_BOUND_S)
                assert group.killed_at is not None
                ended_s = time.monotonic() - group.killed_at
                print(f"\nthe lost request was answered {ended_s:.2f}s after the SIGKILL")
            assert events(text)[-1].data == DONE
            assert content(text) and "error" not in text
            assert [job.request_id for job in answering.generate_jobs()] == [
                lost.headers["x-request-id"]
            ]
            assert gateway.state.cells.home.router.open_requests() == 1  # the kept one


@dataclass
class SentinelTarget(RedisTarget):
    """The worker harness's Redis, reached through the Sentinels of ``url``."""

    def connect(self) -> aioredis.Redis:
        return connect(self.url)


async def _events_after_failover(w: Harness, request_id: str) -> list[Any]:
    deadline = time.monotonic() + FAILOVER_BOUND_S + 10
    while True:
        try:
            events = await w.events(request_id)
            if events and isinstance(events[-1], FinishEvent | ErrorEvent):
                return events
        except RedisError:
            pass
        assert time.monotonic() < deadline, "the job never ended on the promoted replica"
        await asyncio.sleep(0.1)


async def test_a_finish_the_fail_over_lost_is_run_again_by_its_worker(
    group: SentinelGroup, caplog: pytest.LogCaptureFixture
) -> None:
    """The worker finishes a job (and acks it) while the replica is cut off; the master
    dies. On the promoted replica the job is half-streamed and pending to that worker,
    which holds no trace of it: the worker runs it again, resuming after the tokens the
    replica has, so the reply stream there ends with one gap-free run of seqs."""
    engine = FakeEngine(tokens=20, step_s=0.05)
    target = SentinelTarget("real", group.url)
    async with worker(target, engine, worker_id="w-failover") as w:
        await w.submit(make_generate_job("acked", max_tokens=20))
        await eventually(lambda: has_events(w, "acked", 1), what="the first tokens")
        group.wait_replicated()
        group.cut_replication()
        await w.drained()  # finished and acked on the master only
        group.kill_master()
        group.resume_replica()
        run_events = await _events_after_failover(w, "acked")
        assert group.killed_at is not None
        print(f"\nthe lost finish was run again {time.monotonic() - group.killed_at:.2f}s after")
    assert isinstance(run_events[-1], FinishEvent)
    assert [e.seq for e in run_events] == list(range(len(run_events)))
    assert {e.attempt for e in run_events} == {0, 1}
    assert [job_id for job_id, _, _ in engine.requests] == ["acked/0", "acked/0"]
    assert any("Redis lost their acks" in r.getMessage() for r in caplog.records)
