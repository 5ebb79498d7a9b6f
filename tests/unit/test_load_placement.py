"""The load-only placer, the directory's candidates, and the dispatcher placing jobs."""

from __future__ import annotations

import random
import time

import fakeredis.aioredis
import msgspec

from gateway.dispatch.dispatcher import AdmissionPolicy, Dispatcher
from gateway.dispatch.plan import ChoiceSpec, Deadline, Generation, RequestPlan
from gateway.dispatch.reply_router import ReplyRouter
from gateway.dispatch.worker_directory import WorkerDirectory
from gateway.placement.load import LoadPlacer
from gateway.placement.placer import Candidate, PlacementReason, PlacementRequest
from shared.engine_stats import EngineStats
from shared.protocol import SamplingOptions
from shared.queue import names
from shared.queue.liveness import WorkerRegistration, WorkerRegistry
from shared.roles import Role

REQUEST = PlacementRequest(model="m", role=Role.AGGREGATED, lora=None, prompt_token_ids=[1])


def candidate(worker_id: str, **load: int | float) -> Candidate:
    figures: dict[str, int | float] = {
        "running": 0,
        "waiting": 0,
        "free_slots": 8,
        "kv_usage": 0.0,
        "queued_prefill_tokens": 0,
        **load,
    }
    return Candidate(worker_id=worker_id, **figures)  # type: ignore[arg-type]


def test_no_candidates_means_the_shared_stream() -> None:
    assert LoadPlacer().place(REQUEST, []).reason is PlacementReason.SHARED


def test_the_least_loaded_worker_wins() -> None:
    placed = LoadPlacer().place(
        REQUEST,
        [
            candidate("prefilling", queued_prefill_tokens=900),
            candidate("decoding", running=5),
            candidate("queued", waiting=20),
        ],
    )
    assert (placed.worker_id, placed.reason) == ("decoding", PlacementReason.LOAD)


def test_busy_workers_are_skipped_and_all_busy_means_full() -> None:
    full = candidate("full", free_slots=0)
    thrashing = candidate("thrashing", kv_usage=0.97)
    loaded = candidate("loaded", running=40, queued_prefill_tokens=5000)
    placer = LoadPlacer()
    assert placer.place(REQUEST, [full, thrashing, loaded]).worker_id == "loaded"
    assert placer.place(REQUEST, [full, thrashing]).reason is PlacementReason.FULL


def test_ties_are_broken_at_random() -> None:
    placer = LoadPlacer(rng=random.Random(7))
    chosen = {placer.place(REQUEST, [candidate("a"), candidate("b")]).worker_id for _ in range(50)}
    assert chosen == {"a", "b"}


def registration(worker_id: str, **fields: object) -> WorkerRegistration:
    base: dict[str, object] = {
        "worker_id": worker_id,
        "role": Role.AGGREGATED,
        "model": "m",
        "max_model_len": 256,
        "active": 0,
        "slots": 4,
        "reads_placed": True,
        "reported_ms": int(time.time() * 1000) - 1000,
        **fields,
    }
    return msgspec.convert(base, WorkerRegistration)


async def directory_of(*workers: WorkerRegistration) -> WorkerDirectory:
    redis = fakeredis.aioredis.FakeRedis()
    registry = WorkerRegistry(redis, ttl_s=30.0)
    for worker in workers:
        await registry.beat(worker)
    directory = WorkerDirectory(registry)
    await directory.refresh()
    return directory


async def test_candidates_are_the_workers_that_may_run_the_job() -> None:
    directory = await directory_of(
        registration("ok", engine_stats=EngineStats(kv_cache_usage=0.5), waiting=2),
        registration("draining", draining=True),
        registration("not-ready", ready=False),
        registration("shared-only", reads_placed=False),
        registration("prefill", role=Role.PREFILL),
        registration("with-lora", adapters={"ad": "loaded", "other": "loading"}),
    )
    found = directory.candidates("m", Role.AGGREGATED)
    assert sorted(c.worker_id for c in found) == ["ok", "with-lora"]
    ok = next(c for c in found if c.worker_id == "ok")
    assert (ok.kv_usage, ok.waiting, ok.free_slots) == (0.5, 2, 4)
    shown = directory.loads()["ok"]  # /admin/state
    assert (shown["kv_usage"], shown["waiting"], shown["reads_placed"]) == (0.5, 2, True)
    lora = directory.candidates("m", Role.AGGREGATED, "ad")
    assert [(c.worker_id, c.adapters) for c in lora] == [("with-lora", frozenset({"ad"}))]


async def test_jobs_placed_since_a_report_count_until_the_next_one() -> None:
    directory = await directory_of(registration("w"))
    directory.note_placed("w", jobs=3, prompt_tokens=300)
    [w] = directory.candidates("m", Role.AGGREGATED)
    assert (w.waiting, w.free_slots, w.queued_prefill_tokens) == (3, 1, 300)
    # a report written after the placement shows the jobs itself
    await WorkerRegistry(directory._registry._redis, ttl_s=30.0).beat(
        registration("w", reported_ms=int(time.time() * 1000) + 5, active=3)
    )
    await directory.refresh_loads()
    [w] = directory.candidates("m", Role.AGGREGATED)
    assert (w.waiting, w.free_slots, w.queued_prefill_tokens) == (0, 1, 0)


async def test_the_dispatcher_places_jobs_and_a_burst_spreads() -> None:
    redis = fakeredis.aioredis.FakeRedis()
    registry = WorkerRegistry(redis, ttl_s=30.0)
    for worker_id in ("w1", "w2"):
        await registry.beat(registration(worker_id))
    directory = WorkerDirectory(registry)
    await directory.refresh()
    dispatcher = Dispatcher(
        redis,
        ReplyRouter(redis, names.reply_stream("gw")),
        directory,
        AdmissionPolicy(10, 60, 128, 1.0),
        placer=LoadPlacer(),
    )
    for i in range(4):
        choice = ChoiceSpec(0, [1, 2, 3], SamplingOptions(max_tokens=4))
        plan = RequestPlan(f"r{i}", "m", Generation((choice,), ()), Deadline.after(60), None)
        await dispatcher.submit(plan)
    shared = names.job_stream("m", Role.AGGREGATED)
    own = [await redis.xlen(names.worker_job_stream(shared, w)) for w in ("w1", "w2")]
    assert own == [2, 2]  # the placed jobs count as load until the next report
    assert await redis.xlen(shared) == 0
