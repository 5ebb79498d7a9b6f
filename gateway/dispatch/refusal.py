"""Why admission refused a request: what the gateway's metrics count
(``conveyor_admissions_refused_total``, ``conveyor_key_limit_refusals_total``)."""

from __future__ import annotations

from dataclasses import dataclass

from shared.errors import (
    BackendUnavailable,
    IdempotencyConflict,
    NoLiveWorker,
    Overloaded,
)


@dataclass(frozen=True, slots=True)
class Refusal:
    model: str
    reason: str
    """full, limited, duplicate, no_worker or unavailable."""
    key_id: str | None = None
    limit: str | None = None
    """limited: the key's limit that ran out (requests, tokens, concurrency, budget)."""


def refusal_reason(error: BaseException) -> str | None:
    """The reason of a refusal raised while queueing (None: not a refusal, or a key's
    limit, which is counted where its kind is known)."""
    if isinstance(error, Overloaded):
        return "full"
    if isinstance(error, IdempotencyConflict):
        return "duplicate"
    if isinstance(error, NoLiveWorker):
        return "no_worker"
    if isinstance(error, BackendUnavailable):
        return "unavailable"
    return None
