"""Alembic: upgrade -> downgrade to base -> upgrade, and models that never drift from
the migrations (autogenerate finds nothing), on SQLite and PostgreSQL."""

from __future__ import annotations

import logging
import os
import sqlite3
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect
from sqlalchemy.engine import Connection

from gateway.db.engine import Database, open_database
from gateway.db.models import Base
from gateway.db.schema import (
    current_revision,
    downgrade,
    head_revision,
    schema_status,
    upgrade,
    upgrade_to_head,
)
from tests.support.sql import SqlTarget

TABLES = {"api_keys", "usage_records", "lora_adapters", "responses"}


def _drift(connection: Connection) -> list[Any]:
    context = MigrationContext.configure(connection, opts={"compare_type": True})
    return list(compare_metadata(context, Base.metadata))


def _tables(connection: Connection) -> set[str]:
    return set(inspect(connection).get_table_names()) - {"alembic_version"}


async def _run(db: Database, fn: Any) -> Any:
    async with db.engine.connect() as connection:
        return await connection.run_sync(fn)


async def test_models_and_migrations_never_drift(database: Database) -> None:
    assert await _run(database, _drift) == []


async def test_reading_the_schema_version_logs_nothing(
    database: Database, caplog: pytest.LogCaptureFixture
) -> None:
    """The gateway's schema watch reads it every 30 s: no Alembic INFO lines each time."""
    caplog.set_level(logging.DEBUG)
    assert (await schema_status(database.engine)).at_head
    assert [r.getMessage() for r in caplog.records if r.name.startswith("alembic")] == []


async def test_upgrade_downgrade_upgrade(sql_target: SqlTarget) -> None:
    db = sql_target.open()
    try:
        assert await current_revision(db.engine) is None
        await upgrade_to_head(db.engine)
        assert await current_revision(db.engine) == head_revision()
        assert await _run(db, _tables) == TABLES

        await downgrade(db.engine, "0001")
        assert await _run(db, _tables) == TABLES - {"lora_adapters", "responses"}
        await downgrade(db.engine, "base")
        assert await current_revision(db.engine) is None
        assert await _run(db, _tables) == set()

        await upgrade(db.engine, "head")
        assert await current_revision(db.engine) == head_revision()
        assert await _run(db, _tables) == TABLES
        assert await _run(db, _drift) == []
    finally:
        await db.dispose()


async def test_schema_status_says_what_to_run(sql_target: SqlTarget) -> None:
    db = sql_target.open()
    try:
        empty = await schema_status(db.engine)
        assert not empty.at_head
        assert "conveyor db upgrade" in (empty.problem() or "")
        await upgrade_to_head(db.engine)
        assert (await schema_status(db.engine)).problem() is None
    finally:
        await db.dispose()


async def test_a_revision_this_code_does_not_know_is_reported(database: Database) -> None:
    async with database.engine.begin() as connection:
        await connection.exec_driver_sql("UPDATE alembic_version SET version_num = 'f00d'")
    problem = (await schema_status(database.engine)).problem() or ""
    assert "f00d" in problem and "does not know" in problem


def test_two_processes_migrating_at_once_take_turns(sql_target: SqlTarget) -> None:
    """Several `conveyor db upgrade` (or gateways on the embedded file) at once on a new
    database: all end well, the later ones finding the schema at head (Alembic's context
    is process-global, so this takes processes). On SQLite they also race to switch the
    new file to WAL, which SQLite does not wait for (it said "database is locked" to
    about one pair in eight)."""
    env = {**os.environ, "CONVEYOR_DATABASE_URL": sql_target.url}
    command = [sys.executable, "-m", "conveyor.cli", "db", "upgrade"]
    processes = [
        subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        for _ in range(4)
    ]
    outputs = [process.communicate(timeout=120)[0].decode() for process in processes]
    assert [process.returncode for process in processes] == [0] * 4, outputs
    assert all(f"current: {head_revision()}" in output for output in outputs)


async def test_a_new_sqlite_file_another_process_is_writing_still_opens_in_wal(
    tmp_path: Path,
) -> None:
    """The switch to WAL on a new file does not wait for a lock (SQLite ignores the busy
    timeout there): another process in the middle of its first write made it fail at
    once with "database is locked". It waits now, and the file ends up in WAL."""
    path = tmp_path / "conveyor.db"
    other = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    other.execute("CREATE TABLE first_write (x INTEGER)")
    other.execute("BEGIN IMMEDIATE")
    threading.Timer(0.3, other.execute, ("COMMIT",)).start()
    database = open_database(f"sqlite+aiosqlite:///{path}")
    try:
        async with database.engine.connect() as connection:
            mode = await connection.exec_driver_sql("PRAGMA journal_mode")
            assert mode.scalar() == "wal"
    finally:
        await database.dispose()
        other.close()
