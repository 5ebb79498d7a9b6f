"""SQL for the ``responses`` table. Callers own the session and the transaction."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import delete
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.db.models import StoredResponseRow


async def insert(session: AsyncSession, row: StoredResponseRow) -> None:
    session.add(row)
    await session.flush()


async def get(session: AsyncSession, response_id: str) -> StoredResponseRow | None:
    return await session.get(StoredResponseRow, response_id)


async def remove(session: AsyncSession, response_id: str) -> bool:
    query = delete(StoredResponseRow).where(StoredResponseRow.id == response_id)
    result = await session.execute(query)
    return bool(getattr(result, "rowcount", 0))


async def delete_created_before(session: AsyncSession, cutoff: datetime) -> int:
    query = delete(StoredResponseRow).where(StoredResponseRow.created_at < cutoff)
    result = await session.execute(query)
    return int(getattr(result, "rowcount", 0))
