"""One request's inbox: the reply router puts its events in, its handle takes them out.

A bounded FIFO with one reader, cheaper per event than ``asyncio.Queue`` with a timeout
around each wait. A stream waits for nearly every token it sends (the next one comes a
step later), and a timeout scope per wait schedules and cancels a loop timer each time;
here one timer per inbox stays armed while it is quiet, and a wait only moves the
moment it is due (a float): the timer, when it fires early, re-arms for that moment.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")

TIMER_SLACK_S = 0.001
"""A timer may fire this much before its moment (uvloop's run in whole milliseconds)."""


class ReplyInbox(Generic[T]):
    """Items in arrival order, at most ``limit`` waiting; one reader at a time."""

    __slots__ = ("_due", "_items", "_limit", "_room", "_taker", "_timer", "_waiter")

    def __init__(self, limit: int) -> None:
        self._items: deque[T] = deque()
        self._limit = limit
        self._waiter: asyncio.Future[bool] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._due = 0.0
        """Loop time at which the current wait times out."""
        self._room: asyncio.Future[None] | None = None
        """A writer waiting for room (:meth:`put`)."""
        self._taker: Callable[[T], bool] | None = None

    def put_nowait(self, item: T) -> None:
        """Raises :class:`asyncio.QueueFull` when ``limit`` items are waiting."""
        taker = self._taker
        if taker is not None and not self._items and taker(item):
            return
        if len(self._items) >= self._limit:
            raise asyncio.QueueFull
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(True)

    async def put(self, item: T) -> None:
        """Put ``item`` once there is room for it."""
        while len(self._items) >= self._limit:
            if self._room is None:
                self._room = asyncio.get_running_loop().create_future()
            await self._room
        self.put_nowait(item)

    def take_with(self, taker: Callable[[T], bool] | None) -> None:
        """While set, an item put into an empty inbox is offered to ``taker`` first, in the
        writer's call; it returns False to leave the item queued, as without it."""
        self._taker = taker

    def get_nowait(self) -> T:
        """Raises :class:`asyncio.QueueEmpty` when nothing is waiting."""
        if not self._items:
            raise asyncio.QueueEmpty
        return self._take()

    def _take(self) -> T:
        item = self._items.popleft()
        if self._room is not None:
            self._made_room()
        return item

    def _made_room(self) -> None:
        room, self._room = self._room, None
        if room is not None and not room.done():
            room.set_result(None)

    def peek(self) -> T | None:
        """The next item, left in place (None: nothing waiting)."""
        return self._items[0] if self._items else None

    def empty(self) -> bool:
        return not self._items

    def qsize(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        self._items.clear()
        self._made_room()

    def close(self) -> None:
        """The reader is done: no timer keeps the inbox alive."""
        self._disarm()

    async def get(self, timeout_s: float | None = None) -> T:
        """The next item, waiting up to ``timeout_s`` (None: as long as it takes); raises
        :class:`TimeoutError`."""
        if self._items:
            return self._take()
        loop = asyncio.get_running_loop()
        self._due = math.inf if timeout_s is None else loop.time() + timeout_s
        if self._due < math.inf and (self._timer is None or self._timer.when() > self._due):
            self._arm(loop)
        waiter = self._waiter = loop.create_future()
        try:
            arrived = await waiter
        except asyncio.CancelledError:
            self._disarm()
            raise
        finally:
            self._waiter = None
        if not arrived:
            raise TimeoutError
        return self._take()

    def _arm(self, loop: asyncio.AbstractEventLoop) -> None:
        self._disarm()
        self._timer = loop.call_at(self._due, self._on_timer, loop)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timer(self, loop: asyncio.AbstractEventLoop) -> None:
        self._timer = None
        waiter = self._waiter
        if waiter is None or waiter.done() or self._due == math.inf:
            return  # nobody waits for a time: the next wait with a timeout arms it again
        if loop.time() >= self._due - TIMER_SLACK_S:
            waiter.set_result(False)
        else:
            self._arm(loop)  # items came meanwhile and the wait began again later
