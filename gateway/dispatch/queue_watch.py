"""A queued stream's position, for the SSE comment ``: queued position=12 eta_s=3.4``.

:class:`QueueBoard` (one per cell) reads the waiting part of a job stream at most once
per :data:`QUEUE_POLL_S`, however many streamed requests wait in it; each request's
:class:`QueueWatch` finds its own entry there, and says so only when its position
changed. Nothing is read once any event of the request has arrived.
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import Final

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from gateway.dispatch.drain_rate import DrainMeter
from shared.connections.connect import as_text
from shared.queue import names
from shared.queue.request_status import entry_key, waiting_entries

log = logging.getLogger(__name__)

QUEUE_POLL_S: Final = 1.0


class QueueBoard:
    """The waiting entries of each job stream, read at most once per ``poll_s``."""

    def __init__(self, redis: aioredis.Redis, drain: DrainMeter, poll_s: float = QUEUE_POLL_S):
        self.redis = redis
        self.drain = drain
        self.poll_s = poll_s
        self._read: dict[str, tuple[float, list[tuple[int, int]]]] = {}

    async def position(self, stream: str, entry_id: str) -> int | None:
        """1 + the jobs ahead of the entry in ``stream`` (None: a worker took it)."""
        now = time.monotonic()
        read = self._read.get(stream)
        if read is None or now - read[0] >= self.poll_s:
            read = self._read[stream] = (now, await waiting_entries(self.redis, stream))
        waiting = read[1]
        key = entry_key(entry_id)
        at = bisect.bisect_left(waiting, key)
        return at + 1 if at < len(waiting) and waiting[at] == key else None

    def eta_s(self, stream: str, position: int) -> float | None:
        rate = self.drain.rate_per_s.get(stream, 0.0)
        return position / rate if rate > 0 else None


class QueueWatch:
    """One streamed request's place in its queue."""

    def __init__(self, board: QueueBoard, request_id: str) -> None:
        self._board = board
        self._request_id = request_id
        self._entry: tuple[str, str] | None = None
        self._last: int | None = None

    @property
    def poll_s(self) -> float:
        return self._board.poll_s

    async def comment(self) -> str | None:
        """The comment line to send now (None: not queued, or the position is unchanged)."""
        try:
            position = await self._position()
        except RedisError as exc:
            log.debug("queue position of %s: %s", self._request_id, exc)
            return None
        if position is None or position == self._last or self._entry is None:
            return None
        self._last = position
        eta = self._board.eta_s(self._entry[0], position)
        return f": queued position={position}" + (f" eta_s={eta:.1f}\n" if eta else "\n")

    async def _position(self) -> int | None:
        if self._entry is None:
            redis = self._board.redis
            stream, entry = await redis.hmget(names.request_status(self._request_id), ["s", "e"])
            if stream is None or entry is None:
                return None
            self._entry = (as_text(stream), as_text(entry))
            self._board.drain.watch(self._entry[0])
        return await self._board.position(*self._entry)
