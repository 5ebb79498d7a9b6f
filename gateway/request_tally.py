"""What one request delivered, counted from the events its handle yields, and what it
costs against its key: the source of its usage row and of its limit settlement.

Counting at the handle (after duplicates are dropped) means a migrated or retried
sequence is never counted twice, and a client that left mid-stream pays for the
tokens it was sent, no more.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gateway.plan import AnyPlan, Embedding
from shared.protocol import EmbeddingEvent, ErrorEvent, Event, FinishEvent, TokenEvent
from shared.usage import UsageRecord, UsageStatus


def reserved_tokens(plan: AnyPlan) -> int:
    """Tokens a request may use at most: every prompt plus every choice's ``max_tokens``."""
    work = plan.work
    if isinstance(work, Embedding):
        return sum(len(prompt) for prompt in work.prompts)
    return sum(len(choice.prompt_token_ids) + choice.sampling.max_tokens for choice in work.choices)


@dataclass(slots=True)
class RequestTally:
    received_unix: float
    choices_per_prompt: int = 1
    prompt_tokens_by_prompt: dict[int, int] = field(default_factory=dict)
    completion_tokens: int = 0
    first_token_unix: float | None = None
    finish_reasons: list[str] = field(default_factory=list)
    failed: bool = False
    migrations: int = 0

    def note(self, event: Event) -> None:
        self.migrations = max(self.migrations, event.attempt)
        if isinstance(event, TokenEvent):
            if self.first_token_unix is None:
                self.first_token_unix = time.time()
            self.completion_tokens += len(event.token_ids)
        elif isinstance(event, FinishEvent):
            self.prompt_tokens_by_prompt[event.index // self.choices_per_prompt] = (
                event.prompt_tokens
            )
            self.finish_reasons.append(event.finish_reason)
        elif isinstance(event, EmbeddingEvent):
            self.prompt_tokens_by_prompt[event.index] = event.prompt_tokens
        elif isinstance(event, ErrorEvent):
            self.failed = True

    @property
    def prompt_tokens(self) -> int:
        return sum(self.prompt_tokens_by_prompt.values())

    def used_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def record(self, plan: AnyPlan, key_id: str | None, *, cancelled: bool) -> UsageRecord:
        status: UsageStatus = "completed"
        if self.failed:
            status = "failed"
        elif cancelled:
            status = "cancelled"
        work = plan.work
        sequences = len(work.prompts) if isinstance(work, Embedding) else len(work.choices)
        return UsageRecord(
            request_id=plan.request_id,
            key_id=key_id,
            model=plan.model,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            status=status,
            received_unix=self.received_unix,
            finished_unix=time.time(),
            first_token_unix=self.first_token_unix,
            finish_reason=self.finish_reasons[0] if len(set(self.finish_reasons)) == 1 else None,
            n=sequences,
            migrations=self.migrations,
        )
