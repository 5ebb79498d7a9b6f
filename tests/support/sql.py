"""SQL test targets: an SQLite file, or a throwaway database on the real PostgreSQL.

The PostgreSQL server is ``CONVEYOR_TEST_POSTGRES_URL`` (default
``postgresql://postgres@127.0.0.1:5432/postgres``: trust auth, as on the dev
machines). Each test gets its own database ``conveyor_test_<run>_<n>``, dropped
after the test (and any left by this run, at the end of the session). When the
server does not answer, the test is skipped locally and FAILS under CI.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import threading
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import asyncpg
import pytest
from sqlalchemy.engine import make_url

from gateway.db.engine import Database, open_database
from tests.conftest import in_ci

POSTGRES_ADMIN_URL = os.environ.get(
    "CONVEYOR_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
)
RUN_ID = uuid.uuid4().hex[:8]
DATABASE_PREFIX = f"conveyor_test_{RUN_ID}_"
_numbers = itertools.count()

T = TypeVar("T")


@dataclass(frozen=True)
class SqlTarget:
    kind: str
    """``sqlite`` or ``postgres``."""
    url: str
    """SQLAlchemy (async) URL of this test's own, empty database."""

    def open(self, **engine_kwargs: Any) -> Database:
        return open_database(self.url, **engine_kwargs)

    def url_via(self, host: str, port: int) -> str:
        """The same database reached through another address (a TcpProxy)."""
        return make_url(self.url).set(host=host, port=port).render_as_string(hide_password=False)

    @property
    def host_port(self) -> tuple[str, int]:
        parsed = make_url(self.url)
        return parsed.host or "127.0.0.1", parsed.port or 5432


def run_in_thread(factory: Callable[[], Awaitable[T]]) -> T:
    """Run a coroutine to completion on a private loop in another thread (fixtures run
    outside the test's loop, and asyncio.run here would reset the main thread's loop)."""
    result: list[T] = []
    errors: list[BaseException] = []

    def target() -> None:
        try:
            result.append(asyncio.run(_awaited(factory)))
        except BaseException as exc:  # handed to the caller
            errors.append(exc)

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


async def _awaited(factory: Callable[[], Awaitable[T]]) -> T:
    return await factory()


def _admin_dsn() -> str:
    return (
        make_url(POSTGRES_ADMIN_URL)
        .set(drivername="postgresql")
        .render_as_string(hide_password=False)
    )


async def _execute(sql: str) -> None:
    connection = await asyncpg.connect(_admin_dsn(), timeout=3)
    try:
        await connection.execute(sql)
    finally:
        await connection.close()


async def _fetch_names(pattern: str) -> list[str]:
    connection = await asyncpg.connect(_admin_dsn(), timeout=3)
    try:
        rows = await connection.fetch(
            "SELECT datname FROM pg_database WHERE datname LIKE $1", pattern
        )
        return [row["datname"] for row in rows]
    finally:
        await connection.close()


def require_postgres() -> None:
    try:
        run_in_thread(lambda: _execute("SELECT 1"))
    except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
        reason = (
            f"PostgreSQL at {make_url(POSTGRES_ADMIN_URL).render_as_string()} is unreachable "
            f"({exc}); start one (scripts/ensure_services.py) or set CONVEYOR_TEST_POSTGRES_URL"
        )
        if in_ci():
            pytest.fail(f"CI=true: {reason}", pytrace=False)
        pytest.skip(reason)


def create_postgres_database() -> SqlTarget:
    name = f"{DATABASE_PREFIX}{next(_numbers)}"
    run_in_thread(lambda: _execute(f'CREATE DATABASE "{name}"'))
    url = make_url(POSTGRES_ADMIN_URL).set(drivername="postgresql+asyncpg", database=name)
    return SqlTarget("postgres", url.render_as_string(hide_password=False))


def drop_postgres_database(target: SqlTarget) -> None:
    name = make_url(target.url).database
    run_in_thread(lambda: _execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


def drop_leftover_databases() -> None:
    """Every database this run created and did not drop (a test that crashed)."""
    try:
        names = run_in_thread(lambda: _fetch_names(f"{DATABASE_PREFIX}%"))
    except (OSError, asyncpg.PostgresError, TimeoutError):
        return
    for name in names:
        run_in_thread(lambda name=name: _execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
