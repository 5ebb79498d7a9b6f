"""Is the database's schema at the migrations' head? Upgrade or downgrade it.

Alembic underneath (migrations in the top-level ``alembic/`` folder). The
functions take an open engine and hand Alembic a connection, so they run inside
an event loop (the gateway's start-up, the CLI) without Alembic starting its own.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy import inspect, text
from sqlalchemy.engine import Connection
from sqlalchemy.ext.asyncio import AsyncEngine

MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "alembic"
"""The top-level ``alembic/`` folder (the package is installed editable, from the repo)."""
VERSION_TABLE = "alembic_version"
"""Alembic's default; alembic/env.py keeps it."""


def alembic_config(connection: Connection | None = None) -> Config:
    """Alembic's configuration without an ini file; ``connection`` is what env.py uses."""
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    if connection is not None:
        config.attributes["connection"] = connection
    return config


@functools.cache
def head_revision() -> str:
    """The newest migration. Cached: the migrations ship with the code, and reading them
    execs every script in alembic/versions (the 30 s schema watch did, stalling the loop)."""
    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    if head is None:
        raise RuntimeError(f"no migrations found in {MIGRATIONS_DIR}")
    return head


def known_revision(revision: str) -> bool:
    script = ScriptDirectory.from_config(alembic_config())
    return any(rev.revision == revision for rev in script.walk_revisions())


@dataclass(frozen=True, slots=True)
class SchemaStatus:
    current: str | None
    head: str

    @property
    def at_head(self) -> bool:
        return self.current == self.head

    def problem(self) -> str | None:
        """What /ready says while the schema is not at head (None when it is)."""
        if self.at_head:
            return None
        if self.current is None:
            return f"database has no schema, head is {self.head}: run `conveyor db upgrade`"
        if not known_revision(self.current):
            return (
                f"database schema at {self.current}, which this Conveyor does not know "
                f"(head is {self.head}): was it migrated by a newer version?"
            )
        return f"database schema at {self.current}, head is {self.head}: run `conveyor db upgrade`"


async def current_revision(engine: AsyncEngine) -> str | None:
    async with engine.connect() as connection:
        return await connection.run_sync(_current)


def _current(connection: Connection) -> str | None:
    """The version table read directly: Alembic's MigrationContext logs two INFO lines
    each time it is set up, and the schema watch reads this every 30 s."""
    if not inspect(connection).has_table(VERSION_TABLE):
        return None
    revisions = connection.execute(text(f"SELECT version_num FROM {VERSION_TABLE}")).scalars()
    found = list(revisions)
    if len(found) > 1:
        raise RuntimeError(f"{VERSION_TABLE} holds several revisions: {found}")
    return found[0] if found else None


async def schema_status(engine: AsyncEngine) -> SchemaStatus:
    return SchemaStatus(await current_revision(engine), head_revision())


async def upgrade_to_head(engine: AsyncEngine) -> None:
    await upgrade(engine, "head")


async def upgrade(engine: AsyncEngine, revision: str) -> None:
    async with engine.begin() as connection:
        await connection.run_sync(lambda conn: command.upgrade(alembic_config(conn), revision))


async def downgrade(engine: AsyncEngine, revision: str) -> None:
    async with engine.begin() as connection:
        await connection.run_sync(lambda conn: command.downgrade(alembic_config(conn), revision))
