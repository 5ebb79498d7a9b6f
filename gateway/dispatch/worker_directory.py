"""The gateway's view of live workers, refreshed from the registry about once a second."""

from __future__ import annotations

import asyncio
import logging
import time

from redis.exceptions import RedisError

from gateway.catalog.served_models import ModelKind
from shared.queue.liveness import WorkerRegistration, WorkerRegistry
from shared.queue.lora_registry import serving_workers
from shared.roles import ANSWERING_ROLES, Role

log = logging.getLogger(__name__)


class WorkerDirectory:
    def __init__(
        self, registry: WorkerRegistry, *, refresh_s: float = 1.0, grace_s: float = 3.0
    ) -> None:
        self._registry = registry
        self._refresh_s = refresh_s
        self._grace_s = grace_s
        self._workers: list[WorkerRegistration] = []
        self._seen: dict[str, tuple[float, WorkerRegistration]] = {}
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

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self._refresh_s)

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
