"""Journal scripts with faults injected: the real Lua, and Redis failing on demand.

Passed to :class:`workers.journal.run_journal.RunJournal` (``scripts=``) or to
:func:`workers.assembly.build_worker`, so tests make Redis fail for the journal
without reaching into its attributes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from workers.journal.scripts import BeginArgs, JournalScripts, WriteHeader, WritePart


class FaultyScripts(JournalScripts):
    def __init__(self, redis: aioredis.Redis) -> None:
        super().__init__(redis)
        self.write_calls = 0
        self.writes_down = False
        """Every write fails, as with Redis gone."""
        self.fail_writes: list[Exception] = []
        """Raised by the next writes instead of running the script."""
        self.lose_write_replies: list[Exception] = []
        """Raised by the next writes after the script ran (the reply was lost)."""
        self.fail_begins: list[Exception] = []
        """Raised by the next leases (a whole ``begin_all`` fails)."""

    async def begin(self, leases: Sequence[tuple[str, str, BeginArgs]]) -> list[Any]:
        if self.fail_begins:
            raise self.fail_begins.pop()
        return await super().begin(leases)

    async def write(self, header: WriteHeader, rows: Sequence[WritePart]) -> list[Any]:
        self.write_calls += 1
        if self.writes_down:
            raise RedisConnectionError("Connection refused")
        if self.fail_writes:
            raise self.fail_writes.pop()
        result = await super().write(header, rows)
        if self.lose_write_replies:
            raise self.lose_write_replies.pop()
        return result
