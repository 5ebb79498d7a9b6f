"""The gateway's cells: one per Redis it uses (shared/connections/model_redis.py says which model
is where).

A cell is everything the gateway keeps on one Redis: the connection pool, this
gateway's reply stream and its :class:`~gateway.dispatch.reply_router.ReplyRouter`, the worker
directory (that Redis's registry), admission (its own
:class:`~gateway.dispatch.dispatcher.Dispatcher`: job streams, key-limit counters, open-request
records, cancels), the image store, the adapter watch of the base models that live
there, and the gateway's liveness key (workers on that Redis check it before they
abort an orphaned request). A request goes to the cell of its model (an adapter's:
its base model's) and never touches another.

Without ``CONVEYOR_MODEL_REDIS_URLS`` there is one cell, the home one: the same
objects and tasks as a gateway that knew nothing of cells.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass

import redis.asyncio as aioredis

from gateway.catalog.lora_watch import LoraWatch
from gateway.catalog.served_models import ModelCatalog
from gateway.dispatch.dispatcher import AdmissionPolicy, Dispatcher
from gateway.dispatch.refusal import Refusal
from gateway.dispatch.reply_router import ReplyRouter
from gateway.dispatch.request_tally import RequestTally
from gateway.dispatch.worker_directory import WorkerDirectory
from gateway.placement.cache_placement import CachePlacement
from gateway.placement.placer import Placer
from shared.connections.model_redis import ModelRedis
from shared.connections.url import shown_url
from shared.errors import InvalidApiKey
from shared.queue import names
from shared.queue.liveness import WorkerRegistry, keep_gateway_alive
from shared.queue.media_store import ImageStore
from shared.queue.usage import UsageRecord
from shared.settings import GatewaySettings

log = logging.getLogger(__name__)

LOAD_REFRESH_S = 0.1
"""With placement on, how often the workers' loads are re-read (workers report a change
within ``shared.queue.liveness.REPORT_GAP_S``)."""


@dataclass(slots=True)
class Cell:
    name: str
    """The Redis URL without its password (for /ready, /admin/state and logs)."""
    redis: aioredis.Redis
    router: ReplyRouter
    directory: WorkerDirectory
    dispatcher: Dispatcher
    images: ImageStore
    adapters: LoraWatch
    placement: CachePlacement | None = None
    """Cache-aware placement for this Redis's workers (its index feeder runs in :meth:`tasks`)."""

    def tasks(self, gateway_id: str, liveness_ttl_s: float) -> list[asyncio.Task[None]]:
        """The cell's background tasks (the lifespan cancels them)."""
        label = "" if self.name == "home" else f"[{self.name}]"
        return [
            asyncio.create_task(self.router.run(), name=f"reply-router{label}"),
            asyncio.create_task(self.directory.run(), name=f"worker-directory{label}"),
            asyncio.create_task(
                keep_gateway_alive(self.redis, gateway_id, liveness_ttl_s),
                name=f"gateway-liveness{label}",
            ),
            asyncio.create_task(self.dispatcher.drain.run(), name=f"drain-meter{label}"),
            asyncio.create_task(
                self.dispatcher.accounting.renew_leases(), name=f"limit-leases{label}"
            ),
            asyncio.create_task(self.adapters.run(), name=f"adapter-watch{label}"),
            *self._placement_tasks(label),
        ]

    def _placement_tasks(self, label: str) -> list[asyncio.Task[None]]:
        if self.placement is None:
            return []
        feeder = self.placement.feeder
        return [asyncio.create_task(feeder.run(), name=f"prefix-index{label}")]


