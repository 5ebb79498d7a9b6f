"""One job's writes in one engine step, as a row of the journal's write script.

Events are encoded as they come; the step's tokens are appended to the job's
emitted-token log, and its token count and final event go to the request's sent
tally (shared/queue/open_requests.py), all in the same script call (workers/journal/run_journal.py).
"""

from __future__ import annotations

import struct
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from shared.protocol import Event, TokenEvent, encode_payload
from shared.queue import names
from shared.queue.open_requests import finish_note
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
    finish_note: tuple[str, str] = ("", "")
    finish: bool = False

    def add(self, event: Event) -> None:
        self.events.append(encode_payload(event))
        if isinstance(event, TokenEvent):
            self.sent_tokens += len(event.token_ids)
        self.finish_note = finish_note(event) or self.finish_note

    def row(self) -> tuple[WriteRow, list[bytes]]:
        lease, stream = self.lease, self.lease.delivery.stream
        row = WriteRow(
            run=lease.run_key,
            emitted=lease.emitted_key,
            fence=lease.fence,
            reply_to=lease.delivery.job.reply_to,
            seq_after=lease.next_seq,
            tokens=pack_tokens(self.tokens),
            ack_stream=stream if self.finish else "",
            ack_entry=lease.delivery.entry_id if self.finish else "",
            done_key=names.stream_done_counter(self.lease.delivery.shared_stream),
            sent=names.sent_tally(lease.delivery.job.request_id),
            sent_tokens=self.sent_tokens,
            now_ms=int(time.time() * 1000),
            finish_field=self.finish_note[0],
            finish_value=self.finish_note[1],
            event_count=len(self.events),
        )
        return row, self.events
