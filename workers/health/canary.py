"""Idle canary: after a quiet spell, a tiny request proves the engine still answers.

The request is the role's probe (one greedy token, one embedding, one small
image: see :mod:`workers.roles`). A canary that fails or takes longer than its
timeout marks the worker not ready (gateways stop counting it) without killing
it; the next good canary marks it ready again.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

from shared.errors import ConveyorError

log = logging.getLogger(__name__)

CANARY_TICK_S = 1.0
CANARY_TIMEOUT_S = 3.0


class Canary:
    def __init__(
        self,
        ask: Callable[[str], Awaitable[None]],
        *,
        idle_s: float,
        timeout_s: float = CANARY_TIMEOUT_S,
        tick_s: float = CANARY_TICK_S,
    ) -> None:
        self._ask = ask
        self._idle_s = idle_s
        self._timeout_s = timeout_s
        self._tick_s = tick_s
        self._last_activity = time.monotonic()
        self.healthy = True

    def note_activity(self) -> None:
        self._last_activity = time.monotonic()

    async def run(self, busy: Callable[[], bool]) -> None:
        while True:
            await asyncio.sleep(self._tick_s)
            if busy():
                self.note_activity()
            elif self._due() and await self.probe():
                self.note_activity()  # a failed probe is retried a tick later

    def _due(self) -> bool:
        return time.monotonic() - self._last_activity >= self._idle_s

    async def probe(self) -> bool:
        started = time.monotonic()
        try:
            async with asyncio.timeout(self._timeout_s):
                await self._ask(f"canary-{uuid.uuid4().hex[:8]}")
        except (TimeoutError, ConveyorError) as exc:
            if self.healthy:
                log.error("canary failed (%s): marking this worker not ready", exc or "timeout")
            self.healthy = False
            return False
        if not self.healthy:
            log.info("canary answered in %.3fs: worker ready again", time.monotonic() - started)
        self.healthy = True
        return True
