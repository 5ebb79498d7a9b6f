"""Consecutive token events of one sequence joined into one (a run of tokens).

A writer that is behind (a worker's journal waiting on Redis, a gateway stream whose
client or loop is slow) finds several token events of a sequence waiting; sent as one
event (one reply entry row, one SSE chunk) they cost once instead of once each. The
joined event reads exactly as its parts read in a row: the text and token ids
concatenated, the logprobs one list; it keeps the first event's seq on a worker (the
seq numbers its events) and takes the last one's in a gateway stream (an SSE ``id:`` names
the last event the client has).
"""

from __future__ import annotations

import msgspec

from shared.protocol import TokenEvent


def can_join(run: TokenEvent, following: object) -> bool:
    """Whether ``following`` continues ``run`` as one event: a token event of the same
    sequence and run that brings no prompt logprobs (those go on a run's first event)."""
    return (
        isinstance(following, TokenEvent)
        and following.index == run.index
        and following.attempt == run.attempt
        and following.request_id == run.request_id
        and following.prompt_logprobs is None
    )


def joined(events: list[TokenEvent], *, seq: int) -> TokenEvent:
    """``events`` (each :func:`can_join` its predecessor) as one event numbered ``seq``."""
    first = events[0]
    if len(events) == 1 and first.seq == seq:
        return first
    token_ids = [token for event in events for token in event.token_ids]
    logprobs = None
    if any(event.logprobs is not None for event in events):
        logprobs = [entry for event in events for entry in event.logprobs or ()]
    return msgspec.structs.replace(
        first,
        seq=seq,
        token_ids=token_ids,
        text="".join(event.text for event in events),
        logprobs=logprobs,
    )
