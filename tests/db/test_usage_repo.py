"""The usage ledger's SQL: idempotent batch inserts, filters, totals, retention."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from sqlalchemy import func, select

from gateway.db import usage_repo
from gateway.db.engine import Database
from gateway.db.models import UsageRow
from gateway.db.usage_repo import GroupBy, UsageFilter

DAY1 = datetime(2025, 6, 1, 23, 30, tzinfo=UTC)
DAY2 = datetime(2025, 6, 2, 0, 30, tzinfo=UTC)


def row(
    request_id: str,
    *,
    key: str | None = "key_a",
    model: str = "m1",
    received: datetime = DAY1,
    prompt: int = 10,
    completion: int = 5,
    cached: int | None = None,
) -> dict[str, Any]:
    return {
        "request_id": request_id,
        "key_id": key,
        "model": model,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "cached_prompt_tokens": cached,
        "n": 1,
        "finish_reason": "stop",
        "status": "completed",
        "migrations": 0,
        "received_at": received,
        "first_token_at": received + timedelta(milliseconds=20),
        "finished_at": received + timedelta(seconds=1),
        "recorded_at": received,
    }


async def insert(database: Database, rows: list[dict[str, Any]]) -> int:
    async with database.sessions.begin() as session:
        return await usage_repo.insert_batch(session, rows)


async def count(database: Database) -> int:
    async with database.sessions() as session:
        return int((await session.execute(select(func.count()).select_from(UsageRow))).scalar_one())


async def test_a_request_is_counted_once_however_often_it_arrives(database: Database) -> None:
    assert await insert(database, [row("r1"), row("r2")]) == 2
    assert await insert(database, [row("r2"), row("r3"), row("r3")]) == 1
    assert await insert(database, [row("r1", prompt=999)]) == 0
    assert await insert(database, []) == 0
    assert await count(database) == 3
    async with database.sessions() as session:
        first = await session.get(UsageRow, "r1")
    assert first is not None and first.prompt_tokens == 10  # the first write stands
    assert first.received_at == DAY1  # aware UTC back from both backends


async def test_filters_and_totals(database: Database) -> None:
    await insert(
        database,
        [
            row("a1", key="key_a", model="m1", received=DAY1, prompt=10, completion=1, cached=4),
            row("a2", key="key_a", model="m2", received=DAY2, prompt=20, completion=2),
            row("b1", key="key_b", model="m1", received=DAY2, prompt=30, completion=3),
            row("n1", key=None, model="m1", received=DAY2, prompt=40, completion=4),
        ],
    )
    async with database.sessions() as session:
        everything = await usage_repo.totals(session, UsageFilter(), None)
        by_day = await usage_repo.totals(session, UsageFilter(), GroupBy.DAY)
        by_key = await usage_repo.totals(session, UsageFilter(model="m1"), GroupBy.KEY)
        by_model = await usage_repo.totals(session, UsageFilter(key_id="key_a"), GroupBy.MODEL)
        day2 = await usage_repo.query(session, UsageFilter(since=DAY2), limit=10)
        day1 = await usage_repo.query(session, UsageFilter(until=DAY2), limit=10)
        limited = await usage_repo.query(session, UsageFilter(), limit=2)
    assert everything[0].requests == 4
    assert (everything[0].prompt_tokens, everything[0].completion_tokens) == (100, 10)
    assert everything[0].cached_prompt_tokens == 4 and everything[0].total_tokens == 110
    assert [(t.group, t.requests, t.prompt_tokens) for t in by_day] == [
        ("2025-06-01", 1, 10),
        ("2025-06-02", 3, 90),
    ]
    assert {(t.group, t.prompt_tokens) for t in by_key} == {
        ("key_a", 10),
        ("key_b", 30),
        (None, 40),
    }
    assert [(t.group, t.requests) for t in by_model] == [("m1", 1), ("m2", 1)]
    assert {r.request_id for r in day2} == {"a2", "b1", "n1"}
    assert [r.request_id for r in day1] == ["a1"]
    assert len(limited) == 2 and all(r.received_at == DAY2 for r in limited)  # newest first


async def test_totals_of_nothing_are_zero(database: Database) -> None:
    async with database.sessions() as session:
        [total] = await usage_repo.totals(session, UsageFilter(key_id="nobody"), None)
        groups = await usage_repo.totals(session, UsageFilter(), GroupBy.DAY)
    assert (total.requests, total.total_tokens, groups) == (0, 0, [])


async def test_retention_deletes_only_older_rows(database: Database) -> None:
    await insert(database, [row("old", received=DAY1), row("new", received=DAY2)])
    async with database.sessions.begin() as session:
        assert await usage_repo.delete_received_before(session, DAY2) == 1
    async with database.sessions() as session:
        assert [r.request_id for r in await usage_repo.query(session, UsageFilter(), limit=9)] == [
            "new"
        ]


async def test_naive_datetimes_are_refused(database: Database) -> None:
    with pytest.raises(Exception, match="naive datetime"):
        await insert(database, [row("x", received=datetime(2025, 1, 1))])
