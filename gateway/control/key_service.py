"""Creating, reading, changing and revoking API keys (for /admin/keys and the CLI).

Every change commits to SQL first and then bumps the Redis generation counter
(``shared.queue.names.API_KEYS_GENERATION``); each gateway's :class:`KeyCache` polls the
counter and reloads, so a revocation reaches every gateway within a second. When
Redis is down the change still stands: the caches' periodic full reload picks it up.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypedDict

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.control import key_secrets
from gateway.control.records import UNLIMITED, BudgetPeriod, KeyRecord, Limits, Scope
from gateway.db import keys_repo
from gateway.db.engine import transaction
from gateway.db.models import ApiKeyRow
from shared.errors import ApiKeyNotFound, ApiKeyRevoked, InvalidRequest
from shared.queue import names

log = logging.getLogger(__name__)

MAX_NAME_CHARS = 200
MAX_MODEL_NAME_CHARS = 200
MAX_LIMIT = 2**53
MAX_CONCURRENT = 2**31 - 1
LIMIT_FIELDS = ("rpm", "tpm", "max_concurrent", "budget_tokens")


@dataclass(frozen=True, slots=True)
class KeySpec:
    """A key to create."""

    name: str
    scopes: frozenset[Scope]
    models: frozenset[str] | None = None
    limits: Limits = UNLIMITED
    expires_at: datetime | None = None


class KeyUpdate(TypedDict, total=False):
    """The fields to change; a field set to None clears it (no limit, no expiry)."""

    name: str
    scopes: frozenset[Scope]
    models: frozenset[str] | None
    rpm: int | None
    tpm: int | None
    max_concurrent: int | None
    budget_tokens: int | None
    budget_period: BudgetPeriod | None
    expires_at: datetime | None


@dataclass(frozen=True, slots=True)
class CreatedKey:
    record: KeyRecord
    secret: str
    """Shown once; only its hash is stored."""


def utc_now() -> datetime:
    return datetime.now(UTC)


class KeyService:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        redis: aioredis.Redis | None,
        *,
        clock: Callable[[], datetime] = utc_now,
        on_change: Callable[[], Awaitable[object]] | None = None,
    ) -> None:
        self._sessions = sessions
        self._redis = redis
        self._clock = clock
        self._on_change = on_change
        """Runs after every committed change, before the change is answered: the gateway
        that made it reloads its key cache, so a key it just created works on it at once
        (the other gateways follow within their poll period)."""
        self.notify_error: str | None = None
        """Why the last change could not be announced to the gateways (None: it was)."""

    async def create(self, spec: KeySpec) -> CreatedKey:
        now = self._clock()
        values = _validated(_spec_values(spec), now)
        secret = key_secrets.new_secret()
        row = ApiKeyRow(
            id=key_secrets.new_key_id(),
            secret_hash=key_secrets.hash_secret(secret),
            prefix=key_secrets.prefix_of(secret),
            suffix=key_secrets.suffix_of(secret),
            created_at=now,
            updated_at=now,
            revoked_at=None,
            **_columns(values),
        )
        async with transaction(self._sessions) as session:
            await keys_repo.insert(session, row)
        await self._announce()
        log.info("api key %s (%s, %s) created", row.id, row.name, key_secrets.mask(secret))
        return CreatedKey(KeyRecord.from_row(row), secret)

    async def list_keys(self, *, include_revoked: bool = False) -> list[KeyRecord]:
        async with transaction(self._sessions) as session:
            rows = await keys_repo.list_keys(session, include_revoked=include_revoked)
            return [KeyRecord.from_row(row) for row in rows]

    async def get(self, key_id: str) -> KeyRecord:
        async with transaction(self._sessions) as session:
            return KeyRecord.from_row(await _existing(session, key_id))

    async def update(self, key_id: str, changes: KeyUpdate) -> KeyRecord:
        now = self._clock()
        async with transaction(self._sessions) as session:
            row = await _existing(session, key_id)
            if row.revoked_at is not None:
                raise ApiKeyRevoked(f"API key {key_id} is revoked; create a new one", param="id")
            merged = {**_spec_values(_spec_of(KeyRecord.from_row(row))), **_budget_pair(changes)}
            values = _validated(merged, now, changed=set(changes))
            await keys_repo.update(session, key_id, {**_columns(values), "updated_at": now})
            record = KeyRecord.from_row(row)
        await self._announce()
        log.info("api key %s updated: %s", key_id, ", ".join(sorted(changes)) or "nothing")
        return record

    async def revoke(self, key_id: str) -> KeyRecord:
        """Revoke the key (again: no change). Its usage rows stay in the ledger."""
        now = self._clock()
        async with transaction(self._sessions) as session:
            row = await _existing(session, key_id)
            if row.revoked_at is None:
                await keys_repo.update(session, key_id, {"revoked_at": now, "updated_at": now})
            record = KeyRecord.from_row(row)
        await self._announce()
        log.info("api key %s (%s) revoked", key_id, record.masked_key)
        return record

    async def _announce(self) -> None:
        self.notify_error = await bump_key_generation(self._redis)
        if self._on_change is not None:
            await self._on_change()


async def bump_key_generation(redis: aioredis.Redis | None) -> str | None:
    """Tell every gateway's key cache to reload; returns why it could not (None: done)."""
    if redis is None:
        return "no Redis configured"
    try:
        await redis.incr(names.API_KEYS_GENERATION)
    except (RedisError, OSError) as exc:
        log.warning(
            "api keys changed but Redis is unreachable (%s): gateways reload within "
            "their full-reload period",
            exc,
        )
        return str(exc)
    return None


