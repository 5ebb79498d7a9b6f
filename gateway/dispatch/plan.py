"""A request, planned once: the one value the serving step hands the dispatcher.

The serving step (:mod:`gateway.serving.endpoints`) reads the OpenAI request and builds a
:class:`RequestPlan`: its id, model, sequences (``n`` choices per prompt, or one per
embedding input), images, deadline and idempotency key. The dispatcher
(:mod:`gateway.dispatch.dispatcher`) turns a plan into jobs of the internal protocol without
looking at the OpenAI request again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Generic, TypeVar

from shared.protocol import ImageRef, SamplingOptions
from shared.queue.key_limits import LimitCharge


@dataclass(frozen=True, slots=True)
class Deadline:
    """When a request arrived and when it must be done: resolved once, from its timeout."""

    created_unix: float
    deadline_unix: float

    @classmethod
    def after(cls, timeout_s: float) -> Deadline:
        now = time.time()
        return cls(created_unix=now, deadline_unix=now + timeout_s)

    @property
    def timeout_s(self) -> float:
        return self.deadline_unix - self.created_unix

    def remaining_s(self) -> float:
        return self.deadline_unix - time.time()


@dataclass(frozen=True, slots=True)
class ChoiceSpec:
    """One sequence to generate: the OpenAI choice index and its prompt."""

    index: int
    prompt_token_ids: list[int]
    sampling: SamplingOptions


@dataclass(frozen=True, slots=True)
class Generation:
    """Chat and text completions: ``n`` choices per prompt, in OpenAI's choice order."""

    choices: tuple[ChoiceSpec, ...]
    images: tuple[ImageRef, ...]
    """The prompt's images, in the order of its image placeholders."""
    choices_per_prompt: int = 1
    """``n``: choice ``i`` answers prompt ``i // n``."""

    def longest_prompt(self) -> int:
        return max(len(choice.prompt_token_ids) for choice in self.choices)


@dataclass(frozen=True, slots=True)
class Embedding:
    """``/v1/embeddings``: one sequence per input."""

    prompts: tuple[list[int], ...]
    dimensions: int | None


W = TypeVar("W", Generation, Embedding)


@dataclass(frozen=True, slots=True)
class Resume:
    """A resumable request (:mod:`gateway.dispatch.request_log`): its events go to its own
    reply stream, and it runs while someone holds its lease."""

    holder: str
    """Who keeps its lease: a gateway's id (a background response) or ``client`` (an
    attached stream: any gateway a client reads it from)."""
    lease_s: float
    """The lease's TTL: the request is aborted once nobody renewed it for this long (plus
    the workers' grace period)."""
    keep_s: float
    """How long its events stay readable after its deadline."""


@dataclass(frozen=True, slots=True)
class RequestPlan(Generic[W]):
    request_id: str
    model: str
    """The served model's name."""
    work: W
    deadline: Deadline
    idempotency_key: str | None
    key_id: str | None = None
    """The API key the request acts under (None while auth is off)."""
    charge: LimitCharge | None = None
    """What it costs against its key's limits (None: the key has none)."""
    adapter: str | None = None
    """The LoRA adapter it runs with (``model`` is the adapter's name then)."""
    base_model: str | None = None
    """The model whose workers (and Redis) serve it: ``model``, or the adapter's base."""
    cache_key: str | None = None
    """OpenAI's ``prompt_cache_key``: placement's affinity hint (requests sharing a prefix)."""
    traceparent: str | None = None
    """The request's trace context, carried by its jobs (None: not traced)."""
    resume: Resume | None = None
    """Set for a resumable request (None: its events go to this gateway's reply stream)."""

    @property
    def served_by(self) -> str:
        """The base model: the one whose Redis and workers take the request."""
        return self.base_model or self.model


AnyPlan = RequestPlan[Generation] | RequestPlan[Embedding]
