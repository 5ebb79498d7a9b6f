"""The usage ledger's consumer: ``conveyor:usage`` (Redis stream) -> ``usage_records`` (SQL).

Every gateway process runs one consumer of the ``ledger`` group. Its loop:

1. now and then, take over entries another consumer (a dead gateway) left idle
   (XAUTOCLAIM): they join this consumer's pending list;
2. read a batch: this consumer's pending entries first (left by a failed insert or
   just reclaimed), else new entries (XREADGROUP BLOCK); after a batch that was not
   full, linger a moment first, so rows are written many to a transaction;
3. decode; an entry that cannot be decoded goes to the dead-letter stream;
4. insert the batch in one transaction, skipping request ids already in the ledger;
5. only after the commit, XACK + XDEL the batch in one script call.

A database error leaves the batch pending: back off (0.1 s, doubling to 5 s) and go
to 2, which reads the same entries again. Rows are delayed, never lost, and never
doubled (step 4 is idempotent, so a crash between 4 and 5 costs nothing).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError, ResponseError
from sqlalchemy.exc import DataError, IntegrityError, SQLAlchemyError
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from gateway.db import usage_repo
from gateway.db.engine import first_line
from shared.connections.connect import MAX_BLOCK_MS, as_text
from shared.errors import ProtocolError
from shared.queue import names
from shared.queue.usage import UsageRecord, decode_usage

_ACK_DELETE = """
-- KEYS: the usage stream. ARGV: its consumer group, then the entry ids.
redis.call('XACK', KEYS[1], ARGV[1], unpack(ARGV, 2))
return redis.call('XDEL', KEYS[1], unpack(ARGV, 2))
"""

log = logging.getLogger(__name__)

FORGET_AFTER_MS = 3_600_000
"""A consumer (a gateway process) silent this long with nothing pending is removed."""

RawEntry = tuple[str, dict[bytes, bytes] | None]
"""A stream entry as read: id and fields (None: deleted while pending)."""

DATABASE_ERRORS = (SQLAlchemyError, OSError, TimeoutError)
"""What a database outage looks like from here: retried, never dropped."""


@dataclass(frozen=True, slots=True)
class LedgerPolicy:
    batch_size: int = 256
    block_ms: int = min(1000, MAX_BLOCK_MS)
    claim_idle_ms: int = 30_000
    """An entry pending this long with no retry (its consumer is gone) is taken over. A live
    consumer retries its pending entries every ``backoff_max_s`` at most, far more often."""
    reclaim_every_s: float = 5.0
    backoff_initial_s: float = 0.1
    backoff_max_s: float = 5.0
    linger_s: float = 1.0
    """After a batch smaller than ``batch_size``, wait this long before reading again so
    rows reach SQL in batches: a transaction per request cost the gateway ~1 ms of CPU
    per request under load. Rows are delayed by it, never lost (they wait in Redis)."""


@dataclass(frozen=True, slots=True)
class Entry:
    entry_id: str
    fields: dict[bytes, bytes]
    record: UsageRecord


@dataclass(slots=True)
class LedgerStatus:
    db_ok: bool = True
    last_error: str | None = None
    rows_written: int = 0
    duplicates_skipped: int = 0
    dead_lettered: int = 0
    last_commit_unix: float | None = None


class LedgerConsumer:
    def __init__(
        self,
        redis: aioredis.Redis,
        sessions: async_sessionmaker[AsyncSession],
        consumer: str,
        policy: LedgerPolicy = LedgerPolicy(),
    ) -> None:
        self._redis = redis
        self._ack_delete = redis.register_script(_ACK_DELETE)
        self._sessions = sessions
        self.consumer = consumer
        self._policy = policy
        self._claim_cursor = "0-0"
        self._next_reclaim = 0.0
        self.status = LedgerStatus()

    async def ensure_group(self) -> None:
        try:
            await self._redis.xgroup_create(
                names.USAGE_STREAM, names.USAGE_GROUP, id="0", mkstream=True
            )
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def run(self) -> None:
        backoff_s = self._policy.backoff_initial_s
        grouped = False
        while True:
            try:
                if not grouped:  # again after an error: Redis may have restarted empty
                    await self.ensure_group()
                    grouped = True
                started = time.monotonic()
                handled = await self.step()
                if not handled:
                    await self._idle(started)
                elif handled < self._policy.batch_size:
                    await asyncio.sleep(self._policy.linger_s)
                backoff_s = self._policy.backoff_initial_s
            except DATABASE_ERRORS as exc:
                self._database_failed(exc)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, self._policy.backoff_max_s)
            except RedisError as exc:
                grouped = False
                log.warning("ledger: Redis error, retrying: %s", exc)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, self._policy.backoff_max_s)
            except Exception:  # a bug must not stop the ledger: log it and go on
                log.exception("ledger: unexpected error, retrying")
                await asyncio.sleep(self._policy.backoff_max_s)

    async def _idle(self, started: float) -> None:
        """A read that found nothing returned before its BLOCK time was up (a server that
        does not block, e.g. a fake): wait out the rest instead of spinning."""
        left_s = self._policy.block_ms / 1000 - (time.monotonic() - started)
        if left_s > 0:
            await asyncio.sleep(left_s)

    async def step(self) -> int:
        """One batch: reclaim (now and then), read, write, ack. Returns entries handled."""
        if time.monotonic() >= self._next_reclaim:
            await self._reclaim()
            self._next_reclaim = time.monotonic() + self._policy.reclaim_every_s
        entries = await self._read_pending() or await self._read_new()
        if not entries:
            return 0
        batch = await self._decode(entries)
        done = await self._write(batch)
        await self._ack(done)
        return len(entries)

    # ---------------------------------------------------------------- reading

    async def _reclaim(self) -> None:
        reply: Any = await self._redis.xautoclaim(
            names.USAGE_STREAM,
            names.USAGE_GROUP,
            self.consumer,
            min_idle_time=self._policy.claim_idle_ms,
            start_id=self._claim_cursor,
            count=self._policy.batch_size,
        )  # [next cursor, claimed entries, deleted ids]; the claimed are read again below
        self._claim_cursor = as_text(reply[0])
        if reply[1]:
            log.info("ledger: took over %d entries from a gone consumer", len(reply[1]))
        await self._forget_gone_consumers()

    async def _forget_gone_consumers(self) -> None:
        """Every gateway process is a new consumer: drop those idle for long with nothing
        pending, so the group does not grow with every restart."""
        consumers: Any = await self._redis.xinfo_consumers(names.USAGE_STREAM, names.USAGE_GROUP)
        for consumer in consumers:
            name = as_text(consumer["name"])
            idle_ms = int(consumer["idle"])
            if name != self.consumer and not consumer["pending"] and idle_ms > FORGET_AFTER_MS:
                await self._redis.xgroup_delconsumer(names.USAGE_STREAM, names.USAGE_GROUP, name)

    async def _read_pending(self) -> list[RawEntry]:
        return await self._xreadgroup("0", block_ms=None)

    async def _read_new(self) -> list[RawEntry]:
        return await self._xreadgroup(">", block_ms=self._policy.block_ms)

    async def _xreadgroup(self, start: str, *, block_ms: int | None) -> list[RawEntry]:
        reply: Any = await self._redis.xreadgroup(
            names.USAGE_GROUP,
            self.consumer,
            {names.USAGE_STREAM: start},
            count=self._policy.batch_size,
            block=block_ms,
        )
        entries: list[RawEntry] = []
        for _stream, rows in reply or []:
            entries += [(as_text(entry_id), fields or None) for entry_id, fields in rows]
        return entries

    async def _decode(self, entries: Sequence[RawEntry]) -> list[Entry]:
        batch: list[Entry] = []
        for entry_id, fields in entries:
            if fields is None:  # deleted while pending (already written): just ack it
                await self._ack([entry_id])
                continue
            try:
                batch.append(Entry(entry_id, fields, decode_usage(fields)))
            except ProtocolError as exc:
                await self._dead_letter(entry_id, fields, f"undecodable: {exc}")
        return batch

    # ---------------------------------------------------------------- writing

    async def _write(self, batch: list[Entry]) -> list[str]:
        """Commit the batch; returns the entry ids that may be acked. A row the table refuses
        (a data error, not an outage) is isolated and dead-lettered, not retried forever."""
        if not batch:
            return []
        try:
            inserted = await self._insert([entry.record for entry in batch])
        except (IntegrityError, DataError) as exc:
            if len(batch) == 1:
                entry = batch[0]
                await self._dead_letter(entry.entry_id, entry.fields, f"refused: {exc}")
                return []
            done: list[str] = []
            for entry in batch:
                done += await self._write([entry])
            return done
        self._committed(len(batch), inserted)
        return [entry.entry_id for entry in batch]

    async def _insert(self, records: Sequence[UsageRecord]) -> int:
        now = datetime.now(UTC)
        async with self._sessions.begin() as session:
            return await usage_repo.insert_batch(session, [usage_row(r, now) for r in records])

    async def _ack(self, entry_ids: Sequence[str]) -> None:
        if not entry_ids:
            return
        await self._ack_delete(keys=[names.USAGE_STREAM], args=[names.USAGE_GROUP, *entry_ids])

    async def _dead_letter(self, entry_id: str, fields: Mapping[bytes, bytes], reason: str) -> None:
        log.error(
            "ledger: usage entry %s goes to %s: %s", entry_id, names.USAGE_DEAD_LETTER, reason
        )
        body = dict(fields)
        body[b"error"] = reason[:1000].encode()
        body[b"entry_id"] = entry_id.encode()
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.xadd(names.USAGE_DEAD_LETTER, body)  # type: ignore[arg-type]
            pipe.xack(names.USAGE_STREAM, names.USAGE_GROUP, entry_id)
            pipe.xdel(names.USAGE_STREAM, entry_id)
            await pipe.execute()
        self.status.dead_lettered += 1

    # ---------------------------------------------------------------- status

    def _committed(self, rows: int, inserted: int) -> None:
        if not self.status.db_ok:
            log.info("ledger: database reachable again; writing usage rows")
        self.status.db_ok = True
        self.status.last_error = None
        self.status.rows_written += inserted
        self.status.duplicates_skipped += rows - inserted
        self.status.last_commit_unix = time.time()

    def _database_failed(self, exc: BaseException) -> None:
        message = first_line(exc)
        if self.status.db_ok:
            log.warning("ledger: cannot write usage rows (kept in Redis, retrying): %s", message)
        self.status.db_ok = False
        self.status.last_error = message


def usage_row(record: UsageRecord, recorded_at: datetime) -> dict[str, Any]:
    """A record as a ``usage_records`` row."""
    return {
        "request_id": record.request_id,
        "key_id": record.key_id,
        "model": record.model,
        "prompt_tokens": record.prompt_tokens,
        "completion_tokens": record.completion_tokens,
        "cached_prompt_tokens": record.cached_prompt_tokens,
        "n": record.n,
        "finish_reason": record.finish_reason,
        "status": record.status,
        "migrations": record.migrations,
        "received_at": _utc(record.received_unix),
        "first_token_at": _utc(record.first_token_unix) if record.first_token_unix else None,
        "finished_at": _utc(record.finished_unix),
        "recorded_at": recorded_at,
    }


def _utc(unix: float) -> datetime:
    return datetime.fromtimestamp(unix, UTC)


async def backlog(redis: aioredis.Redis) -> int:
    """Usage entries not yet in SQL (queued or being written)."""
    return int(await redis.xlen(names.USAGE_STREAM))
