"""What one request delivered, counted from the events its handle yields, and what it
costs against its key: the source of its usage row and of its limit settlement.

Counting at the handle (after duplicates are dropped) means a migrated or retried
sequence is never counted twice, and a client that left mid-stream pays for the
tokens it was sent, no more.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gateway.dispatch.plan import AnyPlan, Embedding
from shared.protocol import EmbeddingEvent, ErrorEvent, Event, FinishEvent, TokenEvent
from shared.queue.usage import UsageRecord, UsageStatus


def reserved_tokens(plan: AnyPlan) -> int:
    """Tokens a request may use at most: every prompt plus every choice's ``max_tokens``."""
    work = plan.work
    if isinstance(work, Embedding):
        return sum(len(prompt) for prompt in work.prompts)
    return sum(len(choice.prompt_token_ids) + choice.sampling.max_tokens for choice in work.choices)


def prompt_tokens(plan: AnyPlan) -> int:
    """The plan's prompt tokens, every prompt once (as usage counts them)."""
    work = plan.work
    if isinstance(work, Embedding):
        return sum(len(prompt) for prompt in work.prompts)
    return sum(len(choice.prompt_token_ids) for choice in work.choices[:: work.choices_per_prompt])


def sequences(plan: AnyPlan) -> int:
    work = plan.work
    return len(work.prompts) if isinstance(work, Embedding) else len(work.choices)


@dataclass(slots=True)
class RequestTally:
    received_unix: float
    choices_per_prompt: int = 1
    prompt_tokens_by_prompt: dict[int, int] = field(default_factory=dict)
    cached_tokens_by_prompt: dict[int, int] = field(default_factory=dict)
    completion_tokens: int = 0
    first_token_unix: float | None = None
    finish_reasons: list[str] = field(default_factory=list)
    failed: bool = False
    migrations: int = 0
    token_gaps_s: list[float] = field(default_factory=list)
    """Time between one choice's token events (vLLM's inter-token latencies)."""
    tokens_by_choice: dict[int, int] = field(default_factory=dict)
    queue_times_s: list[float] = field(default_factory=list)
    """Per sequence run on its first attempt: admission to a worker beginning it."""
    _last_token_unix: dict[int, float] = field(default_factory=dict)

    def note(self, event: Event) -> None:
        self.migrations = max(self.migrations, event.attempt)
        if isinstance(event, TokenEvent):
            self._note_tokens(event)
        elif isinstance(event, FinishEvent):
            prompt = event.index // self.choices_per_prompt
            self.prompt_tokens_by_prompt[prompt] = event.prompt_tokens
            if event.cached_tokens is not None:
                self.cached_tokens_by_prompt[prompt] = event.cached_tokens
            self.finish_reasons.append(event.finish_reason)
            if event.started_unix is not None and event.attempt == 0:
                self.queue_times_s.append(max(0.0, event.started_unix - self.received_unix))
        elif isinstance(event, EmbeddingEvent):
            self.prompt_tokens_by_prompt[event.index] = event.prompt_tokens
        elif isinstance(event, ErrorEvent):
            self.failed = True

    def _note_tokens(self, event: TokenEvent) -> None:
        now = time.time()
        if self.first_token_unix is None:
            self.first_token_unix = now
        last = self._last_token_unix.get(event.index)
        if last is not None:
            self.token_gaps_s.append(now - last)
        self._last_token_unix[event.index] = now
        self.completion_tokens += len(event.token_ids)
        self.tokens_by_choice[event.index] = self.tokens_by_choice.get(event.index, 0) + len(
            event.token_ids
        )

    @property
    def prompt_tokens(self) -> int:
        return sum(self.prompt_tokens_by_prompt.values())

    @property
    def cached_prompt_tokens(self) -> int | None:
        """None when the engine reported no prefix-cache figure."""
        if not self.cached_tokens_by_prompt:
            return None
        return sum(self.cached_tokens_by_prompt.values())

    def used_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def record(self, plan: AnyPlan, key_id: str | None, *, cancelled: bool) -> UsageRecord:
        status: UsageStatus = "completed"
        if self.failed:
            status = "failed"
        elif cancelled:
            status = "cancelled"
        return UsageRecord(
            request_id=plan.request_id,
            key_id=key_id,
            model=plan.model,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            cached_prompt_tokens=self.cached_prompt_tokens,
            status=status,
            received_unix=self.received_unix,
            finished_unix=time.time(),
            first_token_unix=self.first_token_unix,
            finish_reason=self.finish_reasons[0] if len(set(self.finish_reasons)) == 1 else None,
            n=sequences(plan),
            migrations=self.migrations,
        )
