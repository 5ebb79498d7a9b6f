"""SQL for the ``usage_records`` ledger: idempotent batch inserts, queries and totals."""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import ColumnElement, Table, delete, func, select
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.ext.asyncio import AsyncSession

from gateway.db.models import Base, UsageRow


class GroupBy(StrEnum):
    DAY = "day"
    """UTC calendar day of ``received_at``, as YYYY-MM-DD."""
    KEY = "key"
    MODEL = "model"


@dataclass(frozen=True, slots=True)
class UsageFilter:
    """Rows whose request was received in [since, until), optionally of one key / model."""

    key_id: str | None = None
    model: str | None = None
    since: datetime | None = None
    until: datetime | None = None

    def conditions(self) -> list[ColumnElement[bool]]:
        found: list[ColumnElement[bool]] = []
        if self.key_id is not None:
            found.append(UsageRow.key_id == self.key_id)
        if self.model is not None:
            found.append(UsageRow.model == self.model)
        if self.since is not None:
            found.append(UsageRow.received_at >= self.since)
        if self.until is not None:
            found.append(UsageRow.received_at < self.until)
        return found


@dataclass(frozen=True, slots=True)
class UsageTotal:
    group: str | None
    """The day, key id or model; None for the grand total (and for requests without a key)."""
    requests: int
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


async def insert_batch(session: AsyncSession, rows: Sequence[Mapping[str, Any]]) -> int:
    """Insert the rows whose request_id is not in the ledger yet; returns how many were new.
    A row delivered twice (a retry, a redelivered stream entry) is skipped, never doubled."""
    if not rows:
        return 0
    result = await session.execute(_insert_new(session.get_bind().dialect.name), list(rows))
    return len(result.all())


@functools.cache
def _insert_new(dialect: str) -> Any:
    """One single-row statement run with every row as its parameters (executemany), so it
    compiles once per process; a multi-row ``VALUES`` compiled anew for every batch size
    cost the gateway ~2 ms of CPU per request under load (profiled)."""
    table = Table(UsageRow.__tablename__, Base.metadata)  # Core: no ORM bulk-insert layer
    if dialect == "postgresql":
        stmt: Any = postgresql.insert(table)
    elif dialect == "sqlite":
        stmt = sqlite.insert(table)
    else:
        raise NotImplementedError(f"usage ledger: unsupported database dialect {dialect!r}")
    stmt = stmt.on_conflict_do_nothing(index_elements=[table.c.request_id])
    return stmt.returning(table.c.request_id)


async def query(session: AsyncSession, where: UsageFilter, *, limit: int) -> Sequence[UsageRow]:
    """The newest rows first."""
    rows = select(UsageRow).where(*where.conditions())
    rows = rows.order_by(UsageRow.received_at.desc(), UsageRow.request_id).limit(limit)
    return (await session.scalars(rows)).all()


async def totals(
    session: AsyncSession, where: UsageFilter, group_by: GroupBy | None
) -> list[UsageTotal]:
    """Sums per day / key / model (ordered by the group), or one grand total."""
    sums = (
        func.count(),
        func.coalesce(func.sum(UsageRow.prompt_tokens), 0),
        func.coalesce(func.sum(UsageRow.completion_tokens), 0),
        func.coalesce(func.sum(UsageRow.cached_prompt_tokens), 0),
    )
    if group_by is None:
        row = (await session.execute(select(*sums).where(*where.conditions()))).one()
        return [UsageTotal(None, *(int(value) for value in row))]
    group = _group_column(group_by, session.get_bind().dialect.name).label("group")
    grouped = select(group, *sums).where(*where.conditions()).group_by(group).order_by(group)
    return [
        UsageTotal(row[0], *(int(value) for value in row[1:]))
        for row in (await session.execute(grouped)).all()
    ]


def _group_column(group_by: GroupBy, dialect: str) -> ColumnElement[Any]:
    if group_by is GroupBy.KEY:
        return UsageRow.key_id.expression
    if group_by is GroupBy.MODEL:
        return UsageRow.model.expression
    if dialect == "postgresql":
        return func.to_char(func.timezone("UTC", UsageRow.received_at), "YYYY-MM-DD")
    return func.strftime("%Y-%m-%d", UsageRow.received_at)  # SQLite stores naive UTC


async def delete_received_before(session: AsyncSession, cutoff: datetime) -> int:
    """Retention: drop rows received before ``cutoff``; returns how many went."""
    result: Any = await session.execute(delete(UsageRow).where(UsageRow.received_at < cutoff))
    return int(result.rowcount or 0)
