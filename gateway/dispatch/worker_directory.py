"""The gateway's view of live workers, refreshed from the registry about once a second.

With placement on, the loads of the known workers are also re-read every
``load_refresh_s`` (one MGET), and the jobs this gateway placed on a worker after its
last report are added to that report (:meth:`WorkerDirectory.candidates`), so a burst
does not all land on the worker that looked idle.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from redis.exceptions import RedisError

from gateway.catalog.served_models import ModelKind
from gateway.placement.placer import Candidate
from shared.queue.liveness import WorkerRegistration, WorkerRegistry
from shared.queue.lora_registry import LOADED, serving_workers
from shared.roles import ANSWERING_ROLES, Role

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class PlacedJobs:
    """Jobs this gateway placed on a worker at one moment."""

    at_ms: int
    jobs: int
    prompt_tokens: int


class WorkerDirectory:
    def __init__(
        self,
        registry: WorkerRegistry,
        *,
        refresh_s: float = 1.0,
        grace_s: float = 3.0,
        load_refresh_s: float | None = None,
    ) -> None:
        self._registry = registry
        self._refresh_s = refresh_s
        self._grace_s = grace_s
        self._load_refresh_s = load_refresh_s
        self._workers: list[WorkerRegistration] = []
        self._seen: dict[str, tuple[float, WorkerRegistration]] = {}
        self._placed: dict[str, list[PlacedJobs]] = {}
        """Per worker: the jobs placed here that its last report may not show yet."""
        self.refreshed_monotonic = 0.0
        self.redis_ok = False

    async def refresh(self) -> None:
        try:
            live = await self._registry.live_workers()
            now = time.monotonic()
            self.redis_ok = True
            self.refreshed_monotonic = now
        except RedisError as exc:
            self.redis_ok = False
            log.warning("worker registry unreachable: %s", exc)
            return
        # A heartbeat that arrives a little late must not flap the pool to "no worker":
        # keep a worker that left without saying so for a short grace period.
        for worker in live:
            self._seen[worker.worker_id] = (now, worker)
        for worker_id, (seen, _) in list(self._seen.items()):
            if now - seen > self._grace_s:
                del self._seen[worker_id]
        self._workers = [worker for _, worker in self._seen.values()]

    async def refresh_loads(self) -> None:
        """Re-read the registry entries of the workers known (their loads), in one MGET."""
        known = list(self._seen)
        try:
            fresh = await self._registry.entries(known)
        except RedisError as exc:
            log.warning("worker registry unreachable: %s", exc)
            return
        now = time.monotonic()
        for worker in fresh:
            if worker.worker_id in self._seen:
                self._seen[worker.worker_id] = (now, worker)
        self._workers = [worker for _, worker in self._seen.values()]

    async def run(self) -> None:
        while True:
            await self.refresh()
            if self._load_refresh_s is None:
                await asyncio.sleep(self._refresh_s)
                continue
            deadline = time.monotonic() + self._refresh_s
            while time.monotonic() < deadline:
                await asyncio.sleep(self._load_refresh_s)
                await self.refresh_loads()

    def candidates(self, model: str, role: Role, lora: str | None = None) -> list[Candidate]:
        """The workers a job of ``model`` (or of LoRA adapter ``lora`` of it) in ``role``
        may be placed on: ready, not draining, reading an own stream, adapter loaded; each
        as last reported plus what this gateway placed on it since."""
        return [
            self._candidate(w)
            for w in self.serving(model, role)
            if w.reads_placed and (lora is None or w.adapters.get(lora) == LOADED)
        ]

    def _candidate(self, worker: WorkerRegistration) -> Candidate:
        jobs = prompt_tokens = 0
        placed = self._placed.get(worker.worker_id)
        if placed:  # runs per worker for every request placed: nothing to add is the fast path
            since = [p for p in placed if p.at_ms >= worker.reported_ms]
            if since:
                self._placed[worker.worker_id] = since
                jobs = sum(p.jobs for p in since)
                prompt_tokens = sum(p.prompt_tokens for p in since)
            else:
                del self._placed[worker.worker_id]
        stats = worker.engine_stats
        return Candidate(
            worker_id=worker.worker_id,
            running=worker.engine_running,
            waiting=worker.waiting + jobs,
            free_slots=max(0, worker.slots - worker.active - jobs),
            kv_usage=stats.kv_cache_usage if stats is not None else 0.0,
            queued_prefill_tokens=worker.queued_prefill_tokens + prompt_tokens,
            adapters=_loaded(worker.adapters),
        )

    def loads(self) -> dict[str, dict[str, object]]:
        """Each worker's load as placement sees it (its last report and what this gateway
        placed on it since), for /admin/state."""
        loads: dict[str, dict[str, object]] = {}
        for worker in self._workers:
            load = self._candidate(worker)
            loads[worker.worker_id] = {
                "model": worker.model,
                "role": worker.role.value,
                "ready": worker.ready,
                "draining": worker.draining,
                "reads_placed": worker.reads_placed,
                "running": load.running,
                "waiting": load.waiting,
                "free_slots": load.free_slots,
                "kv_usage": load.kv_usage,
                "queued_prefill_tokens": load.queued_prefill_tokens,
                "steals": worker.steals,
            }
        return loads

    def note_placed(self, worker_id: str, jobs: int, prompt_tokens: int) -> None:
        """This gateway placed ``jobs`` on ``worker_id``: counted in its load until a
        report written after now."""
        placed = PlacedJobs(int(time.time() * 1000), jobs, prompt_tokens)
        self._placed.setdefault(worker_id, []).append(placed)

    def serving(self, model: str, role: Role | None = None) -> list[WorkerRegistration]:
        return [
            w
            for w in self._workers
            if w.model == model and w.ready and not w.draining and (role is None or w.role == role)
        ]

    def first_stage(
        self, model: str, prompt_tokens: int, disagg_min_prompt_tokens: int
    ) -> Role | None:
        """Where a request starts: prefill (then decode) when the model has both pools and
        the prompt fills a KV block; otherwise aggregated, or decode alone; None if nothing."""
        has_prefill = bool(self.serving(model, Role.PREFILL))
        decoders = self.serving(model, Role.DECODE)
        has_decode = bool(decoders)
        if not all(w.can_decode_alone for w in decoders):
            disagg_min_prompt_tokens = 0
        if has_prefill and has_decode and prompt_tokens >= disagg_min_prompt_tokens:
            return Role.PREFILL
        if self.serving(model, Role.AGGREGATED):
            return Role.AGGREGATED
        if has_decode:
            return Role.DECODE
        return None

    def answers(self, model: str, kind: str) -> bool:
        """Whether a request can run to the end: an encode worker alone cannot answer."""
        if kind == ModelKind.EMBED:
            return bool(self.serving(model, Role.EMBED))
        return any(self.serving(model, role) for role in ANSWERING_ROLES)

    def adapter_ready(self, adapter: str) -> bool:
        """A live worker has LoRA adapter ``adapter`` loaded (and takes jobs)."""
        return bool(serving_workers(self._workers, adapter))

    def pools(self) -> dict[str, dict[Role, int]]:
        """Ready, non-draining workers per model and role: what routing can use now."""
        pools: dict[str, dict[Role, int]] = {}
        for w in self._workers:
            if w.ready and not w.draining:
                roles = pools.setdefault(w.model, {})
                roles[w.role] = roles.get(w.role, 0) + 1
        return pools

    def all(self) -> list[WorkerRegistration]:
        return list(self._workers)


_NO_ADAPTERS: frozenset[str] = frozenset()


def _loaded(adapters: dict[str, str]) -> frozenset[str]:
    if not adapters:
        return _NO_ADAPTERS
    return frozenset(name for name, state in adapters.items() if state == LOADED)