async def _existing(session: AsyncSession, key_id: str) -> ApiKeyRow:
    # An id with a NUL is no key's (PostgreSQL refuses it in text: that was a 503)
    row = await keys_repo.get(session, key_id) if key_id.isprintable() else None
    if row is None:
        raise ApiKeyNotFound(f"no API key with id {key_id!r}", param="id")
    return row


def _budget_pair(changes: KeyUpdate) -> dict[str, Any]:
    """Clearing one half of the budget (tokens or period) clears the whole budget."""
    values: dict[str, Any] = dict(changes)
    for half, other in (("budget_tokens", "budget_period"), ("budget_period", "budget_tokens")):
        if half in values and values[half] is None and other not in values:
            values[other] = None
    return values


def _spec_of(record: KeyRecord) -> KeySpec:
    return KeySpec(record.name, record.scopes, record.models, record.limits, record.expires_at)


def _spec_values(spec: KeySpec) -> dict[str, Any]:
    return {
        "name": spec.name,
        "scopes": spec.scopes,
        "models": spec.models,
        "rpm": spec.limits.rpm,
        "tpm": spec.limits.tpm,
        "max_concurrent": spec.limits.max_concurrent,
        "budget_tokens": spec.limits.budget_tokens,
        "budget_period": spec.limits.budget_period,
        "expires_at": spec.expires_at,
    }


def _validated(
    values: dict[str, Any], now: datetime, *, changed: set[str] | None = None
) -> dict[str, Any]:
    """Check a whole key's values (after merging an update); InvalidRequest names the field."""
    name = str(values["name"]).strip()
    if not 0 < len(name) <= MAX_NAME_CHARS or not name.isprintable():
        raise InvalidRequest(
            f"name must be 1 to {MAX_NAME_CHARS} printable characters", param="name"
        )
    if not values["scopes"]:
        raise InvalidRequest("a key needs at least one scope", param="scopes")
    _check_models(values["models"])
    for field in LIMIT_FIELDS:
        _check_limit(field, values[field])
    if (values["budget_tokens"] is None) != (values["budget_period"] is None):
        missing = "budget_period" if values["budget_period"] is None else "budget_tokens"
        raise InvalidRequest("budget_tokens and budget_period go together", param=missing)
    expires_at = values["expires_at"]
    if expires_at is not None and (changed is None or "expires_at" in changed):
        if expires_at.tzinfo is None:
            raise InvalidRequest("expires_at needs a time zone (e.g. Z)", param="expires_at")
        try:  # 9999-12-31T23:59-14:00 is past datetime.max in UTC: a 500 before
            expires_at.astimezone(UTC)
        except OverflowError:
            raise InvalidRequest("expires_at is out of range", param="expires_at") from None
        if expires_at <= now:
            raise InvalidRequest("expires_at is in the past", param="expires_at")
    return {**values, "name": name}


def _check_models(models: frozenset[str] | None) -> None:
    if models is None:
        return
    if not models:
        raise InvalidRequest(
            "models is empty: leave it out (or null) for every model", param="models"
        )
    for model in models:
        if not 0 < len(model) <= MAX_MODEL_NAME_CHARS or not model.isprintable():
            raise InvalidRequest(  # PostgreSQL refuses a NUL in text: that was a 503
                f"model names are 1 to {MAX_MODEL_NAME_CHARS} printable characters",
                param="models",
            )


def _check_limit(field: str, value: int | None) -> None:
    if value is None:
        return
    ceiling = MAX_CONCURRENT if field == "max_concurrent" else MAX_LIMIT
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value <= ceiling:
        raise InvalidRequest(
            f"{field} must be a whole number from 1 to {ceiling} (or null for no limit)",
            param=field,
        )


def _columns(values: dict[str, Any]) -> dict[str, Any]:
    """Validated values as ``api_keys`` columns."""
    return {
        "name": values["name"],
        "scopes": sorted(scope.value for scope in values["scopes"]),
        "models": sorted(values["models"]) if values["models"] is not None else None,
        **{field: values[field] for field in LIMIT_FIELDS},
        "budget_period": values["budget_period"].value if values["budget_period"] else None,
        "expires_at": values["expires_at"],
    }
