"""Every API key in the gateway's memory: authentication never waits on SQL.

``resolve(secret)`` hashes the presented secret, finds the key by its hash and
compares the hashes in constant time: a microsecond, no I/O. The cache stays
current across gateways:

1. every ``poll_s`` (250 ms) read the Redis generation counter that every key
   change bumps (``shared.queue.names.API_KEYS_GENERATION``);
2. when it moved, or ``reload_s`` (30 s) passed, reload every non-revoked key from SQL;
3. when SQL fails, keep serving the keys already known (and say so in ``status()``),
   retrying with backoff.

So a revocation takes effect on every gateway within ``poll_s`` + one query, and
a database outage stops nobody whose key was known before it.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.control import key_secrets
from gateway.control.ledger import DATABASE_ERRORS
from gateway.control.records import (
    ADMIN_KEY_ID,
    UNLIMITED,
    KeyRecord,
    Principal,
    Scope,
)
from gateway.db import keys_repo
from gateway.db.engine import first_line
from shared.errors import InvalidApiKey
from shared.queue import names

log = logging.getLogger(__name__)

NO_KEY_MESSAGE = (
    "You didn't provide an API key. You need to provide your API key in an Authorization "
    "header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY)."
)


@dataclass(frozen=True, slots=True)
class _Entry:
    secret_hash: str
    expires_unix: float | None
    principal: Principal


@dataclass(frozen=True, slots=True)
class KeyCacheStatus:
    loaded: bool
    """At least one load from SQL succeeded."""
    db_ok: bool
    keys: int
    loaded_unix: float | None
    error: str | None

    def to_json(self) -> dict[str, object]:
        age = time.time() - self.loaded_unix if self.loaded_unix is not None else None
        return {
            "loaded": self.loaded,
            "db_ok": self.db_ok,
            "keys": self.keys,
            "age_s": round(age, 3) if age is not None else None,
            "error": self.error,
        }


class KeyCache:
    def __init__(
        self,
        sessions: async_sessionmaker[AsyncSession],
        redis: aioredis.Redis | None,
        *,
        admin_secret: str | None = None,
        poll_s: float = 0.25,
        reload_s: float = 30.0,
        retry_max_s: float = 5.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._sessions = sessions
        self._redis = redis
        self._admin_hash = key_secrets.hash_secret(admin_secret) if admin_secret else None
        self._poll_s = poll_s
        self._reload_s = reload_s
        self._retry_max_s = retry_max_s
        self._clock = clock
        self._by_hash: dict[str, _Entry] = {}
        self._loaded_unix: float | None = None
        self._error: str | None = None
        self._seen_generation: bytes | None = None
        self.on_revoked: Callable[[set[str]], None] = lambda key_ids: None
        """Called with the ids of keys gone since the last load (revoked): the gateway
        ends their open requests."""

    # ------------------------------------------------------------ the hot path

    def resolve(self, secret: str | None) -> Principal | InvalidApiKey:
        """The principal a presented secret acts as, or why it may not act at all."""
        if not secret:
            return InvalidApiKey(NO_KEY_MESSAGE)
        digest = key_secrets.hash_secret(secret)
        if self._admin_hash is not None and hmac.compare_digest(digest, self._admin_hash):
            return ADMIN_PRINCIPAL
        entry = self._by_hash.get(digest)
        if entry is None or not hmac.compare_digest(entry.secret_hash, digest):
            return InvalidApiKey(f"Incorrect API key provided: {key_secrets.mask(secret)}.")
        if entry.expires_unix is not None and entry.expires_unix <= self._clock():
            return InvalidApiKey(f"API key {entry.principal.masked_key} has expired.")
        return entry.principal

    # ------------------------------------------------------------ keeping current

    async def run(self) -> None:
        retry_s = self._poll_s
        next_full_reload = time.monotonic() + self._reload_s if self.status().loaded else 0.0
        next_retry = 0.0
        while True:
            readable, generation = await self._read_generation()
            now = time.monotonic()
            if self._error is None:
                changed = readable and generation != self._seen_generation
                due = changed or now >= next_full_reload
            else:
                due = now >= next_retry
            if due:
                if await self._load(generation if readable else self._seen_generation):
                    next_full_reload, retry_s = now + self._reload_s, self._poll_s
                else:
                    next_retry, retry_s = now + retry_s, min(retry_s * 2, self._retry_max_s)
            await asyncio.sleep(self._poll_s)

    async def reload(self) -> bool:
        """Load every non-revoked key from SQL; on failure keep the keys known so far."""
        readable, generation = await self._read_generation()
        return await self._load(generation if readable else self._seen_generation)

    async def _load(self, generation: bytes | None) -> bool:
        """``generation`` was read before the query, so a change committed after the query
        bumps the counter past it and is loaded on the next poll."""
        try:
            async with self._sessions() as session:
                rows = await keys_repo.not_revoked(session)
                records = [KeyRecord.from_row(row) for row in rows]
        except DATABASE_ERRORS as exc:
            self._failed(exc)
            return False
        known = {entry.principal.key_id for entry in self._by_hash.values()}
        self._by_hash = {record.secret_hash: _entry(record) for record in records}
        gone = known - {entry.principal.key_id for entry in self._by_hash.values()}
        if gone:
            self.on_revoked({key_id for key_id in gone if key_id is not None})
        if self._error is not None:
            log.info("api keys: database reachable again (%d keys)", len(records))
        self._error = None
        self._loaded_unix = time.time()
        self._seen_generation = generation
        return True

    async def _read_generation(self) -> tuple[bool, bytes | None]:
        """(readable, value): the counter, unless Redis is down or absent."""
        if self._redis is None:
            return False, None
        try:
            value: Any = await self._redis.get(names.API_KEYS_GENERATION)
        except (RedisError, OSError):
            return False, None
        return True, value.encode() if isinstance(value, str) else value

    def _failed(self, exc: BaseException) -> None:
        message = first_line(exc)
        if self._error is None:
            log.warning(
                "api keys: cannot reload from the database (serving the %d known keys): %s",
                len(self._by_hash),
                message,
            )
        self._error = message

    # ------------------------------------------------------------ status

    def status(self) -> KeyCacheStatus:
        return KeyCacheStatus(
            loaded=self._loaded_unix is not None,
            db_ok=self._error is None,
            keys=len(self._by_hash),
            loaded_unix=self._loaded_unix,
            error=self._error,
        )


ADMIN_PRINCIPAL = Principal(
    ADMIN_KEY_ID, "CONVEYOR_ADMIN_KEY", frozenset({Scope.ADMIN}), None, UNLIMITED, "admin key"
)


def _entry(record: KeyRecord) -> _Entry:
    expires = record.expires_at.astimezone(UTC).timestamp() if record.expires_at else None
    return _Entry(record.secret_hash, expires, record.principal())
