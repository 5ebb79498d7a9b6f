"""Registering and removing LoRA adapters (for /admin/loras, vLLM's load/unload bodies and
``conveyor lora``): SQL is the truth, Redis carries it to workers.

A change, under a Redis lock per adapter name (one change at a time across gateways and
the CLI):

1. check what can be checked here: the name, the path's shape, that ``base_model`` is a
   generation model served here, that a live worker of it serves adapters (else 503);
2. commit the row, then publish the base model's rows to the desired state
   (:func:`publish`, under a lock per base model: a publish never carries a stale read);
3. wait for the workers' reports (:func:`shared.queue.lora_registry.wait_for_rollout`): the answer
   is the rollout once one worker has it loaded. When every worker refused it (the
   workers check the folder, the rank and the base), or none loaded it in time, the row is
   deleted and the desired state published again: nothing stays registered.

Registering the same spec again is a no-op answered with the current rollout; another
spec under a registered name is a 409 (delete it first).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath

import redis.asyncio as aioredis
from redis.exceptions import LockError, RedisError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.db import lora_repo
from gateway.db.engine import transaction
from gateway.db.models import LoraAdapterRow
from shared.errors import (
    BackendUnavailable,
    InvalidRequest,
    LoraConflict,
    LoraLoadFailed,
    LoraLoadTimeout,
    LoraNotFound,
    ModelNotFound,
    NoLiveWorker,
)
from shared.lora_paths import OUTSIDE_ROOTS, resolve_in_roots
from shared.queue import names
from shared.queue.liveness import WorkerRegistration, WorkerRegistry
from shared.queue.lora_registry import (
    SERVING_ROLE,
    LoraSpec,
    Rollout,
    publish_desired,
    validate_adapter_name,
    wait_for_rollout,
)

log = logging.getLogger(__name__)

MAX_PATH_CHARS = 4096
PUBLISH_LOCK_S = 10.0


@dataclass(frozen=True, slots=True)
class Registered:
    """A registered adapter and where it stands on the live workers."""

    spec: LoraSpec
    created_at: datetime
    workers: dict[str, str]
    """Worker id -> ``loaded`` / ``loading`` / ``unloading`` / ``failed: <reason>`` /
    ``pending`` (has not applied the registration yet)."""


def spec_of(row: LoraAdapterRow) -> LoraSpec:
    return LoraSpec(name=row.name, path=row.path, base_model=row.base_model)


class LoraService:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        redis: aioredis.Redis,
        *,
        bases: Callable[[], Iterable[str]],
        load_timeout_s: float,
        roots: Sequence[Path],
        redis_for: Callable[[str], aioredis.Redis] | None = None,
    ) -> None:
        """``redis`` holds the adapter locks; ``redis_for(base_model)`` the Redis of a base
        model's workers, where its desired state is published (default ``redis``); an
        adapter's path must lie inside ``roots`` (CONVEYOR_LORA_ROOTS)."""
        self._sessions = sessions
        self._redis = redis
        self._redis_for: Callable[[str], aioredis.Redis] = redis_for or (lambda base: redis)
        self._bases = bases
        """The generation models served here: the base models adapters may name."""
        self._load_timeout_s = load_timeout_s
        self._roots = tuple(roots)

    # ------------------------------------------------------------------ publishing

    async def publish(self, base_model: str) -> int:
        """Publish ``base_model``'s registered adapters (from SQL) as the desired state;
        returns its generation. Raises RedisError."""
        redis = self._redis_for(base_model)
        async with redis.lock(
            names.adapters_publish_lock(base_model), timeout=PUBLISH_LOCK_S, blocking_timeout=30
        ):
            async with transaction(self._sessions) as session:
                rows = await lora_repo.of_base(session, base_model)
            return await publish_desired(redis, base_model, [spec_of(r) for r in rows])

    async def publish_all(self) -> None:
        """Every base model's desired state from SQL (start-up: a restarted gateway, or a
        Redis that lost its data, loses nothing)."""
        async with transaction(self._sessions) as session:
            rows = await lora_repo.list_all(session)
        for base in sorted({*self._bases(), *(row.base_model for row in rows)}):
            generation = await self.publish(base)
            count = sum(row.base_model == base for row in rows)
            log.info("published %d LoRA adapter(s) of %s (generation %d)", count, base, generation)

    # ------------------------------------------------------------------ changes

    async def register(self, spec: LoraSpec) -> Rollout:
        """Register ``spec`` and return its rollout once a worker has it loaded; raises
        InvalidRequest, ModelNotFound, LoraConflict, NoLiveWorker, LoraLoadFailed or
        LoraLoadTimeout (the last three leave nothing registered that was not before)."""
        self._check(spec)
        async with self._locked(spec.name):
            async with transaction(self._sessions) as session:
                existing = await lora_repo.get(session, spec.name)
            if existing is not None and spec_of(existing) != spec:
                raise LoraConflict(
                    f"adapter `{spec.name}` is registered with path {existing.path} for "
                    f"`{existing.base_model}`; remove it first to register another",
                    param="name",
                )
            if not await self._workers_of(spec.base_model):
                raise NoLiveWorker(
                    f"no live worker of `{spec.base_model}` serves LoRA adapters; nothing "
                    "registered",
                    retry_after_s=5,
                )
            if existing is None:
                await self._insert(spec)
            state = await self._roll_out(spec, new=existing is None)
        log.info("adapter %s registered: loaded on %s", spec.name, ", ".join(state.loaded))
        return state

    async def add_if_absent(self, spec: LoraSpec) -> bool:
        """Register ``spec`` without waiting for workers (``conveyor up``'s demo adapter,
        before any worker runs: they load it before they report ready)."""
        self._check(spec)
        async with transaction(self._sessions) as session:
            if await lora_repo.get(session, spec.name) is not None:
                return False
            await lora_repo.insert(session, _row(spec))
        return True

    async def unregister(self, name: str) -> LoraSpec:
        """Remove adapter ``name``: workers finish its queued and running requests, then
        unload it. Raises LoraNotFound; on a Redis failure the row is put back."""
        try:
            validate_adapter_name(name)
        except ValueError:
            raise LoraNotFound(f"no LoRA adapter `{name[:128]}` is registered") from None
        async with self._locked(name):
            async with transaction(self._sessions) as session:
                row = await lora_repo.get(session, name)
                if row is None:
                    raise LoraNotFound(f"no LoRA adapter `{name}` is registered", param="name")
                spec = spec_of(row)
                await lora_repo.remove(session, name)
            try:
                await self.publish(spec.base_model)
            except RedisError as exc:
                await self._insert(spec)
                raise _unreachable("could not publish the removal", exc) from exc
        log.info("adapter %s removed", name)
        return spec

    async def list_registered(self) -> list[Registered]:
        async with transaction(self._sessions) as session:
            rows = await lora_repo.list_all(session)
        workers = {base: await self._live_workers(base) for base in {r.base_model for r in rows}}
        return [
            Registered(
                spec_of(row),
                row.created_at,
                _states(workers[row.base_model], row.name, row.base_model),
            )
            for row in rows
        ]

    async def _live_workers(self, base_model: str) -> list[WorkerRegistration]:
        """The live workers of the Redis ``base_model`` lives on. Raises RedisError."""
        return await WorkerRegistry(self._redis_for(base_model), ttl_s=1.0).live_workers()

    # ------------------------------------------------------------------ steps

    def _check(self, spec: LoraSpec) -> None:
        try:
            validate_adapter_name(spec.name)
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="name") from None
        if not PurePosixPath(spec.path).is_absolute() or len(spec.path) > MAX_PATH_CHARS:
            raise InvalidRequest(
                f"path must be an absolute path (at most {MAX_PATH_CHARS} characters) of a "
                "PEFT adapter folder the workers can read",
                param="path",
            )
        if resolve_in_roots(spec.path, self._roots) is None:
            raise InvalidRequest(OUTSIDE_ROOTS, param="path")
        bases = set(self._bases())
        if spec.name in bases:
            raise InvalidRequest(f"`{spec.name}` is a served model's name", param="name")
        if spec.base_model not in bases:
            raise ModelNotFound(
                f"base_model `{spec.base_model[:64]}` is not a text generation model served here "
                f"({', '.join(sorted(bases)) or 'none'})",
                param="base_model",
            )

    @contextlib.asynccontextmanager
    async def _locked(self, name: str) -> AsyncIterator[None]:
        lock = self._redis.lock(
            names.adapter_lock(name),
            timeout=self._load_timeout_s + 30,
            blocking_timeout=self._load_timeout_s + 30,
        )
        try:
            acquired = await lock.acquire()
        except RedisError as exc:
            raise _unreachable("Redis is unreachable", exc) from exc
        if not acquired:
            raise LoraConflict(f"adapter `{name}` is being changed; retry", param="name")
        try:
            yield
        finally:
            with contextlib.suppress(LockError, RedisError):
                await lock.release()

    async def _workers_of(self, base_model: str) -> list[WorkerRegistration]:
        try:
            workers = await self._live_workers(base_model)
        except RedisError as exc:
            raise _unreachable("Redis is unreachable", exc) from exc
        return [w for w in workers if w.model == base_model and w.role is SERVING_ROLE]

    async def _insert(self, spec: LoraSpec) -> None:
        async with transaction(self._sessions) as session:
            await lora_repo.insert(session, _row(spec))

    async def _roll_out(self, spec: LoraSpec, *, new: bool) -> Rollout:
        try:
            generation = await self.publish(spec.base_model)
            state = await wait_for_rollout(
                self._redis_for(spec.base_model),
                base_model=spec.base_model,
                adapter=spec.name,
                generation=generation,
                timeout_s=self._load_timeout_s,
            )
        except RedisError as exc:
            if new:
                await self._roll_back(spec)
            raise _unreachable("could not publish the adapter", exc) from exc
        if state.loaded:
            return state
        if new:
            await self._roll_back(spec)
        undone = "nothing registered" if new else "it stays registered (it was before)"
        if state.failed and not state.pending:
            reasons = "; ".join(f"{w}: {why}" for w, why in sorted(state.failed.items()))
            raise LoraLoadFailed(
                f"adapter `{spec.name}` could not be loaded on any worker ({reasons}); {undone}",
                param="path",
            )
        raise LoraLoadTimeout(
            f"no worker reported adapter `{spec.name}` loaded within "
            f"{self._load_timeout_s:g}s (still loading: {', '.join(state.pending)}); {undone}",
            retry_after_s=5,
        )

    async def _roll_back(self, spec: LoraSpec) -> None:
        async with transaction(self._sessions) as session:
            await lora_repo.remove(session, spec.name)
        try:
            await self.publish(spec.base_model)
        except RedisError as exc:
            log.error("adapter %s rolled back in SQL but not published: %s", spec.name, exc)
        log.info("adapter %s rolled back", spec.name)


def _row(spec: LoraSpec) -> LoraAdapterRow:
    return LoraAdapterRow(
        name=spec.name, path=spec.path, base_model=spec.base_model, created_at=datetime.now(UTC)
    )


def _states(workers: Iterable[WorkerRegistration], name: str, base_model: str) -> dict[str, str]:
    return {
        w.worker_id: w.adapters.get(name, "pending")
        for w in sorted(workers, key=lambda w: w.worker_id)
        if w.model == base_model and w.role is SERVING_ROLE
    }


def _unreachable(what: str, exc: RedisError) -> BackendUnavailable:
    """The 503 says what failed; Redis's own message (its address) goes to the log only."""
    log.warning("%s: %s", what, exc)
    return BackendUnavailable(f"{what}; retry")
