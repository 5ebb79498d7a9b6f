"""One way to open the SQL database: an async engine and its session factory.

SQLite (the embedded default) gets WAL mode, a busy timeout and its folder
created; PostgreSQL gets connect/command timeouts so an unreachable server fails
fast instead of hanging a caller for a minute (asyncpg's default connect timeout).
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import DataError, DBAPIError, IntegrityError
from sqlalchemy.ext.asyncio import (
    AsyncEngine,
    AsyncSession,
    async_sessionmaker,
    create_async_engine,
)

from shared.errors import DatabaseUnavailable

SQLITE_BUSY_TIMEOUT_MS = 5000
WAL_SWITCH_RETRY_S = 0.02
PG_CONNECT_TIMEOUT_S = 5.0
PG_COMMAND_TIMEOUT_S = 30.0

_ASYNC_DRIVERS = {
    "sqlite": "sqlite+aiosqlite",
    "postgresql": "postgresql+asyncpg",
    "postgres": "postgresql+asyncpg",
}

log = logging.getLogger(__name__)


def normalize_url(url: str | URL) -> URL:
    """``postgresql://`` and ``sqlite://`` get their async drivers (asyncpg, aiosqlite)."""
    parsed = make_url(url)
    driver = _ASYNC_DRIVERS.get(parsed.drivername)
    return parsed.set(drivername=driver) if driver else parsed


def masked_url(url: str | URL) -> str:
    """The URL with its password hidden: for logs and error messages."""
    return make_url(url).render_as_string(hide_password=True)


def is_sqlite(url: str | URL) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


@dataclass(frozen=True, slots=True)
class Database:
    engine: AsyncEngine
    sessions: async_sessionmaker[AsyncSession]

    @property
    def url(self) -> str:
        return masked_url(self.engine.url)

    @property
    def dialect(self) -> str:
        return self.engine.dialect.name

    async def dispose(self) -> None:
        await self.engine.dispose()


@contextlib.asynccontextmanager
async def transaction(sessions: async_sessionmaker[AsyncSession]) -> AsyncIterator[AsyncSession]:
    """A session in a transaction, committed on success. An unreachable or failing database
    becomes DatabaseUnavailable (503, retry later); data errors stay what they are."""
    try:
        async with sessions.begin() as session:
            yield session
    except (IntegrityError, DataError):
        raise
    except (DBAPIError, OSError, TimeoutError) as exc:
        log.warning("the database could not be reached: %s", first_line(exc))
        raise DatabaseUnavailable(
            "the database could not be reached; retry later", retry_after_s=5
        ) from exc


def first_line(exc: BaseException) -> str:
    """A one-line description of an error (driver messages run over many lines)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def open_database(url: str | URL, **engine_kwargs: Any) -> Database:
    """Build (not connect) the engine; the first query opens a connection."""
    parsed = normalize_url(url)
    if parsed.get_backend_name() == "sqlite":
        engine = _sqlite_engine(parsed, engine_kwargs)
    else:
        engine = _postgres_engine(parsed, engine_kwargs)
    return Database(engine, async_sessionmaker(engine, expire_on_commit=False))


def _sqlite_engine(url: URL, engine_kwargs: dict[str, Any]) -> AsyncEngine:
    if url.database and url.database != ":memory:":
        Path(url.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_async_engine(
        url, connect_args={"timeout": SQLITE_BUSY_TIMEOUT_MS / 1000}, **engine_kwargs
    )
    event.listen(engine.sync_engine, "connect", _sqlite_connect)
    event.listen(engine.sync_engine, "begin", _sqlite_begin)
    return engine


def _sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    # The driver's own implicit BEGIN is off: _sqlite_begin issues BEGIN IMMEDIATE instead.
    dbapi_connection.isolation_level = None
    cursor = dbapi_connection.cursor()
    try:
        cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_MS}")
        _use_wal(cursor)
    finally:
        cursor.close()


def _use_wal(cursor: Any) -> None:
    """Switch the file to WAL (it stays so: later connections only read the mode).

    The switch needs an exclusive lock and SQLite does not wait for it (the busy timeout
    does not apply): two processes opening a new file at once (two ``conveyor db
    upgrade``, two gateways) found it "locked". Try again for the busy timeout.
    """
    cursor.execute("PRAGMA journal_mode")
    if str(cursor.fetchone()[0]).lower() == "wal":
        return
    deadline = time.monotonic() + SQLITE_BUSY_TIMEOUT_MS / 1000
    while True:
        try:
            cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as exc:
            if "locked" not in str(exc) or time.monotonic() > deadline:
                raise
        time.sleep(WAL_SWITCH_RETRY_S)  # at connect, on the first open of a new file only


def _sqlite_begin(connection: Any) -> None:
    """Take the write lock when a transaction starts. A deferred transaction that reads and
    then writes fails at once (SQLITE_BUSY, no busy wait) when another connection wrote in
    between; an immediate one waits its turn. It also makes two processes migrating the same
    file at once take turns (DDL runs in the transaction)."""
    connection.exec_driver_sql("BEGIN IMMEDIATE")


def _postgres_engine(url: URL, engine_kwargs: dict[str, Any]) -> AsyncEngine:
    connect_args = {"timeout": PG_CONNECT_TIMEOUT_S, "command_timeout": PG_COMMAND_TIMEOUT_S}
    options: dict[str, Any] = {
        "pool_pre_ping": True,
        "pool_timeout": PG_CONNECT_TIMEOUT_S,
        "connect_args": connect_args,
    }
    options.update(engine_kwargs)
    return create_async_engine(url, **options)
