"""Keeps the catalog's LoRA adapters equal to the published desired state (every gateway,
whoever registered them), and republishes from SQL when Redis lost it.

Every ``POLL_S`` one GET per base model reads its generation; when it moved, the desired
adapters are read again (:mod:`shared.queue.lora_registry`). A missing generation means Redis lost
the desired state (or nothing was ever published): ``republish`` (the control plane's
SQL registry) puts it back; meanwhile the adapters known before stay served.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.catalog.served_models import ModelCatalog
from shared.errors import ConveyorError
from shared.queue.lora_registry import POLL_S, desired_generation, read_desired

log = logging.getLogger(__name__)


class LoraWatch:
    def __init__(
        self,
        redis: aioredis.Redis,
        catalog: ModelCatalog,
        *,
        owns: Callable[[str], bool] = lambda base: True,
    ) -> None:
        self._redis = redis
        self._catalog = catalog
        self._owns = owns
        """The base models whose desired state lives on ``redis`` (gateway/dispatch/cells.py)."""
        self._seen: dict[str, int] = {}
        self.republish: Callable[[str], Awaitable[object]] | None = None
        """Publish a base model's adapters from SQL (set once the control plane runs)."""

    async def refresh(self) -> None:
        """Read every base model's desired state now. Raises RedisError."""
        for base in filter(self._owns, self._catalog.bases()):
            generation = await desired_generation(self._redis, base)
            if generation is None:
                await self._republish(base)
            elif generation != self._seen.get(base):
                desired = await read_desired(self._redis, base)
                if desired is not None:
                    self._catalog.set_adapters(base, desired.specs.values())
                    self._seen[base] = desired.generation

    async def run(self) -> None:
        while True:
            try:
                await self.refresh()
            except RedisError as exc:
                log.warning("reading the desired LoRA adapters failed: %s", exc)
            await asyncio.sleep(POLL_S)

    async def _republish(self, base: str) -> None:
        if self.republish is None:
            return
        log.warning("the desired LoRA adapters of %s are missing in Redis: republishing", base)
        try:
            await self.republish(base)
        except ConveyorError as exc:  # the database is down: try again next poll
            log.warning("republishing the adapters of %s failed: %s", base, exc.message)
