"""A worker's health, as others see it and as it checks itself.

* :class:`WorkerStatus` builds the registry entry (role, model, load, readiness,
  KV and cache telemetry, LoRA adapters, the engine's scheduler stats) that the heartbeat writes.
* :class:`Heartbeat` keeps that entry alive: from a
  :class:`~shared.queue.liveness.HeartbeatThread` in production, from the event loop
  when there is none (tests on fakeredis).
* :class:`EngineMonitor` asks the engine for its health every few seconds; a dead
  engine stops the worker (its jobs are handed back, it exits non-zero).
* ``ready`` is the idle canary's verdict (:class:`workers.health.canary.Canary`), and never
  before the LoRA reconciler's first pass has loaded the registered adapters
  (:mod:`workers.commands.lora_sync`).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Protocol

from redis.exceptions import RedisError

from shared.errors import EngineDead
from shared.queue.liveness import HeartbeatThread, WorkerRegistration, WorkerRegistry
from shared.roles import Role
from workers.engines.base import EngineBase, ReportsStats
from workers.health.canary import Canary
from workers.intake.active_jobs import ActiveJobs, Lifecycle
from workers.roles.base import RoleParts

log = logging.getLogger(__name__)

HEALTH_CHECK_INTERVAL_S = 2.0


class LoraReport(Protocol):
    """The LoRA reconciler's report (:class:`workers.commands.lora_sync.LoraReconciler`)."""

    generation: int
    synced: bool

    def report(self) -> dict[str, str]: ...


class PlacementReport(Protocol):
    """The job consumer's placement figures (:class:`workers.intake.consumer.JobConsumer`)."""

    @property
    def reads_placed(self) -> bool: ...

    @property
    def steals(self) -> int: ...


class WorkerStatus:
    def __init__(
        self,
        *,
        worker_id: str,
        role: Role,
        parts: RoleParts,
        jobs: ActiveJobs,
        lifecycle: Lifecycle,
        canary: Canary,
        adapters: LoraReport | None = None,
        placement: PlacementReport | None = None,
        reclaims: Callable[[], int] = lambda: 0,
    ) -> None:
        self._worker_id = worker_id
        self._role = role
        self._parts = parts
        self._jobs = jobs
        self._lifecycle = lifecycle
        self._canary = canary
        self._adapters = adapters
        self._placement = placement
        self._reclaims = reclaims

    def __call__(self) -> WorkerRegistration:
        engine = self._parts.engine
        stats = engine.prompt_stats
        adapters = self._adapters
        engine_stats = (
            engine.engine_stats.snapshot()
            if isinstance(engine, ReportsStats) and engine.engine_stats.enabled
            else None
        )
        placement = self._placement
        return WorkerRegistration(
            worker_id=self._worker_id,
            role=self._role,
            model=engine.info.model,
            max_model_len=engine.info.max_model_len,
            active=len(self._jobs),
            engine_running=engine.running(),
            slots=self._jobs.max_slots,
            draining=self._lifecycle.stopping or self._lifecycle.paused,
            paused=self._lifecycle.paused,
            # Not ready before every registered adapter was loaded (or failed).
            ready=self._canary.healthy and (adapters is None or adapters.synced),
            can_decode_alone=engine.info.can_decode_alone,
            prompt_tokens_computed=stats.computed,
            prompt_tokens_transferred=stats.transferred,
            kv_transfers=stats.kv_transfers,
            kv_transfer_s=round(stats.kv_transfer_s, 6),
            embedding_cache=self._parts.cache_stats(),
            adapters={} if adapters is None else adapters.report(),
            adapters_generation=0 if adapters is None else adapters.generation,
            engine_stats=engine_stats,
            waiting=self._jobs.not_started() + (engine_stats.waiting if engine_stats else 0),
            queued_prefill_tokens=self._jobs.queued_prefill_tokens(),
            reads_placed=placement is not None and placement.reads_placed,
            steals=0 if placement is None else placement.steals,
            reclaims=self._reclaims(),
            reported_ms=int(time.time() * 1000),
        )


class Heartbeat:
    def __init__(
        self,
        registry: WorkerRegistry,
        status: Callable[[], WorkerRegistration],
        thread: HeartbeatThread | None,
    ) -> None:
        self._registry = registry
        self._status = status
        self._thread = thread

    async def run(self) -> None:
        if self._thread is not None:
            await self._thread.run()
            return
        while True:  # from the event loop (tests on fake Redis)
            try:
                await self._registry.beat(self._status())
            except RedisError as exc:
                log.warning("heartbeat failed: %s", exc)
            await asyncio.sleep(self._registry.ttl_s / 4)


class EngineMonitor:
    def __init__(
        self, engine: EngineBase, *, interval_s: float, on_dead: Callable[[], None]
    ) -> None:
        self._engine = engine
        self._interval_s = interval_s
        self._on_dead = on_dead

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self._engine.check_health()
            except EngineDead:
                self._on_dead()
                return