class RedisCells:
    """The cells, and which one serves a model."""

    def __init__(self, home: Cell, others: dict[str, Cell], models: ModelRedis) -> None:
        self.home = home
        self._by_url = {models.home_url: home, **others}
        self._models = models
        self.sharded = len(self._by_url) > 1
        """More than one Redis (False: every model is on the home one, no lookup)."""

    def all(self) -> list[Cell]:
        """Every cell, the home one first."""
        return list(self._by_url.values())

    def others(self) -> list[Cell]:
        """The cells of models with their own Redis (not the home one)."""
        return [cell for cell in self._by_url.values() if cell is not self.home]

    def for_model(self, base_model: str) -> Cell:
        """The cell of ``base_model`` (an adapter's requests go to its base model's)."""
        if not self.sharded:
            return self.home
        return self._by_url[self._models.url_of(base_model)]

    def of_worker(self, worker_id: str) -> Cell:
        """The cell whose registry lists ``worker_id`` (the home cell if none does)."""
        for cell in self.all():
            if any(w.worker_id == worker_id for w in cell.directory.all()):
                return cell
        return self.home

    def open_requests(self) -> int:
        return sum(cell.router.open_requests() for cell in self.all())

    def end_requests_of(self, key_ids: set[str]) -> None:
        """A revoked key's open requests end now, in every cell, with a 401."""
        error = InvalidApiKey("The API key of this request was revoked.")
        ended = sum(cell.dispatcher.end_requests_of(key_ids, error) for cell in self.all())
        if ended:
            log.info("ended %d open request(s) of revoked key(s) %s", ended, sorted(key_ids))

    async def wait_background(self) -> None:
        for cell in self.all():
            await cell.dispatcher.wait_background()


def build_cells(
    settings: GatewaySettings,
    models: ModelRedis,
    catalog: ModelCatalog,
    gateway_id: str,
    on_usage: Callable[[UsageRecord, RequestTally], None],
    placer_for: Callable[[aioredis.Redis], Placer | None] = lambda redis: None,
    on_refused: Callable[[Refusal], None] = lambda refusal: None,
) -> RedisCells:
    """One cell per distinct Redis of ``models``; the home one keeps the control plane.
    ``placer_for``: each cell's placer (None: placement off)."""

    def build(url: str, redis: aioredis.Redis, name: str) -> Cell:
        def owns(base: str) -> bool:  # the base models whose adapters are published there
            return models.url_of(base) == url

        placer = placer_for(redis)
        hooks = DispatchHooks(on_usage, on_refused)
        return _cell(settings, redis, catalog, gateway_id, hooks, owns, name, placer)

    home = build(models.home_url, models.home, "home")
    others = {
        url: build(url, redis, shown_url(url))
        for url, redis in models.by_url.items()
        if url != models.home_url
    }
    return RedisCells(home, others, models)


@dataclass(frozen=True, slots=True)
class DispatchHooks:
    """What each cell's dispatcher reports to the gateway's metrics."""

    on_usage: Callable[[UsageRecord, RequestTally], None]
    on_refused: Callable[[Refusal], None]


def _cell(
    settings: GatewaySettings,
    redis: aioredis.Redis,
    catalog: ModelCatalog,
    gateway_id: str,
    hooks: DispatchHooks,
    owns: Callable[[str], bool],
    name: str,
    placer: Placer | None,
) -> Cell:
    router = ReplyRouter(redis, names.reply_stream(gateway_id))
    directory = WorkerDirectory(
        WorkerRegistry(redis, ttl_s=settings.heartbeat_ttl_s),
        load_refresh_s=LOAD_REFRESH_S if placer is not None else None,
    )
    images = ImageStore(redis, max_stored_bytes=settings.image_store_max_bytes)
    policy = AdmissionPolicy.from_settings(settings)
    dispatcher = Dispatcher(
        redis,
        router,
        directory,
        policy,
        images=images,
        on_usage=hooks.on_usage,
        placer=placer,
        on_refused=hooks.on_refused,
    )
    router.on_reconnect = dispatcher.lost.requeue_lost
    return Cell(
        name=name,
        redis=redis,
        router=router,
        directory=directory,
        dispatcher=dispatcher,
        images=images,
        adapters=LoraWatch(redis, catalog, owns=owns),
    )
