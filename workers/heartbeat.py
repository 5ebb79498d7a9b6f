"""A worker's heartbeat, beaten from its own thread with its own Redis connection.

Other workers count a worker as dead once its heartbeat key expires, and take
over its jobs. Beating from the event loop made a busy loop (a 2-core box with
vLLM engines, a long stretch of token output) look dead, so the TTL had to be
long and a killed or frozen worker was found late. From a thread the beat keeps
going through loop stalls, so the TTL can be short; the thread still stops
beating once the loop has not ticked for ``loop_stall_limit_s`` (a hung loop is a
dead worker). A SIGSTOP or SIGKILL stops the thread with the process.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable

import redis
from redis.exceptions import RedisError

log = logging.getLogger(__name__)

TICK_S = 0.25
SLOW_BEAT_S = 0.5
"""A SET taking this long means Redis (not this process's event loop) stalled."""


class HeartbeatThread:
    def __init__(
        self,
        redis_url: str,
        key: str,
        ttl_s: float,
        payload: Callable[[], bytes],
        *,
        loop_stall_limit_s: float = 10.0,
    ) -> None:
        self._client = redis.Redis.from_url(
            redis_url, socket_timeout=max(ttl_s, 1.0), socket_connect_timeout=max(ttl_s, 1.0)
        )
        self._key = key
        self._ttl_ms = int(ttl_s * 1000)
        self._interval_s = ttl_s / 4
        self._payload = payload
        self._stall_limit_s = loop_stall_limit_s
        self._last_tick = time.monotonic()
        self._beat_started = 0.0
        self._beat_busy = False
        self._slow_beat_at = -1e9
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat_forever, name="heartbeat", daemon=True)

    async def run(self) -> None:
        """Tick from the event loop (proof it is alive) while the thread beats."""
        self._thread.start()
        try:
            while True:
                self._last_tick = time.monotonic()
                await asyncio.sleep(TICK_S)
        finally:
            # Joined here, blocking: a beat landing after the worker left the registry
            # would bring it back to life for a TTL.
            self._stop.set()
            self._thread.join(5.0)
            self._client.close()

    def _beat_forever(self) -> None:
        while not self._stop.is_set():
            stalled_s = time.monotonic() - self._last_tick
            if stalled_s <= self._stall_limit_s:
                self._beat()
            else:
                log.error("event loop stalled for %.1fs: no heartbeat until it answers",
                          stalled_s)
            self._stop.wait(self._interval_s)

    def _beat(self) -> None:
        self._beat_started = time.monotonic()
        self._beat_busy = True
        try:
            self._client.set(self._key, self._payload(), px=self._ttl_ms)
        except RedisError as exc:
            self._slow_beat_at = time.monotonic()
            log.warning("heartbeat failed: %s", exc)
        except Exception:  # a payload that cannot be built must not kill the heartbeat
            log.exception("heartbeat payload failed")
        finally:
            self._beat_busy = False
        if time.monotonic() - self._beat_started > SLOW_BEAT_S:
            self._slow_beat_at = time.monotonic()

    def redis_stalled(self, within_s: float) -> bool:
        """Whether Redis stalled lately: a beat hangs now, or one was slow or failed in the
        last ``within_s``. Then every worker's heartbeat may have lapsed, live ones too."""
        now = time.monotonic()
        if self._beat_busy and now - self._beat_started > SLOW_BEAT_S:
            return True
        return now - self._slow_beat_at < within_s
