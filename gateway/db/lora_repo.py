"""SQL for the ``lora_adapters`` table. Callers own the session and the transaction."""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import delete, select
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.db.models import LoraAdapterRow


async def insert(session: AsyncSession, row: LoraAdapterRow) -> None:
    session.add(row)
    await session.flush()


async def get(session: AsyncSession, name: str) -> LoraAdapterRow | None:
    return await session.get(LoraAdapterRow, name)


async def list_all(session: AsyncSession) -> Sequence[LoraAdapterRow]:
    query = select(LoraAdapterRow).order_by(LoraAdapterRow.base_model, LoraAdapterRow.name)
    return (await session.scalars(query)).all()


async def of_base(session: AsyncSession, base_model: str) -> Sequence[LoraAdapterRow]:
    query = (
        select(LoraAdapterRow)
        .where(LoraAdapterRow.base_model == base_model)
        .order_by(LoraAdapterRow.name)
    )
    return (await session.scalars(query)).all()


async def remove(session: AsyncSession, name: str) -> bool:
    """Delete adapter ``name``; False if it was not registered."""
    result = await session.execute(delete(LoraAdapterRow).where(LoraAdapterRow.name == name))
    return bool(getattr(result, "rowcount", 0))
