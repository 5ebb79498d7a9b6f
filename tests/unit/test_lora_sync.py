"""The worker's LoRA reconciler (workers/commands/lora_sync.py) around a fake engine, on fakeredis
and the real Redis: registered adapters load before the worker reads or reports ready,
an adapter's stream is read only while it is loaded there, removal serves what was
queued and waits for running sequences, failures are reported with their reason."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import redis.asyncio as aioredis

from shared.protocol import ErrorEvent, FinishEvent, GenerateJob
from shared.queue import names
from shared.queue.job_queue import JobQueue
from shared.queue.liveness import WorkerRegistration, WorkerRegistry
from shared.queue.lora_registry import (
    LOADED,
    UNLOADING,
    LoraSpec,
    adapter_stream,
    failure_reason,
    publish_desired,
)
from shared.roles import Role
from tests.conftest import RedisTarget
from tests.unit.worker_harness import MODEL, FakeEngine, Harness, Timing, make_job, worker
from tests.waiting import eventually
from workers.commands.lora_sync import LoraTiming
from workers.engines.base import EngineLoras, LoraLoadError
from workers.engines.lora.gate import LoraClosed, LoraGate
from workers.roles.base import NO_ADAPTERS

FAST = Timing(janitor_s=0.05, adapters=LoraTiming(poll_s=0.02, retry_failed_s=0.2, drain_max_s=5.0))


class FakeLoras:
    """EngineLoras: a folder that exists loads (after ``load_s``); the real gate."""

    def __init__(self, *, max_active: int = 2, load_s: float = 0.0) -> None:
        self.gate = LoraGate(max_active)
        self.load_s = load_s
        self.paths: dict[str, str] = {}
        self.events: list[tuple[str, str, float]] = []

    @property
    def max_active(self) -> int:
        return self.gate.max_active

    def loaded(self) -> list[str]:
        return sorted(self.paths)

    async def load(self, name: str, path: str) -> None:
        await asyncio.sleep(self.load_s)
        if not await asyncio.to_thread(Path(path).is_dir):
            raise LoraLoadError(f"no adapter folder at {path}")
        self.paths[name] = path
        self.events.append(("load", name, time.monotonic()))

    async def unload(self, name: str) -> None:
        self.gate.close(name)
        await self.gate.idle(name)
        self.paths.pop(name, None)
        self.gate.reopen(name)
        self.events.append(("unload", name, time.monotonic()))

    @contextlib.asynccontextmanager
    async def running(self, name: str | None) -> AsyncIterator[None]:
        from shared.errors import ModelNotFound

        if name is not None and name not in self.paths:
            raise ModelNotFound(f"adapter {name!r} is not loaded on this worker")
        try:
            async with self.gate.hold(name):
                yield
        except LoraClosed:
            raise ModelNotFound(f"adapter {name!r} is being unloaded") from None


class LoraEngine(FakeEngine):
    """A FakeEngine that serves adapters (what generate.parts looks for)."""

    def __init__(self, adapters: EngineLoras | None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.adapters = adapters
        self.adapters_off = "LoRA is off on this worker (test)"
        self.started_at: dict[str, float] = {}

    def generate(self, job_id: str, *args: Any, **kwargs: Any) -> Any:
        self.started_at[job_id] = time.monotonic()
        return super().generate(job_id, *args, **kwargs)


def adapter_job(request_id: str, adapter: str, **kwargs: Any) -> GenerateJob:
    return msgspec.structs.replace(make_job(request_id, **kwargs), model=adapter, adapter=adapter)


async def submit(redis: aioredis.Redis, stream: str, *jobs: GenerateJob) -> None:
    result = await JobQueue(redis).submit(stream, list(jobs), max_depth=1000)
    assert result.outcome.value == "queued"


async def registration(w: Harness) -> WorkerRegistration | None:
    found = await WorkerRegistry(w.redis, ttl_s=1).live_workers()
    return found[0] if found else None


async def adapter_states(w: Harness) -> dict[str, str]:
    entry = await registration(w)
    return {} if entry is None else dict(entry.adapters)


def spec(name: str, path: Path | str) -> LoraSpec:
    return LoraSpec(name=name, path=str(path), base_model=MODEL)


async def test_registered_adapters_load_before_the_worker_reads_or_is_ready(
    redis_target: RedisTarget, tmp_path: Path
) -> None:
    adapters = FakeLoras(load_s=0.3)
    engine = LoraEngine(adapters)
    seen: list[WorkerRegistration] = []

    async def setup(redis: aioredis.Redis) -> None:
        await publish_desired(redis, MODEL, [spec("a", tmp_path), spec("b", tmp_path / "x")])
        await submit(redis, names.job_stream(MODEL, Role.AGGREGATED), make_job("base"))
        await submit(redis, adapter_stream("a"), adapter_job("lora", "a"))

    async with worker(redis_target, engine, setup=setup, timing=FAST, heartbeat_ttl_s=0.2) as w:

        async def both_done() -> bool:
            entry = await registration(w)
            if entry is not None:
                seen.append(entry)
            return len(engine.completed) == 2 and entry is not None and entry.ready

        await eventually(both_done, what="both jobs to run and the worker to be ready")
        loaded_at = max(t for kind, _, t in adapters.events if kind == "load")
        assert min(engine.started_at.values()) >= loaded_at  # nothing read before
        assert engine.adapters_used == [None, "a"] or engine.adapters_used == ["a", None]
        assert all(not entry.ready for entry in seen if entry.adapters.get("a") != LOADED)
        final = seen[-1]
        assert final.adapters["a"] == LOADED and final.adapters_generation == 1
        assert failure_reason(final.adapters["b"]) == f"no adapter folder at {tmp_path / 'x'}"


async def test_an_adapter_stream_is_read_only_while_loaded_here(
    redis_target: RedisTarget, tmp_path: Path
) -> None:
    adapters = FakeLoras()
    engine = LoraEngine(adapters, tokens=3, step_s=0.02)
    async with worker(redis_target, engine, timing=FAST, heartbeat_ttl_s=0.2) as w:
        await submit(w.redis, adapter_stream("a"), adapter_job("early", "a"))
        await asyncio.sleep(0.3)
        assert engine.started == []  # not loaded here: its stream is not read
        await publish_desired(w.redis, MODEL, [spec("a", tmp_path)])
        await w.final_events("early")
        assert engine.adapters_used == ["a"]

        # Removal: what was queued before it is served, running sequences finish, then
        # the adapter unloads and its stream is no longer read.
        await submit(w.redis, adapter_stream("a"), *(adapter_job(f"q{i}", "a") for i in range(6)))
        await publish_desired(w.redis, MODEL, [])

        async def unloaded() -> bool:
            return ("unload", "a") in [(k, n) for k, n, _ in adapters.events]

        async def reported_unloading() -> bool:
            return (await adapter_states(w)).get("a") == UNLOADING or await unloaded()

        await eventually(reported_unloading, what="the worker to report unloading")
        await eventually(unloaded, what="the adapter to unload")
        for i in range(6):
            [*_, last] = await w.final_events(f"q{i}")
            assert isinstance(last, FinishEvent)
        unload_at = next(t for k, _, t in adapters.events if k == "unload")
        assert all(engine.started_at[f"q{i}/0"] < unload_at for i in range(6))
        await eventually(lambda: _empty(w), what="the report to drop the adapter")
        await submit(w.redis, adapter_stream("a"), adapter_job("late", "a"))
        await asyncio.sleep(0.3)
        assert "late/0" not in engine.started
        assert await w.redis.xlen(adapter_stream("a")) == 1


async def _empty(w: Harness) -> bool:
    return await adapter_states(w) == {}


async def test_a_failed_adapter_loads_once_its_folder_appears(
    redis_target: RedisTarget, tmp_path: Path
) -> None:
    adapters = FakeLoras()
    folder = tmp_path / "late"
    async with worker(redis_target, LoraEngine(adapters), timing=FAST, heartbeat_ttl_s=0.2) as w:
        await publish_desired(w.redis, MODEL, [spec("a", folder)])

        async def state_is(expected: str) -> bool:
            state = (await adapter_states(w)).get("a", "")
            return state.startswith(expected)

        await eventually(lambda: state_is("failed: no adapter folder"), what="a failure")
        folder.mkdir()
        await eventually(lambda: state_is(LOADED), what="the retry to load it")


async def test_a_worker_without_lora_reports_why(redis_target: RedisTarget, tmp_path: Path) -> None:
    async with worker(redis_target, LoraEngine(None), timing=FAST, heartbeat_ttl_s=0.2) as w:
        await publish_desired(w.redis, MODEL, [spec("a", tmp_path)])

        async def reported() -> bool:
            state = (await adapter_states(w)).get("a", "")
            return failure_reason(state) == "LoRA is off on this worker (test)"

        await eventually(reported, what="the reason")
        # A job naming an adapter that reached it anyway fails cleanly (404), no crash.
        await submit(w.redis, w.stream, adapter_job("stray", "a"))
        [event] = await w.final_events("stray")
        assert isinstance(event, ErrorEvent) and event.status == 404
    assert NO_ADAPTERS  # the default reason for engines that have no adapters at all


async def test_lost_desired_state_keeps_what_is_loaded(
    redis_target: RedisTarget, tmp_path: Path
) -> None:
    adapters = FakeLoras()
    async with worker(redis_target, LoraEngine(adapters), timing=FAST, heartbeat_ttl_s=0.2) as w:
        await publish_desired(w.redis, MODEL, [spec("a", tmp_path)])
        await eventually(lambda: _loaded(w, "a"), what="a to load")
        await w.redis.delete(names.adapters_desired(MODEL), names.adapters_generation(MODEL))
        await asyncio.sleep(0.3)
        assert adapters.loaded() == ["a"] and await _loaded(w, "a")


async def _loaded(w: Harness, name: str) -> bool:
    return (await adapter_states(w)).get(name) == LOADED


async def test_unloading_waits_for_running_sequences(
    redis_target: RedisTarget, tmp_path: Path
) -> None:
    adapters = FakeLoras()
    engine = LoraEngine(adapters, tokens=30, step_s=0.02)
    async with worker(redis_target, engine, timing=FAST, heartbeat_ttl_s=0.2) as w:
        await publish_desired(w.redis, MODEL, [spec("a", tmp_path)])
        await eventually(lambda: _loaded(w, "a"), what="a to load")
        await submit(w.redis, adapter_stream("a"), adapter_job("long", "a", max_tokens=30))
        await eventually(lambda: _true(engine.running() == 1), what="the job to start")
        await publish_desired(w.redis, MODEL, [])
        [*_, last] = await w.final_events("long")
        assert isinstance(last, FinishEvent) and last.completion_tokens == 30
        await eventually(lambda: _empty(w), what="the unload")
        unload_at = next(t for k, _, t in adapters.events if k == "unload")
        assert unload_at > engine.started_at["long/0"] + 0.5  # after its 30 steps


async def _true(value: bool) -> bool:
    return value
