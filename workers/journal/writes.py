"""One job's writes in one engine step, as a row of the journal's write script.

Events are encoded as they come; the step's tokens are appended to the job's
emitted-token log, and its token count and final event go to the request's sent
tally (shared/queue/open_requests.py), all in the same script call (workers/journal/run_journal.py).
A row carries a tail (:class:`workers.journal.scripts.WriteTail`) only when the job
finishes or its run touches the tally: its first write with tokens records the first-token
time, and a later one sets the tally's TTL again only once a share of it has passed
(``SENT_REFRESH_SHARE`` in workers/journal/run_journal.py).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.protocol import Event, TokenEvent, encode_payload
from shared.queue.open_requests import finish_note
from shared.token_runs import can_join, joined
from workers.journal.scripts import WritePart, WriteRow, WriteTail

if TYPE_CHECKING:
    from workers.journal.run_journal import RunLease

_TOKEN = struct.Struct("<i")


def pack_tokens(token_ids: list[int]) -> bytes:
    if len(token_ids) == 1:  # a decode step's usual share: no format string to build
        return _TOKEN.pack(token_ids[0])
    return struct.pack(f"<{len(token_ids)}i", *token_ids)


def unpack_tokens(data: bytes) -> list[int]:
    return [value for (value,) in _TOKEN.iter_unpack(data)]


@dataclass(slots=True)
class JobWrites:
    """One job's writes in one pass of the journal (one engine step), and its row."""

    lease: RunLease
    events: list[bytes] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    sent_tokens: int = 0
    chars: int = 0
    finish_note: tuple[str, str] = ("", "")
    finish: bool = False
    tail: TokenEvent | None = None
    """The last event while it is a token event: not encoded yet, so that the next one
    may join it."""

    def add(self, event: Event) -> None:
        self._close_tail()
        if isinstance(event, TokenEvent):
            self.sent_tokens += len(event.token_ids)
            self.chars += len(event.text)
            self.tail = event
        else:
            self.events.append(encode_payload(event))
        self.finish_note = finish_note(event) or self.finish_note

    def join(self, event: TokenEvent) -> bool:
        """Add ``event`` to the token event before it, as one event (see
        :mod:`shared.token_runs`) that keeps the first one's seq; False (nothing done)
        unless ``event`` is the one numbered right after it and the last numbered yet.
        ``event``'s seq goes back to the lease: the next event takes it."""
        tail, lease = self.tail, self.lease
        if tail is None or not can_join(tail, event):
            return False
        if event.seq != tail.seq + 1 or lease.next_seq != event.seq + 1:
            return False
        self.tail = joined([tail, event], seq=tail.seq)
        self.sent_tokens += len(event.token_ids)
        self.chars += len(event.text)
        lease.next_seq = event.seq
        return True

    def _close_tail(self) -> None:
        if self.tail is not None:
            self.events.append(encode_payload(self.tail))
            self.tail = None

    def row(self, now_ms: int, refresh_ms: int) -> WritePart:
        """The job's part of the write sent at ``now_ms``: row, tail (:meth:`row_tail`) and
        events."""
        self._close_tail()
        lease = self.lease
        redis_names = lease.redis_names
        row_tail = self.row_tail(now_ms, refresh_ms)
        row = WriteRow(
            run=redis_names.run,
            emitted=redis_names.emitted,
            fence=lease.fence,
            reply_to=lease.delivery.job.reply_to,
            seq_after=lease.next_seq,
            tokens=pack_tokens(self.tokens),
            chars=self.chars if lease.counts_chars else 0,
            sent=redis_names.sent,
            sent_tokens=self.sent_tokens,
            event_count=len(self.events),
            tail=0 if row_tail is None else 1,
        )
        return row, row_tail, self.events

    def row_tail(self, now_ms: int, refresh_ms: int) -> WriteTail | None:
        """The row's tail, or None when it needs none: a finish (or final event) needs one,
        and so do tokens when they are the run's first, or when this run last set the
        tally's TTL ``refresh_ms`` or more ago (the lease keeps that time)."""
        lease, sends_tokens = self.lease, self.sent_tokens > 0
        refreshed = lease.sent_refreshed_ms
        first_tokens = sends_tokens and refreshed is None
        if sends_tokens and (refreshed is None or now_ms - refreshed >= refresh_ms):
            lease.sent_refreshed_ms = now_ms
        elif not self.finish and not self.finish_note[0]:
            return None
        delivery = lease.delivery
        return WriteTail(
            first_token_ms=now_ms if first_tokens else 0,
            ack_stream=delivery.stream if self.finish else "",
            ack_entry=delivery.entry_id if self.finish else "",
            done_key=lease.redis_names.done if self.finish else "",
            finish_field=self.finish_note[0],
            finish_value=self.finish_note[1],
        )
