"""The usage ledger as /admin/usage and ``conveyor usage`` show it (one JSON shape)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.db import usage_repo
from gateway.db.engine import transaction
from gateway.db.models import UsageRow
from gateway.db.usage_repo import GroupBy, UsageFilter, UsageTotal


async def usage_report(
    sessions: async_sessionmaker[AsyncSession],
    where: UsageFilter,
    group_by: GroupBy | None,
    limit: int,
) -> dict[str, Any]:
    """Totals per group (``group_by``) or the newest ``limit`` rows, plus the grand total."""
    async with transaction(sessions) as session:
        total = (await usage_repo.totals(session, where, None))[0]
        if group_by is not None:
            groups = await usage_repo.totals(session, where, group_by)
            body: dict[str, Any] = {
                "object": "list",
                "group_by": group_by.value,
                "data": [total_json(group, group_by.value) for group in groups],
            }
        else:
            rows = await usage_repo.query(session, where, limit=limit + 1)
            body = {
                "object": "list",
                "data": [row_json(row) for row in rows[:limit]],
                "has_more": len(rows) > limit,
            }
    body["total"] = total_json(total, None)
    body["filter"] = {
        "key": where.key_id,
        "model": where.model,
        "since": _iso(where.since),
        "until": _iso(where.until),
    }
    return body


def total_json(total: UsageTotal, group: str | None) -> dict[str, Any]:
    head = {group: total.group} if group is not None else {}
    return {
        **head,
        "requests": total.requests,
        "prompt_tokens": total.prompt_tokens,
        "completion_tokens": total.completion_tokens,
        "cached_prompt_tokens": total.cached_prompt_tokens,
        "total_tokens": total.total_tokens,
    }


def row_json(row: UsageRow) -> dict[str, Any]:
    return {
        "request_id": row.request_id,
        "key_id": row.key_id,
        "model": row.model,
        "prompt_tokens": row.prompt_tokens,
        "completion_tokens": row.completion_tokens,
        "cached_prompt_tokens": row.cached_prompt_tokens,
        "total_tokens": row.prompt_tokens + row.completion_tokens,
        "n": row.n,
        "finish_reason": row.finish_reason,
        "status": row.status,
        "migrations": row.migrations,
        "received_at": _iso(row.received_at),
        "first_token_at": _iso(row.first_token_at),
        "finished_at": _iso(row.finished_at),
    }


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None
