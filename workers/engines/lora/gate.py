"""The adapter gate: how many distinct LoRA adapters have sequences in the engine at once.

An engine has a fixed number of adapter slots per step. vLLM's own scheduler keeps a
step within them, but on CPU the fix for base requests (see
:mod:`workers.engines.vllm.lora`) takes one slot for itself, so the engine's scheduler
would let one adapter too many into a step. The gate keeps it out: a sequence of an
adapter that is not running yet waits until fewer than ``max_active`` adapters run.

Waiting is first come, first served: while anyone waits, a new sequence of a running
adapter queues behind them too (else a busy adapter could starve the others). Base
model sequences (``None``) never wait. An adapter can be closed (on its way out): its
new sequences are refused, its running ones finish (:meth:`idle` waits for them).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter, deque
from collections.abc import AsyncIterator


class LoraClosed(Exception):
    """The adapter is being unloaded: no new sequence may use it."""


class LoraGate:
    def __init__(self, max_active: int) -> None:
        if max_active < 1:
            raise ValueError("max_active must be at least 1")
        self.max_active = max_active
        self._running: Counter[str] = Counter()
        self._closed: set[str] = set()
        self._waiters: deque[tuple[str, asyncio.Future[None]]] = deque()
        self._idle: list[tuple[str, asyncio.Future[None]]] = []

    def in_flight(self, name: str) -> int:
        return self._running[name]

    def active(self) -> set[str]:
        """Adapters with sequences in the engine now."""
        return set(self._running)

    def waiting(self) -> int:
        return sum(not future.done() for _, future in self._waiters)

    @contextlib.asynccontextmanager
    async def hold(self, name: str | None) -> AsyncIterator[None]:
        """Hold while one sequence of ``name`` runs (raises :class:`LoraClosed`)."""
        if name is None:
            yield
            return
        await self._enter(name)
        try:
            yield
        finally:
            self._release(name)

    def close(self, name: str) -> None:
        """Refuse new sequences of ``name`` (waiting ones are refused too)."""
        self._closed.add(name)
        self._wake()

    def reopen(self, name: str) -> None:
        self._closed.discard(name)

    async def idle(self, name: str) -> None:
        """Wait until no sequence of ``name`` runs."""
        if not self._running[name]:
            return
        future = asyncio.get_running_loop().create_future()
        self._idle.append((name, future))
        await future

    async def _enter(self, name: str) -> None:
        if name in self._closed:
            raise LoraClosed(name)
        if not self.waiting() and self._admits(name):
            self._running[name] += 1
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append((name, future))
        try:
            await future  # resolved by _wake, with the slot already counted
        except asyncio.CancelledError:
            if future.done() and not future.cancelled() and future.exception() is None:
                self._release(name)  # admitted, then cancelled before it resumed
            self._wake()
            raise

    def _release(self, name: str) -> None:
        self._running[name] -= 1
        if self._running[name] <= 0:
            del self._running[name]
            self._wake()

    def _admits(self, name: str) -> bool:
        return name in self._running or len(self._running) < self.max_active

    def _wake(self) -> None:
        """Admit waiters from the head of the line while they fit; refuse closed ones."""
        while self._waiters:
            name, future = self._waiters[0]
            if future.done():
                self._waiters.popleft()
            elif name in self._closed:
                self._waiters.popleft()
                future.set_exception(LoraClosed(name))
            elif self._admits(name):
                self._waiters.popleft()
                self._running[name] += 1
                future.set_result(None)
            else:
                break
        still = []
        for name, future in self._idle:
            if future.done():
                continue
            if self._running[name]:
                still.append((name, future))
            else:
                future.set_result(None)
        self._idle = still
