"""Token chunks written as their events arrive, without waking the stream's task.

A stream that keeps up gets one event per engine step. Waking its task for each one (a
loop callback, the task's step, the async generators between the inbox and the socket)
was the largest share of the gateway's CPU per streamed token. So while a stream is in
its steady state, its task lends the writing to a :class:`TokenPush`: the reply router
offers it each of the request's events as it routes them, and it renders a token
event's chunk and writes it through the server's ``send`` in that same call.

Whatever needs the task goes back to it, in order: a final event, an error, an event
that is not the next of its choice, a ``send`` that has to wait for the client to read
(it finishes in a task of its own, awaited before anything else is sent), the deadline,
and a quiet spell that calls for a keep-alive. The task handles that as it handles
every event of a stream it has not lent, and lends the writing again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator
from typing import Any

from starlette.types import Send

from gateway.dispatch.reply_inbox import TIMER_SLACK_S
from gateway.dispatch.reply_router import StreamInterrupted
from gateway.dispatch.request_handle import RequestHandle
from shared.protocol import Event, TokenEvent

Render = Callable[[TokenEvent], bytes | None]
"""A token event's chunk (None: nothing to send for it yet)."""


class TokenPush:
    """One stream's lender: :meth:`lend` writes its token events until the task is needed."""

    def __init__(self) -> None:
        self.send: Send | None = None
        """The server's own ``send``, set by the response before its body starts (None:
        nothing is lent, every event goes through the task)."""
        self._handle: RequestHandle | None = None
        self._render: Render | None = None
        self._ended: asyncio.Future[bool] | None = None
        self._error: Exception | None = None
        self._in_flight: asyncio.Task[Any] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._quiet_s = 0.0
        self._last_event = 0.0
        """Loop time of the last event taken."""

    async def lend(self, handle: RequestHandle, render: Render, quiet_s: float) -> bool:
        """Write ``handle``'s token events with ``render`` until something needs the task.
        True: nothing came for ``quiet_s`` (send a keep-alive, then lend again). Raises
        what rendering or writing raised.

        Returns False at once while events wait in the handle's inbox (they came while
        the task was writing): the router offers only the events that find it empty, so
        the queued ones would never be taken, and only keep-alives would go out."""
        if self.send is None or handle.has_buffered():
            return False
        loop = self._loop = asyncio.get_running_loop()
        ended: asyncio.Future[bool] = loop.create_future()
        self._ended = ended
        self._handle, self._render, self._quiet_s = handle, render, quiet_s
        self._last_event = loop.time()
        self._arm()
        handle.push_to(self._offer)
        try:
            quiet = await ended
        except asyncio.CancelledError:
            if self._in_flight is not None:
                self._in_flight.cancel()
            raise
        finally:
            self._stop()
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            await in_flight  # the chunk the client was slow to take goes out first
        error, self._error = self._error, None
        if error is not None:
            raise error
        return quiet

    def _offer(self, item: Event | StreamInterrupted) -> bool:
        """The router's call for each of the request's events: True when written here."""
        handle, render = self._handle, self._render
        if handle is None or render is None:
            return False
        if not isinstance(item, TokenEvent) or not handle.take_next(item):
            self._end(quiet=False)
            return False
        assert self._loop is not None
        self._last_event = self._loop.time()  # quiet means no event, as for a pulled stream
        try:
            chunk = render(item)
            if chunk is not None:
                self._write(chunk)
        except Exception as exc:  # the task raises it, where a pulled event's would be
            self._error = exc
            self._end(quiet=False)
        return True

    def _write(self, chunk: bytes) -> None:
        assert self.send is not None and self._loop is not None
        message = {"type": "http.response.body", "body": chunk, "more_body": True}
        step = self.send(message).__await__()
        try:
            waiting_on = step.send(None)
        except StopIteration:
            return
        # The send waits (the client reads slowly): the rest of it runs in a task, and
        # the stream's task takes over until that is done.
        self._in_flight = asyncio.ensure_future(_finish(step, waiting_on))
        self._end(quiet=False)

    def _end(self, *, quiet: bool) -> None:
        if self._handle is not None:
            self._handle.push_to(None)
        if self._ended is not None and not self._ended.done():
            self._ended.set_result(quiet)

    def _stop(self) -> None:
        if self._handle is not None:
            self._handle.push_to(None)
        if self._timer is not None:
            self._timer.cancel()
        self._handle = self._render = self._ended = self._timer = None

    def _arm(self) -> None:
        """One timer per lend, for the keep-alive or the deadline, whichever comes first;
        it moves only when it fires (events only note the time)."""
        assert self._loop is not None and self._handle is not None
        due = min(self._last_event + self._quiet_s, self._loop.time() + self._handle.remaining_s())
        self._timer = self._loop.call_at(due, self._on_timer)

    def _on_timer(self) -> None:
        assert self._loop is not None
        self._timer = None
        if self._handle is None or self._ended is None or self._ended.done():
            return
        if self._handle.remaining_s() <= TIMER_SLACK_S:
            self._end(quiet=False)  # the task ends the request with its timeout error
        elif self._loop.time() >= self._last_event + self._quiet_s - TIMER_SLACK_S:
            self._end(quiet=True)
        else:
            self._arm()


async def _finish(step: Generator[Any, None, Any], waiting_on: Any) -> Any:
    return await _Resumed(step, waiting_on)


class _Resumed:
    """Awaits the rest of an awaitable started by hand (``step``, its ``__await__``) that
    yielded ``waiting_on``: as ``yield from`` would have, had a task started it."""

    def __init__(self, step: Generator[Any, None, Any], waiting_on: Any) -> None:
        self._step = step
        self._waiting_on = waiting_on

    def __await__(self) -> Generator[Any, Any, Any]:
        waiting_on = self._waiting_on
        while True:
            try:
                value = yield waiting_on
            except BaseException as exc:  # the task's cancellation: into the send
                try:
                    waiting_on = self._step.throw(exc)
                except StopIteration as stop:
                    return stop.value
                continue
            try:
                waiting_on = self._step.send(value)
            except StopIteration as stop:
                return stop.value
