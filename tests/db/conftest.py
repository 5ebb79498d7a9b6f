"""SQL fixtures: every test here runs on SQLite and on the real PostgreSQL.

``sql_target`` is the empty database of one run (``sqlite``: a file in tmp_path;
``postgres``: a throwaway database, marker ``postgres``); ``database`` is it opened
and migrated to head.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from gateway.db.engine import Database
from gateway.db.schema import upgrade_to_head
from tests.support.sql import (
    SqlTarget,
    create_postgres_database,
    drop_leftover_databases,
    drop_postgres_database,
    require_postgres,
)


@pytest.fixture(scope="session", autouse=True)
def _drop_leftover_postgres_databases() -> Iterator[None]:
    yield
    drop_leftover_databases()


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def sql_target(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SqlTarget]:
    if request.param == "sqlite":
        folder = tmp_path_factory.mktemp("sqlite")
        yield SqlTarget("sqlite", f"sqlite+aiosqlite:///{folder / 'conveyor.db'}")
        return
    require_postgres()
    target = create_postgres_database()
    try:
        yield target
    finally:
        drop_postgres_database(target)


@pytest.fixture
async def database(sql_target: SqlTarget) -> AsyncIterator[Database]:
    db = sql_target.open()
    await upgrade_to_head(db.engine)
    try:
        yield db
    finally:
        await db.dispose()


@pytest.fixture
def postgres_target() -> Iterator[SqlTarget]:
    """A throwaway PostgreSQL database only (tests of what SQLite cannot show)."""
    require_postgres()
    target = create_postgres_database()
    try:
        yield target
    finally:
        drop_postgres_database(target)
