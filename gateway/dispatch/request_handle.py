"""One queued request inside the gateway: its events, in order, until every sequence ends.

A :class:`RequestHandle` has one owner, who holds it in ``async with``: the SSE
response for a stream, the serving step for one JSON body. Leaving that block is
the one place a request ends on every path (finished, failed, client gone, stream
cut): its route on the reply stream closes, and a request with unfinished sequences
is cancelled on the workers (the dispatcher sends the cancel from a shielded task).
Per-request accounting that must happen exactly once when a request ends (usage,
a key's concurrency slot) belongs there too.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from types import TracebackType
from typing import NoReturn

from gateway.dispatch.plan import Deadline
from gateway.dispatch.reply_inbox import ReplyInbox
from gateway.dispatch.reply_router import StreamInterrupted
from gateway.dispatch.request_tally import RequestTally
from shared.errors import BackendUnavailable, DeadlineExceeded, RepliesLost
from shared.protocol import FINAL_EVENTS, Event, TokenEvent
from shared.token_runs import can_join, joined

log = logging.getLogger(__name__)


class RequestHandle:
    """Events of one request's sequences; leaving ``async with`` cancels what has not
    finished."""

    def __init__(
        self,
        request_id: str,
        sequences: int,
        queue: ReplyInbox[Event | StreamInterrupted],
        deadline: Deadline,
        on_close: Callable[[bool], None],
        *,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.request_id = request_id
        self.headers = dict(headers or {})
        """Response headers the request's admission produced (``x-ratelimit-*``)."""
        self.tally = RequestTally(received_unix=deadline.created_unix)
        self._queue = queue
        self._unfinished = sequences
        self._next_seq: dict[int, int] = {}
        self._attempt: dict[int, int] = {}
        """Per choice: the run (attempt) whose event was taken last."""
        self.duplicates_dropped = 0
        self._deadline = deadline
        self._on_close = on_close
        self._closed = False
        self._held: Event | None = None
        """The first event, taken by :meth:`first` and yielded again by :meth:`events`."""

    async def __aenter__(self) -> RequestHandle:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if not self._closed:
            self._closed = True
            self._queue.close()
            self._on_close(self._unfinished > 0)  # True: cancel what is still running

    async def events(self, *, idle_timeout_s: float | None = None) -> AsyncIterator[Event | None]:
        """Yields events until every sequence ended; ``None`` after ``idle_timeout_s`` of quiet."""
        if self._held is not None:
            held, self._held = self._held, None
            yield held
        while self._unfinished > 0:
            remaining = self._deadline.remaining_s()
            if remaining <= 0:
                raise DeadlineExceeded("the request timed out before the model finished")
            wait = remaining if idle_timeout_s is None else min(idle_timeout_s, remaining)
            try:
                item = await self._queue.get(wait)
            except TimeoutError:
                if self._deadline.remaining_s() <= 0:
                    raise DeadlineExceeded(
                        "the request timed out before the model finished"
                    ) from None
                yield None
                continue
            if isinstance(item, StreamInterrupted):
                raise item.error or BackendUnavailable(item.reason)
            if not self._in_order(item):
                continue
            if isinstance(item, FINAL_EVENTS):
                self._unfinished -= 1
            self.tally.note(item)
            yield item

    async def first(self) -> Event:
        """Wait for the request's first event and keep it: :meth:`events` yields it first
        (a stream can see a worker's refusal before it sends its 200)."""
        async for event in self.events():
            if event is not None:
                self._held = event
                return event
        raise BackendUnavailable("the request ended without an event")

    def take_next(self, event: TokenEvent) -> bool:
        """Take ``event`` as :meth:`events` would, when it is the next of its choice (no
        repeat, no gap) and no event is held; False (nothing done): :meth:`events` takes it."""
        index = event.index
        if self._held is not None or event.seq != self._next_seq.get(index, 0):
            return False
        self._next_seq[index] = event.seq + 1
        self._attempt[index] = event.attempt
        self.tally.note(event)
        return True

    def push_to(self, taker: Callable[[Event | StreamInterrupted], bool] | None) -> None:
        """While set, ``taker`` is offered each event as it arrives (see
        :meth:`ReplyInbox.take_with`); one it takes must go through :meth:`take_next`."""
        self._queue.take_with(taker)

    @property
    def finished(self) -> bool:
        """Whether every sequence has ended (its final event taken)."""
        return self._unfinished <= 0

    def remaining_s(self) -> float:
        """Seconds left before the request's deadline."""
        return self._deadline.remaining_s()

    def join_buffered(self, event: TokenEvent) -> TokenEvent:
        """``event`` joined with the token events of its sequence already queued right
        behind it (see :mod:`shared.token_runs`), taken as :meth:`events` takes them;
        numbered as the last of them. Never waits: with nothing queued it is ``event``."""
        run = [event]
        while self._held is None and can_join(event, following := self._queue.peek()):
            self._queue.get_nowait()
            assert isinstance(following, TokenEvent)
            if self._in_order(following):
                self.tally.note(following)
                run.append(following)
        return joined(run, seq=run[-1].seq)

    @property
    def started(self) -> bool:
        """Whether any event of the request has arrived (taken or still queued)."""
        return bool(self._next_seq) or self.has_buffered()

    def has_buffered(self) -> bool:
        """Events already arrived and not yet yielded (a writer can batch them)."""
        return self._held is not None or not self._queue.empty()

    def _in_order(self, event: Event) -> bool:
        """Drop repeats (seq already seen for this choice); a gap ends the request.

        A job's events are written in order by one fenced writer (workers/journal/run_journal.py),
        so
        a seq that skips ahead means events were lost in Redis, never that they are late.
        """
        expected = self._next_seq.get(event.index, 0)
        if event.seq < expected:
            if event.attempt > self._attempt.get(event.index, 0):
                self._rolled_back(event, expected)
            self.duplicates_dropped += 1
            return False
        if event.seq > expected:
            log.error(
                "%s choice %d: seq gap %d..%d: reply events lost; ending the request",
                self.request_id,
                event.index,
                expected,
                event.seq - 1,
            )
            raise RepliesLost(
                f"events {expected}..{event.seq - 1} of choice {event.index} were lost on "
                "their way back from the worker (Redis lost acknowledged writes, as in a "
                "fail-over); the output so far is incomplete: retry the request"
            )
        self._next_seq[event.index] = event.seq + 1
        self._attempt[event.index] = event.attempt
        return True

    def _rolled_back(self, event: Event, expected: int) -> NoReturn:
        """A new run of the job began before what this request already has: Redis lost
        the writes of the tokens sent since (a fail-over), so the new run continues a
        shorter text than the client's, and the two cannot be joined."""
        log.error(
            "%s choice %d: run %d resumed at seq %d, before the %d events already sent: "
            "Redis lost acknowledged writes; ending the request",
            self.request_id,
            event.index,
            event.attempt,
            event.seq,
            expected,
        )
        raise RepliesLost(
            f"choice {event.index} was resumed from before events the client already "
            f"has ({event.seq}..{expected - 1}): Redis lost acknowledged writes, as in a "
            "fail-over; the output so far cannot be continued: retry the request"
        )
