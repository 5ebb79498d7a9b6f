"""Token return path, gateway side: each gateway process reads its own reply stream.

Workers append events to it through :mod:`workers.journal.run_journal` (one fenced script
call per engine step). :class:`ReplyRouter` runs one ``XREAD BLOCK`` loop over
the stream and routes events into bounded per-request inboxes; a watchdog ends
every open request with a clean error when Redis stays unreachable.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.dispatch.reply_inbox import ReplyInbox
from shared.connections.connect import MAX_BLOCK_MS, as_text
from shared.connections.retry import Backoff
from shared.errors import ConveyorError, ProtocolError, RequestCancelled
from shared.protocol import (
    CancelCommand,
    EmbeddingEvent,
    ErrorEvent,
    Event,
    FinishEvent,
    Message,
    TokenEvent,
    decode_events,
)

log = logging.getLogger(__name__)


class StreamInterrupted(Exception):
    """Events for a request stopped for a reason other than the request ending;
    ``error``: what the request ends with (default: a 503 with ``reason``)."""

    def __init__(self, reason: str, error: ConveyorError | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.error = error


class ReplyRouter:
    """Reads this gateway's reply stream and hands each event to its request's queue."""

    def __init__(
        self,
        redis: aioredis.Redis,
        stream: str,
        *,
        queue_size: int = 65536,
        keep_history_s: float = 120.0,
        block_ms: int = 2000,
        outage_limit_s: float = 6.0,
        watchdog_tick_s: float = 1.0,
    ) -> None:
        self._redis = redis
        self.stream = stream
        self._queue_size = queue_size
        self._keep_history_ms = int(keep_history_s * 1000)
        self._routes: dict[str, ReplyInbox[Event | StreamInterrupted]] = {}
        self._last_id = "0-0"
        self._block_ms = min(block_ms, MAX_BLOCK_MS)
        self._outage_limit_s = outage_limit_s
        self._watchdog_tick_s = watchdog_tick_s
        self.watchdog_checks = 0
        """Times the watchdog has looked (tests wait on it, not on its clock)."""
        self._last_ok = time.monotonic()
        self.connected = asyncio.Event()
        self.on_reconnect: Callable[[], Awaitable[None]] | None = None
        """Called when a read succeeds after one failed: Redis may have restarted or
        failed over, and lost writes it had acknowledged (the dispatcher checks)."""

    def open(self, request_id: str) -> ReplyInbox[Event | StreamInterrupted]:
        inbox: ReplyInbox[Event | StreamInterrupted] = ReplyInbox(self._queue_size)
        self._routes[request_id] = inbox
        return inbox

    def close(self, request_id: str) -> None:
        self._routes.pop(request_id, None)

    def open_requests(self) -> int:
        return len(self._routes)

    async def run(self) -> None:
        watchdog = asyncio.create_task(self._watchdog(), name="reply-watchdog")
        try:
            await self._read_forever()
        finally:
            watchdog.cancel()

    async def _watchdog(self) -> None:
        """End open requests cleanly when Redis has been unreachable too long."""
        limit = self._block_ms / 1000 + self._outage_limit_s
        while True:
            await asyncio.sleep(self._watchdog_tick_s)
            silent = time.monotonic() - self._last_ok
            if silent > limit and self._routes:
                log.error(
                    "no answer from Redis for %.0fs: ending %d open requests",
                    silent,
                    len(self._routes),
                )
                self.interrupt_all(f"lost contact with Redis for {silent:.0f}s; retry")
            self.watchdog_checks += 1

    def interrupt_all(self, reason: str) -> None:
        self.interrupt(list(self._routes), reason)

    def interrupt(
        self, request_ids: Iterable[str], reason: str, error: ConveyorError | None = None
    ) -> None:
        """End these requests (those still open) with ``reason`` (raised as ``error``)."""
        for request_id in request_ids:
            queue = self._routes.pop(request_id, None)
            if queue is not None:
                queue.clear()
                queue.put_nowait(StreamInterrupted(reason, error))

    async def _read_forever(self) -> None:
        last_trim = time.monotonic()
        backoff = Backoff(first_s=0.1, max_s=2.0)
        reconnecting = False
        while True:
            try:
                reply: Any = await self._redis.xread(
                    {self.stream: self._last_id}, count=1024, block=self._block_ms
                )
                self._last_ok = time.monotonic()
                self.connected.set()
                backoff.reset()
            except RedisError as exc:
                self.connected.clear()
                reconnecting = True
                delay = backoff.next_delay()
                log.warning("reply stream read failed (%s); retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)
                continue
            if reconnecting:
                reconnecting = False
                if self.on_reconnect is not None:
                    await self.on_reconnect()
            for _stream, entries in reply or []:
                for raw_id, fields in entries:
                    self._last_id = as_text(raw_id)
                    self._route(fields)
            if time.monotonic() - last_trim > 10:
                last_trim = time.monotonic()
                await self._trim()

    def _route(self, fields: dict[bytes, bytes]) -> None:
        try:
            events = decode_events(fields)
        except ProtocolError as exc:
            log.error("dropping undecodable reply: %s", exc)
            return
        for event in events:
            self._route_one(event)

    def _route_one(self, event: Message) -> None:
        if isinstance(event, TokenEvent | FinishEvent | ErrorEvent | EmbeddingEvent):
            queue = self._routes.get(event.request_id)
            if queue is None:
                return  # the request is already closed (client gone): late events are moot
            try:
                queue.put_nowait(event)
            except asyncio.QueueFull:
                self._routes.pop(event.request_id, None)
                queue.clear()
                queue.put_nowait(StreamInterrupted("the client read the stream too slowly"))
        elif isinstance(event, CancelCommand):  # POST /v1/requests/{id}/cancel, any gateway
            error = RequestCancelled("the request was cancelled (POST /v1/requests/{id}/cancel)")
            self.interrupt([event.request_id], error.message, error)

    async def _trim(self) -> None:
        min_ms = int(self._last_id.split("-")[0]) - self._keep_history_ms
        if min_ms > 0:
            try:
                await self._redis.xtrim(self.stream, minid=str(min_ms), approximate=True)
            except RedisError as exc:
                log.warning("reply stream trim failed: %s", exc)
