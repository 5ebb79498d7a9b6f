"""Group commit: writes that arrive while one is in flight leave together in the next.

A lone write goes out at once (no timer, no added latency); under load, every request
that ends while a write is on the wire joins the next one, so many requests cost one
round trip. The first caller with nothing in flight does the writing for everyone
queued behind it; each caller returns when its own item is written (or raises what
writing its batch raised).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


class WriterCancelled(Exception):
    """The caller writing this batch was cancelled before the batch was written."""


@dataclass(slots=True)
class _Batch(Generic[T]):
    items: list[T]
    done: asyncio.Future[None]


class GroupCommit(Generic[T]):
    def __init__(self, write_many: Callable[[list[T]], Awaitable[None]]) -> None:
        self._write_many = write_many
        self._next: _Batch[T] | None = None
        self._writing = False

    async def write(self, item: T) -> None:
        batch = self._next
        if batch is None:
            batch = self._next = _Batch([], asyncio.get_running_loop().create_future())
        batch.items.append(item)
        if not self._writing:
            await self._write_batches()
        await asyncio.shield(batch.done)  # a cancelled caller must not cancel a shared batch

    async def _write_batches(self) -> None:
        self._writing = True
        batch: _Batch[T] | None = None
        try:
            while (batch := self._next) is not None:
                self._next = None
                try:
                    await self._write_many(batch.items)
                except Exception as exc:
                    batch.done.set_exception(exc)
                else:
                    batch.done.set_result(None)
        except BaseException:
            for left in (batch, self._next):
                if left is not None and not left.done.done():
                    left.done.set_exception(WriterCancelled())
            self._next = None
            raise
        finally:
            self._writing = False
