"""A resumable request's events, read from its own reply stream by any gateway, any time.

A resumable request (a background response, a stream its client may resume) names its
own reply stream, ``reply_stream(request_holder(id))``, in its jobs: workers write its
events there exactly as to a gateway's stream, and every reader, the first one
included, reads them from there (:class:`RequestLog`), from the start or from any
entry. The stream is opened at admission with a marker entry and a TTL (the request's
deadline plus the resume grace period), so it never outlives its usefulness, even when
no reader comes back: a worker's ``XADD`` keeps the TTL. It is not trimmed by length: a
late reader needs every event; it holds at most one entry per engine step of each
sequence (bounded by ``max_tokens``), and its TTL is cut short when the request ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.connections.connect import MAX_BLOCK_MS, as_text
from shared.connections.retry import Backoff
from shared.errors import ProtocolError
from shared.protocol import Event, decode_events
from shared.queue import names

log = logging.getLogger(__name__)

OPENED = b"opened"
"""The field of the marker entry that creates the stream (it carries no events)."""


def log_stream(request_id: str) -> str:
    return names.reply_stream(names.request_holder(request_id))


class RequestLog:
    def __init__(self, redis: aioredis.Redis, request_id: str, *, block_ms: int = 1000) -> None:
        self._redis = redis
        self.request_id = request_id
        self.stream = log_stream(request_id)
        self._block_ms = min(block_ms, MAX_BLOCK_MS)

    async def open(self, ttl_s: float) -> None:
        """Create the stream with its TTL (before the jobs are queued)."""
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.xadd(self.stream, {OPENED: b"1"})
            pipe.pexpire(self.stream, int(ttl_s * 1000))
            await pipe.execute()

    async def keep_for(self, ttl_s: float) -> None:
        await self._redis.pexpire(self.stream, int(ttl_s * 1000))

    async def exists(self) -> bool:
        return bool(await self._redis.exists(self.stream))

    async def everything(self) -> list[Event]:
        """Every event written so far, in order (one read)."""
        entries: Any = await self._redis.xrange(self.stream)
        return [event for _, fields in entries for event in _events(fields)]

    async def follow(self, after: str = "0-0") -> AsyncIterator[list[Event]]:
        """The events of each entry after ``after``, as they are written, forever (the
        caller stops reading); rides out Redis trouble with a backoff."""
        last = after
        backoff = Backoff(first_s=0.1, max_s=2.0)
        while True:
            try:
                reply: Any = await self._redis.xread(
                    {self.stream: last}, count=256, block=self._block_ms
                )
                backoff.reset()
            except RedisError as exc:
                delay = backoff.next_delay()
                log.warning("reading the events of %s failed (%s)", self.request_id, exc)
                await asyncio.sleep(delay)
                continue
            if not reply:
                await asyncio.sleep(0.005)  # a Redis that does not block (fakeredis)
                continue
            for _stream, entries in reply:
                for raw_id, fields in entries:
                    last = as_text(raw_id)
                    events = _events(fields)
                    if events:
                        yield events


def _events(fields: dict[bytes, bytes]) -> list[Event]:
    if OPENED in fields:
        return []
    try:
        return [event for event in decode_events(fields) if isinstance(event, Event)]
    except ProtocolError as exc:
        log.error("dropping undecodable reply: %s", exc)
        return []
