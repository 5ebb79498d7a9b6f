"""What a placer decides from, and what it decides.

The dispatcher asks a :class:`Placer` where each new job should wait: on one worker's own
job stream (the worker reads it before the shared one) or on the shared stream of its
(model, role), where any worker may take it. Placers never block and never fail a
request: with nothing to go on they answer :attr:`PlacementReason.SHARED`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

import msgspec

from shared.roles import Role


class PlacementReason(StrEnum):
    CACHE = "cache"
    """The chosen worker holds the most of the prompt's blocks, at an acceptable load."""
    CACHE_KEY = "cache_key"
    """The request's ``prompt_cache_key`` went to the worker that served that key last."""
    LOAD = "load"
    """No worker that holds part of the prompt is worth its load (or there is no prompt to
    match: a decode job): the least loaded one."""
    SHARED = "shared"
    """Not placed: placement is off, no worker can be scored, or every free one holds as
    much of the prompt (none)."""
    FULL = "full"
    """Not placed: every worker that may run the job is full (no free slot, or its KV cache
    nearly full); it waits on the shared stream for the first one with room."""
    STEAL = "steal"
    """A placed job waited too long on its worker and another, idle worker took it."""


class Candidate(msgspec.Struct, frozen=True):
    """A live, ready, non-draining worker of the job's (model, role), as last reported.

    A Struct (built in C) rather than a frozen dataclass: the gateway builds one per
    worker for every request it places, and a frozen dataclass sets each field through
    ``object.__setattr__`` (~1.5 µs a candidate, 16 workers: ~25 µs a request)."""

    worker_id: str
    running: int
    """Sequences the engine is running (decoding or prefilling)."""
    waiting: int
    """Jobs the worker holds that have not started: the engine's queue and its own."""
    free_slots: int
    kv_usage: float
    """KV cache in use, 0.0 to 1.0."""
    queued_prefill_tokens: int
    """Prompt tokens of the jobs the worker holds that are not prefilled yet."""
    adapters: frozenset[str] = frozenset()
    """LoRA adapters the worker has loaded."""


@dataclass(frozen=True, slots=True)
class PlacementRequest:
    model: str
    role: Role
    lora: str | None
    """The LoRA adapter the job runs (None: the base model); its blocks are its own."""
    prompt_token_ids: Sequence[int] | None
    """None when the gateway did not tokenize the prompt (then no cache can be matched)."""
    cache_key: str | None = None
    """OpenAI's ``prompt_cache_key``: requests with one key share a prefix."""


@dataclass(frozen=True, slots=True)
class Placement:
    worker_id: str | None
    """None: the shared stream."""
    reason: PlacementReason
    matched_blocks: int = 0
    """Prompt blocks cached on the chosen worker (CACHE)."""
    cached_tokens: int = 0
    """The prompt tokens those blocks hold: the worker will not prefill them again."""


class Placer(Protocol):
    def place(self, request: PlacementRequest, candidates: Sequence[Candidate]) -> Placement:
        """Where the job should wait. ``candidates`` hold only workers that may run it
        (the adapter loaded, ready, not draining); empty: :attr:`PlacementReason.SHARED`."""
        ...
