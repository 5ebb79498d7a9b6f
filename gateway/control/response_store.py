"""Stored ``/v1/responses`` answers: save, read (the caller's own; admin: any), the
``previous_response_id`` chain as history, delete, and retention.

A key sees only the responses it created: another key's id answers 404, as an unknown
one does. Retention runs as the ledger's does (:mod:`gateway.control.ledger_retention`):
one gateway per interval, under a Redis lock.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.control.ledger import DATABASE_ERRORS
from gateway.control.records import Principal, Scope
from gateway.db import responses_repo
from gateway.db.models import StoredResponseRow
from shared.errors import InvalidRequest, ResponseNotFound
from shared.queue import names

log = logging.getLogger(__name__)

Json = dict[str, Any]
MAX_CHAIN = 1000
"""Turns read back through ``previous_response_id`` at most."""
RETENTION_INTERVAL_S = 3600.0


class ResponseStore:
    def __init__(self, sessions: async_sessionmaker[AsyncSession]) -> None:
        self._sessions = sessions

    async def save(self, body: Json, input_items: list[Json], principal: Principal) -> None:
        items = [
            {"id": f"msg_{uuid.uuid4().hex}", **item} if "id" not in item else item
            for item in input_items
        ]
        row = StoredResponseRow(
            id=body["id"],
            key_id=principal.key_id,
            previous_response_id=body.get("previous_response_id"),
            body=body,
            input_items=items,
            created_at=datetime.fromtimestamp(body["created_at"], UTC),
        )
        async with self._sessions.begin() as session:
            await responses_repo.insert(session, row)

    async def update(self, body: Json, *, unless_cancelled: bool = False) -> None:
        """A background response's new state (a cancelled one keeps its status when
        ``unless_cancelled``); nothing if it was deleted meanwhile."""
        async with self._sessions.begin() as session:
            row = await responses_repo.get(session, body["id"])
            if row is None or (unless_cancelled and row.body.get("status") == "cancelled"):
                return
            row.body = body

    async def get(
        self, response_id: str, principal: Principal, param: str | None = None
    ) -> StoredResponseRow:
        async with self._sessions() as session:
            row = await responses_repo.get(session, response_id)
        if row is None or not _may_read(row, principal):
            raise ResponseNotFound(f"Response with id '{response_id}' not found.", param=param)
        return row

    async def history(self, response_id: str, principal: Principal) -> list[Json]:
        """The conversation up to and including ``response_id``: every turn's input items
        and output items, oldest first."""
        turns: list[list[Json]] = []
        next_id: str | None = response_id
        while next_id is not None and len(turns) < MAX_CHAIN:
            row = await self.get(next_id, principal, param="previous_response_id")
            if not turns:
                _check_continuable(row)
            turns.append([*row.input_items, *row.body.get("output", [])])
            next_id = row.previous_response_id
        return [item for turn in reversed(turns) for item in turn]

    async def delete(self, response_id: str, principal: Principal) -> None:
        await self.get(response_id, principal)
        async with self._sessions.begin() as session:
            await responses_repo.remove(session, response_id)


def _check_continuable(row: StoredResponseRow) -> None:
    status = row.body.get("status")
    if status in ("queued", "in_progress", "cancelled"):
        raise InvalidRequest(
            f"Previous response with id '{row.id}' is {status.replace('_', ' ')}: only a "
            "finished response can be continued.",
            param="previous_response_id",
        )


def _item_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def _may_read(row: StoredResponseRow, principal: Principal) -> bool:
    return principal.has_scope(Scope.ADMIN) or row.key_id == principal.key_id


def page(items: list[Json], *, after: str | None, limit: int, order: str) -> Json:
    """OpenAI's list shape over ``items`` (stored oldest first)."""
    ordered = items if order == "asc" else list(reversed(items))
    if after is not None:
        ids = [item.get("id") for item in ordered]
        ordered = ordered[ids.index(after) + 1 :] if after in ids else []
    data = ordered[:limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": len(ordered) > limit,
    }


async def purge_once(
    redis: aioredis.Redis,
    sessions: async_sessionmaker[AsyncSession],
    retention_days: int,
    *,
    interval_s: float = RETENTION_INTERVAL_S,
    now: datetime | None = None,
) -> int | None:
    """Delete responses older than ``retention_days`` unless another gateway did this
    interval (then None)."""
    lock = names.RESPONSES_RETENTION_LOCK
    if not await redis.set(lock, b"1", nx=True, px=int(interval_s * 1000)):
        return None
    cutoff = (now or datetime.now(UTC)) - timedelta(days=retention_days)
    try:
        async with sessions.begin() as session:
            deleted = await responses_repo.delete_created_before(session, cutoff)
    except DATABASE_ERRORS:
        await redis.delete(lock)
        raise
    log.info("responses retention: deleted %d responses created before %s", deleted, cutoff)
    return deleted


async def retention_loop(
    redis: aioredis.Redis, sessions: async_sessionmaker[AsyncSession], retention_days: int
) -> None:
    if retention_days <= 0:
        return
    while True:
        try:
            await purge_once(redis, sessions, retention_days)
        except (RedisError, *DATABASE_ERRORS) as exc:
            log.warning("responses retention: skipped this round: %s", exc)
        await asyncio.sleep(300.0)
