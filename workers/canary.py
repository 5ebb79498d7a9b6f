"""Idle canary: after a quiet spell, a 1-token greedy request proves the engine still answers.

A canary that fails or takes longer than its timeout marks the worker not
ready (gateways stop counting it) without killing it; the next good canary
marks it ready again.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

from shared.errors import ConveyorError
from shared.protocol import SamplingOptions
from workers.engines.base import Engine

log = logging.getLogger(__name__)

CANARY_PROMPT = [0]
CANARY_SAMPLING = SamplingOptions(max_tokens=1, temperature=0.0)


class Canary:
    def __init__(
        self,
        engine: Engine,
        *,
        idle_s: float = 10.0,
        timeout_s: float = 3.0,
        embeds: bool = False,
        probe: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._engine = engine
        self._embeds = embeds
        self._probe = probe
        self._idle_s = idle_s
        self._timeout_s = timeout_s
        self._last_activity = time.monotonic()
        self.healthy = True

    def note_activity(self) -> None:
        self._last_activity = time.monotonic()

    async def run(self, busy: Callable[[], bool]) -> None:
        while True:
            await asyncio.sleep(1.0)
            if busy():
                self.note_activity()
            elif self._due() and await self.probe():
                self.note_activity()  # a failed probe is retried a second later

    def _due(self) -> bool:
        return time.monotonic() - self._last_activity >= self._idle_s

    async def _ask(self, request_id: str) -> None:
        if self._probe is not None:  # an engine that neither generates nor embeds
            await self._probe()
            return
        if self._embeds:  # a pooling engine cannot generate
            await self._engine.embed(request_id, CANARY_PROMPT)
            return
        async for _ in self._engine.generate(request_id, CANARY_PROMPT, CANARY_SAMPLING):
            pass

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
