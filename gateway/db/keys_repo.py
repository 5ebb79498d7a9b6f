"""SQL for the ``api_keys`` table. Callers own the session and the transaction."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.db.models import ApiKeyRow


async def insert(session: AsyncSession, row: ApiKeyRow) -> None:
    session.add(row)
    await session.flush()


async def get(session: AsyncSession, key_id: str) -> ApiKeyRow | None:
    return await session.get(ApiKeyRow, key_id)


async def list_keys(session: AsyncSession, *, include_revoked: bool) -> Sequence[ApiKeyRow]:
    query = select(ApiKeyRow).order_by(ApiKeyRow.created_at, ApiKeyRow.id)
    if not include_revoked:
        query = query.where(ApiKeyRow.revoked_at.is_(None))
    return (await session.scalars(query)).all()


async def not_revoked(session: AsyncSession) -> Sequence[ApiKeyRow]:
    """Every key that may still authenticate (expiry is checked when one is used)."""
    return await list_keys(session, include_revoked=False)


async def update(session: AsyncSession, key_id: str, values: Mapping[str, Any]) -> ApiKeyRow | None:
    row = await session.get(ApiKeyRow, key_id)
    if row is None:
        return None
    for name, value in values.items():
        setattr(row, name, value)
    await session.flush()
    return row
