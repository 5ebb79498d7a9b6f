"""One job's writes in one engine step, as a row of the journal's write script.

Events are encoded as they come; the step's tokens are appended to the job's
emitted-token log, and its token count and final event go to the request's sent
tally (shared/queue/open_requests.py), all in the same script call (workers/journal/run_journal.py).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.protocol import Event, TokenEvent, encode_payload
from shared.queue.open_requests import finish_note
from shared.token_runs import can_join, joined
from workers.journal.scripts import WriteRow

if TYPE_CHECKING:
    from workers.journal.run_journal import RunLease

_TOKEN = struct.Struct("<i")


def pack_tokens(token_ids: list[int]) -> bytes:
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

    def row(self, now_ms: int) -> tuple[WriteRow, list[bytes]]:
        self._close_tail()
        lease, stream = self.lease, self.lease.delivery.stream
        redis_names = lease.redis_names
        row = WriteRow(
            run=redis_names.run,
            emitted=redis_names.emitted,
            fence=lease.fence,
            reply_to=lease.delivery.job.reply_to,
            seq_after=lease.next_seq,
            tokens=pack_tokens(self.tokens),
            chars=self.chars if lease.counts_chars else 0,
            ack_stream=stream if self.finish else "",
            ack_entry=lease.delivery.entry_id if self.finish else "",
            done_key=redis_names.done,
            sent=redis_names.sent,
            sent_tokens=self.sent_tokens,
            now_ms=now_ms,
            finish_field=self.finish_note[0],
            finish_value=self.finish_note[1],
            event_count=len(self.events),
        )
        return row, self.events
