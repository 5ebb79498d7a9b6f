"""The gateway's SQL-backed parts and their background tasks, owned by the app's lifespan.

Start-up:
1. open the database (the embedded SQLite file by default);
2. embedded: migrate it to head (fatal if that fails). An external database
   (CONVEYOR_DATABASE_URL) is never migrated here: while it is not at head, /ready
   is 503 and says to run `conveyor db upgrade`; it is checked again every few seconds;
3. load the API keys into the cache (a failure is not fatal: the cache retries);
4. publish the LoRA registry (SQL) to Redis, the desired state workers load (a failure
   is not fatal: the adapter watch republishes when it sees the state missing);
5. start the key-cache poller, the ledger consumer, the sweep that writes the usage of
   dead gateways' requests, the schema watch and retention.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.control import response_store
from gateway.control.key_cache import KeyCache
from gateway.control.key_service import KeyService
from gateway.control.ledger import DATABASE_ERRORS, LedgerConsumer, backlog
from gateway.control.ledger_retention import retention_loop
from gateway.control.lora_service import LoraService
from gateway.control.orphan_usage import OrphanUsageSweep
from gateway.db.engine import Database, first_line, open_database
from gateway.db.schema import SchemaStatus, schema_status, upgrade_to_head
from shared.errors import ConveyorError
from shared.queue.liveness import GatewayWatch
from shared.settings import GatewaySettings
from shared.tasks import cancel_and_wait

log = logging.getLogger(__name__)

SCHEMA_CHECK_BEHIND_S = 5.0
SCHEMA_CHECK_AT_HEAD_S = 30.0


class ControlPlane:
    def __init__(
        self,
        settings: GatewaySettings,
        redis: aioredis.Redis,
        gateway_id: str,
        *,
        bases: Callable[[], Iterable[str]] = tuple,
        cells: Sequence[aioredis.Redis] = (),
        redis_for: Callable[[str], aioredis.Redis] | None = None,
    ) -> None:
        """``redis`` is the home Redis; ``cells`` the other Redis a sharded gateway uses
        (each has its own usage stream and open requests: a ledger consumer and an orphan
        sweep each); ``redis_for`` a base model's Redis (its LoRA desired state)."""
        self.settings = settings
        self.embedded = settings.database_is_embedded()
        self.database: Database = open_database(settings.database_url_or_default())
        self.keys = KeyCache(self.database.sessions, redis, admin_secret=settings.admin_secret())
        self.key_service = KeyService(self.database.sessions, redis, on_change=self.keys.reload)
        self.responses = response_store.ResponseStore(self.database.sessions)
        self.ledger = LedgerConsumer(redis, self.database.sessions, gateway_id)
        self.orphan_usage = self._sweep(redis, gateway_id)
        self.cell_usage = [self._usage_of(cell, gateway_id) for cell in cells]
        """Per other Redis: its ledger consumer and orphan-usage sweep."""
        self.lora = LoraService(
            self.database.sessions,
            redis,
            bases=bases,
            load_timeout_s=settings.lora_load_timeout_s,
            roots=settings.lora_root_paths(),
            redis_for=redis_for,
        )
        self.schema: SchemaStatus | None = None
        """The last schema version read (None: never read)."""
        self.schema_error: str | None = None
        self._redis = redis
        self._cells = list(cells)
        self._tasks: list[asyncio.Task[None]] = []

    def _usage_of(
        self, redis: aioredis.Redis, gateway_id: str
    ) -> tuple[LedgerConsumer, OrphanUsageSweep]:
        return LedgerConsumer(redis, self.database.sessions, gateway_id), self._sweep(
            redis, gateway_id
        )

    def _sweep(self, redis: aioredis.Redis, gateway_id: str) -> OrphanUsageSweep:
        grace_s = self.settings.gateway_liveness_ttl_s
        return OrphanUsageSweep(redis, gateway_id, GatewayWatch(redis, grace_s=grace_s))

    @property
    def schema_at_head(self) -> bool:
        return self.schema is not None and self.schema.at_head

    async def start(self) -> None:
        log.info(
            "database: %s (%s)",
            self.database.url,
            "embedded, migrated automatically" if self.embedded else "external",
        )
        if self.embedded:
            await upgrade_to_head(self.database.engine)
        await self.check_schema()
        if self.schema is not None and (problem := self.schema.problem()):
            log.error("%s", problem)
        await self.keys.reload()
        self._warn_without_keys()
        await self._publish_adapters()
        self._tasks = [
            asyncio.create_task(self.keys.run(), name="api-key-cache"),
            asyncio.create_task(self.ledger.run(), name="ledger-consumer"),
            asyncio.create_task(self.orphan_usage.run(), name="orphan-usage"),
            asyncio.create_task(self._watch_schema(), name="schema-watch"),
            asyncio.create_task(
                retention_loop(
                    self._redis, self.database.sessions, self.settings.usage_retention_days
                ),
                name="ledger-retention",
            ),
            asyncio.create_task(
                response_store.retention_loop(
                    self._redis, self.database.sessions, self.settings.responses_retention_days
                ),
                name="responses-retention",
            ),
        ]
        for index, (ledger, sweep) in enumerate(self.cell_usage, start=1):
            self._tasks += [
                asyncio.create_task(ledger.run(), name=f"ledger-consumer[{index}]"),
                asyncio.create_task(sweep.run(), name=f"orphan-usage[{index}]"),
            ]

    async def stop(self) -> None:
        await cancel_and_wait(self._tasks)
        await self.database.dispose()

    async def _publish_adapters(self) -> None:
        if not self.schema_at_head:
            return
        try:
            await self.lora.publish_all()
        except (ConveyorError, RedisError) as exc:
            log.error("could not publish the LoRA registry: %s (retried by the watch)", exc)

    async def check_schema(self) -> None:
        try:
            self.schema = await schema_status(self.database.engine)
            self.schema_error = None
        except DATABASE_ERRORS as exc:
            self.schema_error = first_line(exc)

    async def _watch_schema(self) -> None:
        while True:
            behind = not self.schema_at_head
            await asyncio.sleep(SCHEMA_CHECK_BEHIND_S if behind else SCHEMA_CHECK_AT_HEAD_S)
            await self.check_schema()
            if behind and self.schema_at_head:
                log.info("database schema is at head now (%s)", self.schema and self.schema.head)
                await self.keys.reload()

    def _warn_without_keys(self) -> None:
        status = self.keys.status()
        if self.settings.auth_enabled() and not self.settings.admin_secret() and not status.keys:
            log.warning(
                "auth is on but no API key is known%s: create one with "
                "`conveyor keys create --name admin --scopes admin`",
                "" if status.loaded else f" ({status.error})",
            )

    async def readiness(self) -> tuple[list[str], dict[str, Any]]:
        """(problems that make /ready 503, what /ready reports about the control plane)."""
        problems: list[str] = []
        if self.schema is None:
            problems.append(f"database schema unknown: {self.schema_error}")
        elif problem := self.schema.problem():
            problems.append(problem)
        keys = self.keys.status()
        if self.settings.auth_enabled() and not keys.loaded:
            problems.append(f"API keys could not be loaded from the database: {keys.error}")
        return problems, {
            "auth": "on" if self.settings.auth_enabled() else "off",
            "database": self._database_report(),
            "api_keys": keys.to_json(),
            "ledger": await self._ledger_report(),
        }

    def _database_report(self) -> dict[str, Any]:
        errors = [self.keys.status().error, self.ledger.status.last_error, self.schema_error]
        error = next((e for e in errors if e), None)
        return {
            "dialect": self.database.dialect,
            "embedded": self.embedded,
            "reachable": error is None,
            "error": error,
            "schema": {
                "current": self.schema.current if self.schema else None,
                "head": self.schema.head if self.schema else None,
                "at_head": self.schema_at_head,
            },
        }

    def ledgers(self) -> list[LedgerConsumer]:
        """Every ledger consumer: the home Redis's, then one per other Redis."""
        return [self.ledger, *(ledger for ledger, _ in self.cell_usage)]

    def orphan_rows(self) -> int:
        sweeps = [self.orphan_usage, *(sweep for _, sweep in self.cell_usage)]
        return sum(sweep.rows_written for sweep in sweeps)

    async def backlog(self) -> int:
        """Usage rows waiting in every Redis's usage stream. Raises RedisError."""
        total = await backlog(self._redis)
        for cell in self._cells:
            total += await backlog(cell)
        return total

    async def _ledger_report(self) -> dict[str, Any]:
        statuses = [ledger.status for ledger in self.ledgers()]
        try:
            pending: int | None = await self.backlog()
        except RedisError:
            pending = None
        return {
            "db_ok": all(status.db_ok for status in statuses),
            "backlog": pending,
            "rows_written": sum(status.rows_written for status in statuses),
            "duplicates_skipped": sum(status.duplicates_skipped for status in statuses),
            "dead_lettered": sum(status.dead_lettered for status in statuses),
            "error": next((status.last_error for status in statuses if status.last_error), None),
        }
